"""The Python side of scripts/gpu_check.sh: one prepared check of quantgate's GPU path on a bare NVIDIA machine.

  gpu_check.py wheels [--lock FILE]          the wheels `prepare` fetches (name, version from the lock): a dry run
  gpu_check.py prepare DIR [--lock FILE]     here, with PyPI: `pip download --no-deps` of them, plus the demo tokenizer
  gpu_check.py install DIR                   on the GPU machine, in a --system-site-packages venv: install what the
                                             system lacks (llmcompressor and compressed-tensors always), offline
  gpu_check.py build-model OUT [--layers N] [--device D] [--tokenizer DIR]
                                             a model of the demo's shape (SmolLM2-135M) with random weights
  gpu_check.py run OUT [--wheels DIR] [--serve-python PY] [--eval-samples N] [--layers N] [--cpu] [--calib-samples N]
                                             build, quantize (fp8-dynamic, w4a16-gptq), parity reference, serve + eval
                                             (--cpu: the same steps on the CPU, to test this script without a GPU)

The wheel set is llmcompressor and compressed-tensors with the small pure or one-file dependencies a machine that
has torch and transformers may lack (loguru, accelerate, datasets' small helpers, evaluate, quantgate's pydantic,
httpx, rich ...), each at the version pipeline.lock pins, and for CPython 3.11 to 3.13 where a wheel is built per
version. Two declared dependencies are left out to stay near 40 MB, as nothing here imports them: auto-round (only
llmcompressor's AutoRoundModifier uses it) and hf-xet (Hub downloads; the machine is offline). Large libraries are
expected on the machine: torch (2.10 to 2.14), numpy, pyarrow and pandas (for `datasets`), lxml (sacrebleu: without
it the eval leaves out the BLEU/chrF samples); `install` names what is missing. transformers, huggingface-hub and
tokenizers are brought too and installed only where the machine's are absent or older than llmcompressor needs.

Figures (a table, and OUT/figures.json): seconds of each step, peak GPU memory (torch.cuda.max_memory_allocated),
checkpoint sizes, the parity verdict and the eval accuracy. Exit codes: 0 done, 2 no GPU, 3 missing libraries,
1 a step failed (its error is printed).
"""

from __future__ import annotations

import argparse
import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "pipeline.lock"
SHAPE = REPO / "tests" / "data" / "demo_shape"          # the demo model's config.json (no weights)
NO_GPU = "no NVIDIA GPU visible"
EXIT_NO_GPU, EXIT_MISSING = 2, 3
PYTHONS = ("3.11", "3.12", "3.13")  # the lock's pins (filelock, regex, typer) have no 3.10 wheels
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
ALWAYS = ("llmcompressor", "compressed-tensors")
# quantgate's own imports on this path (quantize, parity, serving, evals): installed where the machine lacks them
ROOTS = ("pydantic", "pyyaml", "httpx", "psutil", "rich", "datasets", "evaluate", "sacrebleu", "transformers")
WHEELS = ALWAYS + ROOTS + (
    "loguru", "accelerate", "nvidia-ml-py", "pydantic-core", "annotated-types", "typing-inspection",
    "typing-extensions", "httpcore", "h11", "anyio", "sniffio", "idna", "certifi", "pygments", "markdown-it-py", "mdurl",
    "dill", "multiprocess", "xxhash", "fsspec", "portalocker", "tabulate", "colorama", "regex", "huggingface-hub",
    "tokenizers", "safetensors", "filelock", "packaging", "tqdm", "requests", "urllib3", "charset-normalizer",
    "click", "shellingham", "typer")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")
SCHEMES = ("fp8-dynamic", "w4a16-gptq")
COLUMNS = (("step", "step"), ("device", "device"), ("dtype", "dtype"), ("seconds", "s"), ("peak_gpu_mib", "peak GPU MiB"),
           ("size_mib", "size MiB"), ("result", "result"))


def norm(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins(lock_text: str) -> dict[str, tuple[str, str]]:
    """{normalized name: (name as written, version)} of a pip-freeze lock file."""
    out = {}
    for line in lock_text.splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line.strip())
        if m:
            out[norm(m.group(1))] = (m.group(1), m.group(2))
    return out


def wheel_pins(lock_text: str) -> list[tuple[str, str]]:
    """(name, version) of every wheel in WHEELS, at the lock's version; a name the lock lacks is an error."""
    pins = lock_pins(lock_text)
    missing = [n for n in WHEELS if norm(n) not in pins]
    if missing:
        raise SystemExit(f"requirements/pipeline.lock has no pin for {missing}: add them or drop them from WHEELS")
    return [pins[norm(n)] for n in WHEELS]


def download_commands(dest: Path, pins: list[tuple[str, str]]) -> list[list[str]]:
    """One `pip download --no-deps` per target Python: pure wheels are fetched once, per-version ones per version."""
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    reqs = [f"{n}=={v}" for n, v in pins]
    return [[sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--implementation", "cp",
             "--python-version", py, *plats, "-d", str(dest), *reqs] for py in PYTHONS]


def prepare(dest: Path, lock: Path, tokenizer: Path | None, dry_run: bool) -> int:
    """Fetch the wheel set into `dest` (and the demo tokenizer's files into dest/tokenizer); print what it holds."""
    cmds = download_commands(dest, wheel_pins(lock.read_text(encoding="utf-8")))
    if dry_run:  # what would be fetched: the target Pythons, then one pin a line
        print(f"pythons: {' '.join(PYTHONS)}")
        print("\n".join(cmds[0][cmds[0].index("-d") + 2:]))
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    missed = []
    for cmd in cmds:
        if subprocess.run(cmd, capture_output=True, text=True).returncode != 0:  # some pin lacks a wheel for this Python
            missed += _one_by_one(cmd)
    if tokenizer is not None:
        (dest / "tokenizer").mkdir(exist_ok=True)
        for f in TOKENIZER_FILES:
            if (tokenizer / f).is_file():
                shutil.copy(tokenizer / f, dest / "tokenizer" / f)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    (dest / "prepared.json").write_text(json.dumps({"lock": lock.name, "pythons": PYTHONS, "no_wheel": missed,
                                                    "bytes": size}, indent=2), encoding="utf-8")
    print(f"{dest}: {len(list(dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB")
    if missed:  # no network, or a pin without a wheel for a target Python: the folder is incomplete, say so
        print(f"pip download found no wheel for: {', '.join(missed)} (network to PyPI? a pin without a wheel for "
              "that Python: change PYTHONS or the pin)", file=sys.stderr)
        return 1
    return 0


def _one_by_one(cmd: list[str]) -> list[str]:
    start = cmd.index("-d") + 2
    py = cmd[cmd.index("--python-version") + 1]
    return [f"{r} (Python {py})" for r in cmd[start:]
            if subprocess.run(cmd[:start] + [r], capture_output=True, text=True).returncode != 0]


def wheel_requires(wheel: Path) -> list[str]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(z.read(meta).decode("utf-8")).get_all("Requires-Dist") or []


def install_plan(requires: dict[str, list[str]], installed: dict[str, str | None]) -> list[str]:
    """Which wheels to install (normalized names): ALWAYS; ROOTS the machine lacks; and, transitively, every wheel a
    chosen one requires that is absent or at a version outside the requirement. `requires`: normalized wheel name ->
    its Requires-Dist lines; `installed`: normalized name -> the machine's version (None: absent)."""
    from packaging.requirements import Requirement

    chosen = [norm(n) for n in ALWAYS] + [norm(n) for n in ROOTS if installed.get(norm(n)) is None]
    i = 0
    while i < len(chosen):
        for line in requires.get(chosen[i], []):
            req = Requirement(line)
            name = norm(req.name)
            if name not in requires or name in chosen or (req.marker and not req.marker.evaluate({"extra": ""})):
                continue
            have = installed.get(name)
            if have is None or not req.specifier.contains(have, prereleases=True):
                chosen.append(name)
        i += 1
    return chosen


def _compatible_wheels(folder: Path) -> dict[str, Path]:
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    ours, out = set(sys_tags()), {}
    for whl in sorted(folder.glob("*.whl")):
        name, _, _, tags = parse_wheel_filename(whl.name)
        if tags & ours:
            out.setdefault(norm(name), whl)
    return out


def install(folder: Path) -> int:
    """Install into this interpreter (a --system-site-packages venv) what install_plan picks, offline, no deps."""
    from importlib import metadata

    wheels = _compatible_wheels(folder)
    lacking = [n for n in map(norm, WHEELS) if n not in wheels]
    if lacking:
        print(f"{folder} has no wheel for this Python ({sys.version.split()[0]}): {', '.join(lacking)}; run "
              "`scripts/gpu_check.sh --prepare DIR` again", file=sys.stderr)
        return EXIT_MISSING

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    plan = install_plan({n: wheel_requires(w) for n, w in wheels.items()}, {n: version(n) for n in wheels})
    print(f"installing {len(plan)} wheels: {', '.join(plan)}")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", *[str(wheels[n]) for n in plan]]
    if subprocess.run(cmd).returncode != 0:
        return 1
    missing = missing_imports()
    soft = {m: why for m, why in missing.items() if m in SOFT_IMPORTS}
    if soft:
        print(f"note: {', '.join(f'{m} ({why})' for m, why in soft.items())}: the eval leaves out the samples scored "
              "with BLEU/chrF (sacrebleu needs lxml, too large to carry for every Python)", file=sys.stderr)
    hard = {m: why for m, why in missing.items() if m not in SOFT_IMPORTS}
    if hard:
        print("these do not import here, and the machine must bring them (too large to carry, or broken):\n  "
              + "\n  ".join(f"{m}: {why}" for m, why in hard.items()), file=sys.stderr)
        return EXIT_MISSING
    return 0


SOFT_IMPORTS = ("sacrebleu",)  # only the BLEU/chrF metrics need it; the run leaves their samples out without it
CHECK_IMPORTS = ("torch", "numpy", "pyarrow", "pandas", "transformers", "compressed_tensors", "llmcompressor", "datasets",
                 "evaluate", "sacrebleu", "pydantic", "yaml", "httpx", "psutil", "rich")


def missing_imports(python: str = sys.executable) -> dict[str, str]:
    """{module: error} for CHECK_IMPORTS that fail to import in a fresh `python` (so this process's state is not
    what is tested)."""
    code = ("import importlib, json, sys\nbad = {}\nfor m in sys.argv[1:]:\n    try:\n        importlib.import_module(m)\n"
            "    except Exception as e:\n        bad[m] = f'{type(e).__name__}: {e}'[:200]\nprint(json.dumps(bad))")
    r = subprocess.run([python, "-c", code, *CHECK_IMPORTS], capture_output=True, text=True)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"(the check itself)": r.stderr.strip()[-300:]}


def demo_config(layers: int | None = None) -> Any:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(SHAPE)
    if layers is not None:
        cfg.num_hidden_layers = layers
    return cfg


def synthetic_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the words t0 .. t{vocab-1} with a plain chat template: without the demo's
    tokenizer, calibration text and prompts become token ids through it (random text of such words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", pad_token="t2", unk_token="t0")
    fast.chat_template = ("{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}"
                          "{% if add_generation_prompt %}t5 {% endif %}")
    fast.save_pretrained(out)


def build_model(out: Path, layers: int | None = None, device: str = "cpu", dtype: str = "bfloat16",
                tokenizer: Path | None = None, seed: int = 0) -> dict[str, Any]:
    """Random weights in the demo's shape (all 30 layers unless `layers`), saved as a safetensors checkpoint with
    the demo's tokenizer files when given, else a synthetic tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    cfg = demo_config(layers)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    if tokenizer is not None and (tokenizer / "tokenizer.json").is_file():
        for f in TOKENIZER_FILES:
            if (tokenizer / f).is_file():
                shutil.copy(tokenizer / f, out / f)
    else:
        synthetic_tokenizer(out, cfg.vocab_size)
    return {"params": sum(p.numel() for p in model.parameters()), "layers": cfg.num_hidden_layers,
            "seconds": round(time.perf_counter() - t0, 2), "device": device, "dtype": dtype,
            "tokenizer": "demo" if tokenizer is not None and (tokenizer / "tokenizer.json").is_file() else "synthetic"}


def mib(n: float | None) -> str:
    return "" if n is None else f"{n / 2**20:,.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The figures as a Markdown table, one row per step, in COLUMNS' order; empty cells for what a step lacks."""
    cells = [[str(r.get(k, "") if r.get(k) is not None else "") for k, _ in COLUMNS] for r in rows]
    head = [h for _, h in COLUMNS]
    width = [max(len(x) for x in col) for col in zip(head, *cells)]
    line = lambda xs: "| " + " | ".join(x.ljust(w) for x, w in zip(xs, width)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in width) + "|", *map(line, cells)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wheels")
    w.add_argument("--lock", type=Path, default=LOCK)
    p = sub.add_parser("prepare")
    p.add_argument("dir", type=Path)
    p.add_argument("--lock", type=Path, default=LOCK)
    p.add_argument("--tokenizer", type=Path, default=None, help="default: the demo model's folder, when it exists")
    i = sub.add_parser("install")
    i.add_argument("dir", type=Path)
    b = sub.add_parser("build-model")
    b.add_argument("out", type=Path)
    b.add_argument("--layers", type=int, default=None)
    b.add_argument("--device", default="cpu")
    b.add_argument("--tokenizer", type=Path, default=None)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--wheels", type=Path, default=None, help="the prepared folder (its tokenizer/ is used)")
    r.add_argument("--serve-python", type=Path, default=None, help="an interpreter with vLLM; none: no serving")
    r.add_argument("--eval-samples", type=int, default=50)
    r.add_argument("--layers", type=int, default=None)
    r.add_argument("--cpu", action="store_true", help="rehearse every step on the CPU (testing this script without a GPU)")
    r.add_argument("--calib-samples", type=int, default=None, help="GPTQ calibration samples (default: the scheme's)")
    r.add_argument("--calib-len", type=int, default=None, help="tokens per calibration sample (default: the scheme's)")
    a = ap.parse_args(argv)
    if a.cmd == "wheels":
        return prepare(Path("DIR"), a.lock, None, dry_run=True)
    if a.cmd == "prepare":
        return prepare(a.dir, a.lock, a.tokenizer or _demo_tokenizer(), dry_run=False)
    if a.cmd == "install":
        return install(a.dir)
    if a.cmd == "build-model":
        print(json.dumps(build_model(a.out, a.layers, a.device, "float32" if a.device == "cpu" else "bfloat16", a.tokenizer)))
        return 0
    from gpu_check_run import run  # the GPU run: imports quantgate, which `install` may have had to complete first

    return run(a.out, a.wheels, a.serve_python, a.eval_samples, a.layers, a.cpu, (a.calib_samples, a.calib_len))


def _demo_tokenizer() -> Path | None:
    home = Path(os.environ.get("QUANTGATE_HOME", Path.home() / ".cache" / "quantgate"))
    folder = home / "models" / "smollm2-135m-instruct"
    return folder if (folder / "tokenizer.json").is_file() else None


if __name__ == "__main__":
    sys.exit(main())
