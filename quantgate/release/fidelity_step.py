"""The release's fidelity step (adapter): every variant scores the baseline's own answers, teacher-forced, and the
baseline scores them twice for the noise floor.

Sequences: each eval set's samples that the baseline answered, as chat-template prompt + the baseline's greedy
answer (quantgate.fidelity.run.build_sequences), a stratified subset of `fidelity.limit`, plus the optional text
corpus. Every variant's server scores them with the same requests (prompt logprobs, top-k) at
`fidelity.concurrency`: the main path. The baseline's server scores them once more one request at a time, so that
batches are composed differently: KL between the baseline's two dumps is the noise floor the gate reads a
candidate's KL against. On CPU the baseline serves FP32 and W4A16 candidates BF16 activations: the floor holds the
engine's batch noise only, so a candidate's KL includes its activation dtype (stated in the summary's notes).

Files:
    <variant cache>/fidelity/<key>-main/  and (baseline) <key>-alt/   logprobs.jsonl + manifest.json
    <run>/fidelity/<candidate>.json, <run>/fidelity/floor.json      {"summary", "samples", "dumps"}
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from quantgate.base.runfiles import RESULTS
from quantgate.base.fileio import write_json
from quantgate.evals.client import read_results
from quantgate.evals.dataset import load_evalset
from quantgate.fidelity.core import SampleFidelity, summarize
from quantgate.fidelity.run import Sequence, build_sequences, compare_dumps, is_complete, score_sequences
from quantgate.release.spec import ReleaseSpec

Log = Callable[[str], None]
ALT_CONCURRENCY = 1


def dump_dirs(cache: Path, spec: ReleaseSpec, reference: Mapping[str, Path], baseline: bool) -> dict[str, Path]:
    """The variant's dump folders, keyed before anything is measured: by the baseline's eval folders (themselves
    keyed by the baseline's checkpoint, serving arguments, engine and eval set) and the fidelity settings."""
    assert spec.fidelity is not None
    blob = json.dumps({"evals": sorted(str(p) for p in reference.values()),
                       "fidelity": spec.fidelity.model_dump(mode="json")}, sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    out = {"main": cache / "fidelity" / f"{key}-main"}
    if baseline:
        out["alt"] = cache / "fidelity" / f"{key}-alt"
    return out


def done(dirs: Mapping[str, Path]) -> bool:
    """Every dump complete. The folders' key already names the sequences (the baseline's eval folders and the
    fidelity settings), so any complete dump in them is this one."""
    return all(is_complete(d, None) for d in dirs.values())


def baseline_records(spec: ReleaseSpec, reference: Mapping[str, Path]) -> list[dict[str, Any]]:
    """The baseline's answers with the chat messages that produced them, ids prefixed by their eval set."""
    out = []
    for path in spec.eval_sets:
        folder = reference.get(path.stem)
        if folder is None:
            continue
        es = load_evalset(path, with_dataset=False)
        answers = read_results(folder / RESULTS)
        for s in es.samples:
            r = answers.get(s.id)
            if r is not None and r.get("error") is None and r.get("output"):
                out.append({"id": f"{path.stem}/{s.id}", "category": s.category, "messages": s.chat(),
                            "output": r["output"]})
    return out


def sequences(spec: ReleaseSpec, reference: Mapping[str, Path], tokenizer: Path) -> list[Sequence]:
    f = spec.fidelity
    assert f is not None
    return build_sequences(baseline_records(spec, reference), tokenizer, limit=f.limit, corpus=f.corpus,
                           max_len=spec.context)


def measure(spec: ReleaseSpec, name: str, srv, dirs: Mapping[str, Path], seqs: list[Sequence], log: Log) -> None:
    """Score the sequences on a running server: the main path, and for the baseline the one-at-a-time path."""
    f = spec.fidelity
    assert f is not None
    tokens = sum(len(s.token_ids) for s in seqs)
    for path_name, folder in dirs.items():
        conc = f.concurrency if path_name == "main" else ALT_CONCURRENCY
        log(f"{name}: fidelity ({path_name} path): {len(seqs)} sequences, {tokens} tokens, top-{f.top_k}, "
            f"concurrency {conc}")
        every = max(1, len(seqs) // 5)

        def progress(n: int, total: int, _p: str = path_name) -> None:
            if n % every == 0 or n == total:
                log(f"{name}: fidelity ({_p}) {n}/{total}")

        score_sequences(srv.base_url, name, srv.api_key, seqs, folder, top_k=f.top_k, concurrency=conc,
                        progress=progress)


def _write(path: Path, samples: list[SampleFidelity], dumps: dict[str, str]) -> None:
    write_json(path, {"summary": summarize(samples).model_dump(mode="json"),
                      "samples": [s.model_dump(mode="json") for s in samples], "dumps": dumps})


def compare(run: Path, base_dirs: Mapping[str, Path], cand_name: str, cand_dirs: Mapping[str, Path]) -> None:
    """<run>/fidelity/<candidate>.json and floor.json (rewritten with every candidate: cheap), read by the gate."""
    out = run / "fidelity"
    _write(out / f"{cand_name}.json", compare_dumps(base_dirs["main"], cand_dirs["main"]),
           {"baseline": str(base_dirs["main"]), "candidate": str(cand_dirs["main"])})
    if "alt" in base_dirs:
        _write(out / "floor.json", compare_dumps(base_dirs["main"], base_dirs["alt"]),
               {"baseline": str(base_dirs["main"]), "alt": str(base_dirs["alt"])})


__all__ = ["compare", "done", "dump_dirs", "measure", "sequences"]
