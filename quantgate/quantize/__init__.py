"""Quantization: the scheme catalogue and ranking, recipes, pre-flight checks, calibration data and the llmcompressor runner."""
