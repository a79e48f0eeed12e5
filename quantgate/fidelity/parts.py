"""One dump scored in parts, so that several servers of the same variant can share it (adapter).

    for i in range(count):                      # each on whichever server is free
        score_sequences(url_i, name, key, part(seqs, i, count), part_dir(out, i, count), top_k=k)
        merge_parts(out, seqs, count, k)        # True once every part is in: out is then a complete dump

A candidate's fidelity scoring is the longest step of its measurement on a CPU (a prefill with prompt logprobs of
every sampled sequence), and one step runs on one server. Split into parts, the release's replica lending
(quantgate.release.replicas) can give a part to a slot that fell free, such as the baseline's once it is done.

Part `i` of `count` holds every count-th sequence by id from the i-th on: each part gets about the same mix of
long (haystack) and short sequences. Each part is an ordinary dump folder, `<out>/parts/<i+1>-of-<count>/`,
resumable as any other. When the last part is complete, its lines are written into `<out>/logprobs.jsonl` in one
piece and `<out>/manifest.json` says complete for the whole set (`parts`: how many); the part folders are then
removed. A merge interrupted half-way is redone from the parts on the next run; `out` never looks complete before
its manifest is written.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from quantgate.base.fileio import write_text
from quantgate.base.runfiles import MANIFEST
from quantgate.fidelity.run import DUMP, SCHEMA, DumpManifest, Sequence, is_complete, sequences_hash

PARTS = "parts"
_MERGING = threading.Lock()  # parts of one dump finish in threads of one process: one merges, the others see it done


def part(sequences: list[Sequence], index: int, count: int) -> list[Sequence]:
    """The index-th (0-based) of `count` parts: every count-th sequence by id, starting at the index-th."""
    if not 0 <= index < count:
        raise ValueError(f"part {index} of {count}")
    return sorted(sequences, key=lambda s: s.id)[index::count]


def part_dir(out_dir: Path | str, index: int, count: int) -> Path:
    return Path(out_dir) / PARTS / f"{index + 1}-of-{count}"


def merge_parts(out_dir: Path | str, sequences: list[Sequence], count: int, top_k: int) -> bool:
    """Write out_dir's complete dump of `sequences` from its `count` parts; False while a part is not complete.
    True at once when out_dir already holds it (another part's thread merged it)."""
    out = Path(out_dir)
    digest = sequences_hash(sequences)
    with _MERGING:
        if is_complete(out, digest, top_k):
            return True
        dirs = [part_dir(out, i, count) for i in range(count)]
        if not all(is_complete(d, sequences_hash(part(sequences, i, count)), top_k) for i, d in enumerate(dirs)):
            return False
        manifests = [m for d in dirs if (m := DumpManifest.read(d)) is not None]  # complete, so all readable
        (out / MANIFEST).unlink(missing_ok=True)
        write_text(out / DUMP, "".join((d / DUMP).read_text(encoding="utf-8") for d in dirs))  # atomic, durable
        DumpManifest(schema=SCHEMA, status="complete", n=len(sequences), n_scored=len(sequences), top_k=top_k,
                     model=manifests[0].model, endpoint=", ".join(sorted({m.endpoint or "" for m in manifests})),
                     sequences_hash=digest, elapsed_s=round(sum(m.elapsed_s or 0.0 for m in manifests), 3),
                     error=None, parts=count).write(out)
        shutil.rmtree(out / PARTS, ignore_errors=True)
        return True
