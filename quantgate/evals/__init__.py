"""Eval sets and eval runs: the dataset, the chat client, scoring with the metric modules, and paired statistics."""
