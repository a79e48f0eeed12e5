"""Quantization wall time and size per scheme on the demo model (llmcompressor in a child process, as in a release).

    python bench/quantize_demo.py [--schemes fp8-dynamic,int8-w8a8,w4a16-gptq,w4a16-awq] [--samples 64] [--seq-len 256]
                                  [--out DIR]

Each scheme is quantized fresh into a temporary folder (nothing is reused) unless --out is given, in which case
finished artifacts there are reused and their recorded times shown. Calibration defaults are the schemes' own
(schemes.yaml: 64 samples x 256 tokens from quant_recipes/calibration/default.jsonl).
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quantgate.quantize.calibration import CalibrationSpec
from quantgate.quantize.run import QuantizeRequest, quantize
from quantgate.target.catalogue import ensure_demo_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="fp8-dynamic,int8-w8a8,w4a16-gptq,w4a16-awq")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model = ensure_demo_model()
    root = args.out or Path(tempfile.mkdtemp(prefix="quantgate-bench-"))
    cal = CalibrationSpec(samples=args.samples, max_seq_length=args.seq_len)
    print(f"demo model {model}  machine {platform.machine()} {platform.processor() or ''}  output {root}")
    print(f"{'scheme':12} {'reused':>6} {'wall s':>8} {'oneshot s':>9} {'calib':>9} {'weights MB':>10} {'disk MB':>8} {'ratio':>6}")
    src = None
    for scheme in args.schemes.split(","):
        res = quantize(QuantizeRequest(model=model, scheme=scheme, out=root / scheme, calibration=cal))
        m = res.manifest.dump()
        src = m["source"]["weights_bytes"]
        c = m["calibration"]
        calib = f"{c['samples']}x{c['max_seq_length']}" if c else "none"
        print(f"{scheme:12} {str(res.reused):>6} {m['timings_s']['wall']:>8} {m['timings_s']['oneshot_s']:>9} {calib:>9} "
              f"{m['weights_bytes'] / 1e6:>10.1f} {m['size_on_disk_bytes'] / 1e6:>8.1f} {m['compression_ratio']:>6}", flush=True)
    if src:
        print(f"source BF16 weights: {src / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
