"""Plumbing with no domain words: errors, paths, atomic files and processes, YAML loading. Imports nothing else of quantgate."""
