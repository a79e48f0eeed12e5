"""State shared between slow test modules of one pytest session (plain module globals, no fixtures needed).

CHECKPOINTS: scheme -> demo-model checkpoint that tests/test_quantize.py quantized in this session, named as the
release flow names its own (results/checkpoints/<model hash 12>-<scheme>-<quantization key 12>). The release end-to-end test copies a
matching one into its results folder, and the flow reuses it when its inputs (model, scheme, recipe, calibration,
hardware) give the same key, so one GPTQ quantization serves both tests. Run alone, each test quantizes itself.
"""

from pathlib import Path

CHECKPOINTS: dict[str, Path] = {}

# A recipe `ignore` pattern that keeps every decoder layer of the demo model (30 of them) but layer 0 at 16 bits: a
# real checkpoint of a scheme from seconds of llmcompressor, for tests of its format or of where it runs, not of its
# quality. In a spec's YAML, quote it with single quotes (its backslashes are literal there).
LAYER0_ONLY = r"re:model\.layers\.([1-9]|[12][0-9])\..*"
