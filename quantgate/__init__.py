"""quantgate: quantize an LLM for its target hardware, validate it against the baseline, gate its release."""

__version__ = "0.1.0"
