"""Plumbing with no domain words: errors, paths, atomic files, locks and processes, YAML loading, statistics, one
OpenAI-compatible HTTP client. Imports nothing else of quantgate."""
