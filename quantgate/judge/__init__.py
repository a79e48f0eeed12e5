"""The LLM judge: template and verdicts (pure), calibration pairs, the client, the run, and human review."""
