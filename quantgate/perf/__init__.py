"""Serving performance: the probe through vLLM's benchmark client, its record, and candidate/baseline ratios."""
