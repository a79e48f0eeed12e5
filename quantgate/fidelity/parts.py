"""One dump scored in parts, so that several servers of the same variant can share it (adapter).

    for i in range(count):                      # each on whichever server is free
        score_sequences(server_i.endpoint, part(seqs, i, count), part_dir(out, i, count), top_k=k)
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

Scoring ahead of the samples (`stream_dir`): while the baseline is still sampling, the candidate's own server scores
each continuation as soon as its line is written, into `<out>/parts/stream/` (lines only, no manifest), instead of
waiting idle for the whole set. A part then starts from the lines the stream holds for its sequences (`seed`): they
are copied into the part's folder, and only the rest is scored. The stream is a head start, never the record: a
part checks every copied line against its own sequences (ids, tokens, top-k), so a stream that stopped anywhere,
or holds lines of other samples, changes nothing but the time.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from quantgate.base.fileio import write_text
from quantgate.base.runfiles import MANIFEST
from quantgate.base.http import JsonlAppender
from quantgate.fidelity.run import (DUMP, SCHEMA, DumpManifest, Sequence, finished_records, is_complete, read_lines,
                                    sequences_hash)

PARTS = "parts"
STREAM = "stream"
_MERGING = threading.Lock()  # parts of one dump finish in threads of one process: one merges, the others see it done


def part(sequences: list[Sequence], index: int, count: int) -> list[Sequence]:
    """The index-th (0-based) of `count` parts: every count-th sequence by id, starting at the index-th."""
    if not 0 <= index < count:
        raise ValueError(f"part {index} of {count}")
    return sorted(sequences, key=lambda s: s.id)[index::count]


def part_dir(out_dir: Path | str, index: int, count: int) -> Path:
    return Path(out_dir) / PARTS / f"{index + 1}-of-{count}"


def stream_dir(out_dir: Path | str) -> Path:
    """Where a dump's lines scored ahead of the samples go (removed with the parts when the dump is merged)."""
    return Path(out_dir) / PARTS / STREAM


def seed(out_dir: Path | str, sequences: list[Sequence], folder: Path, top_k: int) -> int:
    """Copy the stream's lines of `sequences` (same ids, tokens and top-k) that `folder`'s dump does not hold yet
    into it, before the folder is scored; returns how many. Nothing when the folder is complete or has no stream."""
    source = stream_dir(out_dir) / DUMP
    if not source.is_file() or is_complete(folder, sequences_hash(sequences), top_k):
        return 0
    wanted = {s.id: s for s in sequences}
    have = {rec.get("id") for rec in read_lines(folder / DUMP)}
    lines = []
    for rec in finished_lines(source):
        s = wanted.get(str(rec.get("id")))
        if (s is not None and s.id not in have and rec.get("ids") == s.token_ids
                and rec.get("score_from") == s.score_from and all(len(t[0]) == top_k for t in rec.get("top", []))):
            lines.append(rec)
            have.add(s.id)  # a line the stream holds twice is copied once
    if lines:
        folder.mkdir(parents=True, exist_ok=True)
        with JsonlAppender(folder / DUMP) as writer:
            for rec in lines:
                writer.write(rec)
    return len(lines)


def finished_lines(path: Path) -> list[dict]:
    """The lines of a file another thread may still append to, read without touching it: up to its last newline,
    any line that does not parse passed over."""
    return finished_records(path.read_bytes())[0]


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
