"""State shared between slow test modules of one pytest session (plain module globals, no fixtures needed).

CHECKPOINTS: scheme -> demo-model checkpoint that tests/test_quantize.py quantized in this session, named as the
release flow names its own (results/checkpoints/<model hash 12>-<scheme>-<quantization key 12>). The release end-to-end test copies a
matching one into its results folder, and the flow reuses it when its inputs (model, scheme, recipe, calibration,
hardware) give the same key, so one GPTQ quantization serves both tests. Run alone, each test quantizes itself.
"""

from pathlib import Path

CHECKPOINTS: dict[str, Path] = {}
