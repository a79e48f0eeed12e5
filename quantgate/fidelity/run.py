"""Score token sequences through a served endpoint (teacher-forced prompt logprobs) and compare two dumps.

    seqs = build_sequences(baseline_answers, checkpoint_dir, corpus=EVAL_SETS / "fidelity_corpus.txt")
    score_sequences(baseline_server.endpoint, seqs, run / "fidelity" / "baseline")
    score_sequences(candidate_server.endpoint, seqs, run / "fidelity" / "candidate")
    samples = compare_dumps(run / "fidelity" / "baseline", run / "fidelity" / "candidate")

Every sequence goes to `/v1/completions` as a list of token ids with `max_tokens: 1` and `prompt_logprobs: k`;
vLLM answers with, for each prompt position after the first, the logprob of the actual token and the top-k.

Layout of a dump folder:
  logprobs.jsonl  one line per sequence: {"id", "category", "ids", "score_from", "lp", "top"} (see ScoredSample);
                  append-only, one os.write per line (quantgate.base.http.JsonlAppender): a re-run keeps the
                  complete lines and scores the rest
  manifest.json   {"schema", "status": "complete"|"partial", "n", "n_scored", "top_k", "model", "endpoint",
                  "sequences_hash", "elapsed_s", "error"} (+ "source" or "parts" from the other two writers);
                  written atomically at the end of every run, through DumpManifest
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quantgate.base.runfiles import MANIFEST
from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.http import Endpoint, JsonlAppender, Retry, for_each, post_json, repair_tail
from quantgate.base.subsets import draw
from quantgate.fidelity.core import SampleFidelity, ScoredSample, compare_sample

SCHEMA = 1
DUMP = "logprobs.jsonl"
CORPUS_CATEGORY = "corpus"
Progress = Callable[[int, int], None]


class Sequence(BaseModel):
    """Token ids to score; positions score_from .. len-1 get a logprob (position 0 never has one)."""
    model_config = ConfigDict(extra="forbid")

    id: str
    category: str
    token_ids: list[int] = Field(min_length=2)
    score_from: int = Field(1, ge=1)


class FolderManifest(BaseModel):
    """A folder's manifest.json (a dump's, a samples folder's), written last (atomically) by whoever fills the
    folder, and read leniently: a manifest that cannot be read means the folder is not complete."""
    model_config = ConfigDict(extra="allow")

    def write(self, folder: Path) -> None:
        """Every field its writer set (None included), in the file's order."""
        write_json(folder / MANIFEST, self.model_dump(mode="json", by_alias=True, exclude_unset=True))

    @classmethod
    def read(cls, folder: Path | str) -> Self | None:
        """The folder's manifest, or None when it is missing or unreadable."""
        try:
            return cls.model_validate_json((Path(folder) / MANIFEST).read_bytes())
        except (OSError, ValidationError):
            return None


class DumpManifest(FolderManifest):
    """A dump folder's manifest.json, written last (atomically) by whoever fills the folder: `score_sequences`,
    `sampling.write_dump` (the baseline's own, `source: sampling`) and `parts.merge_parts` (`parts`: how many). Read
    leniently (only `status` is required), so that a manifest of an older or newer writer still says what it can."""

    schema_: int | None = Field(None, alias="schema")
    status: str
    n: int | None = None
    n_scored: int | None = None
    top_k: int | None = None
    model: str | None = None
    endpoint: str | None = None
    sequences_hash: str | None = None
    elapsed_s: float | None = None
    error: str | None = None
    source: str | None = None  # "sampling": the baseline's dump, read from its sampling answers
    parts: int | None = None   # merged from this many parts



def stratified(items: list[dict], limit: int | None) -> list[dict]:
    """`limit` items drawn at random within each category, round-robin over the sorted categories (the seeded,
    nested draw of quantgate.base.subsets), in draw order; all, as given, when limit is None. An item ranks by its
    sample's own id, without the "<eval set>/" prefix: as `eval.limit` ranked it, so that the fidelity subset of an
    eval subset stays nested when an adaptive round widens both."""
    return draw(items, limit, lambda it: it["id"].split("/", 1)[-1], lambda it: it["category"])


def corpus_passages(path: Path) -> list[str]:
    """Passages of a text file: blocks separated by blank lines, inner whitespace kept."""
    text = Path(path).read_text(encoding="utf-8")
    return [p.strip() for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]


def items_of(records: Iterable[Mapping[str, Any]], corpus: Path | None, *, answers: bool = True) -> list[dict]:
    """Records and corpus passages as {id, category, messages | text} (+ "output" with `answers`, where records
    whose answer failed are skipped); a duplicate id is refused."""
    items: list[dict] = []
    for rec in records:
        if answers and rec.get("output") is None:
            continue
        if rec.get("messages") is not None:
            messages = list(rec["messages"])
        elif rec.get("prompt") is not None:
            messages = [{"role": "user", "content": rec["prompt"]}]
        else:
            raise ConfigError("a record needs 'messages' or 'prompt'", where=f"record {rec.get('id')!r}")
        items.append({"id": str(rec["id"]), "category": str(rec.get("category") or "uncategorized"),
                      "messages": messages, **({"output": rec["output"]} if answers else {})})
    if corpus is not None:
        items += [{"id": f"corpus-{i:03d}", "category": CORPUS_CATEGORY, "text": text}
                  for i, text in enumerate(corpus_passages(corpus))]
    seen: set[str] = set()
    for it in items:
        if it["id"] in seen:
            raise ConfigError(f"duplicate sample id {it['id']!r}", where="fidelity sequences")
        seen.add(it["id"])
    return items


def build_sequences(records: Iterable[Mapping[str, Any]], tokenizer_dir: Path | str, *, limit: int | None = None,
                    corpus: Path | str | None = None, max_len: int | None = None) -> list[Sequence]:
    """Token sequences to score: each answer as chat-template prompt + answer tokens, and each corpus passage.

    `records` are the baseline's answers: {"id", "category", "messages" (chat) or "prompt" (one user turn),
    "output"}; records whose output is None (failed answers) are skipped. The prompt is the checkpoint's chat
    template with the generation prompt, as the chat endpoint sends it; the output is tokenized on its own (no
    special tokens) and appended. Every position from 1 is scored, prompt and answer alike. A corpus passage is
    tokenized as plain text. `limit` keeps a stratified random subset (quantgate.base.subsets: seeded, nested, every
    category its share); `max_len` cuts longer sequences (keep it under the server's --max-model-len). Ids sorted in the result.
    """
    from transformers import AutoTokenizer

    items = stratified(items_of(records, Path(corpus) if corpus else None), limit)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out = []
    for it in sorted(items, key=lambda it: it["id"]):
        ids = prompt_ids(tok, it)
        if "text" not in it:
            ids += list(tok(it["output"], add_special_tokens=False)["input_ids"])
        ids = ids[:max_len] if max_len else ids
        if len(ids) >= 2:
            out.append(Sequence(id=it["id"], category=it["category"], token_ids=ids))
    return out


def prompt_ids(tok, item: Mapping[str, Any]) -> list[int]:
    """An item's prompt as token ids: a corpus passage ("text") as plain text, chat "messages" through the
    checkpoint's chat template with the generation prompt, as the chat endpoint sends them."""
    if "text" in item:
        return list(tok(item["text"])["input_ids"])
    prompt = tok.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=False)
    return list(tok(prompt, add_special_tokens=False)["input_ids"])


def sequences_hash(sequences: Iterable[Sequence]) -> str:
    """Content hash of a sequence set (order-independent): a dump is reused only for the same set."""
    h = hashlib.sha256()
    for s in sorted(sequences, key=lambda s: s.id):
        h.update(json.dumps([s.id, s.category, s.score_from, s.token_ids], separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def finished_records(data: bytes) -> tuple[list[dict], int]:
    """The JSON objects of `data`'s complete lines (up to its last newline; a line that does not parse is passed
    over), and how many bytes those lines take: for reading a file another thread or process still appends to."""
    end = data.rfind(b"\n") + 1
    out = []
    for raw in data[:end].splitlines():
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out, end


def read_lines(path: Path) -> list[dict]:
    """Complete JSON lines of a dump; a torn last line (killed mid-write) is cut off the file."""
    if not path.is_file():
        return []
    repair_tail(path)
    out = []
    for no, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError as exc:
            raise QuantgateError(f"invalid JSON: {exc.msg}", where=f"{path}:{no}",
                                 fix="delete the folder and score again") from None
    return out


def _kept(path: Path, sequences: list[Sequence], top_k: int) -> set[str]:
    """Ids already scored in `path` for these sequences; refuses a dump made from other sequences or another k."""
    wanted: dict[str | None, Sequence] = {s.id: s for s in sequences}
    done: set[str] = set()
    for rec in read_lines(path):
        seq = wanted.get(rec.get("id"))
        same = seq is not None and rec.get("ids") == seq.token_ids and rec.get("score_from") == seq.score_from
        if not same or any(len(t[0]) != top_k for t in rec.get("top", [])):
            raise QuantgateError(
                f"{path} holds sample {rec.get('id')!r} scored from other tokens or with another top-k than {top_k}",
                where=str(path), fix="score into a new folder, or delete this one")
        assert seq is not None  # `same` holds only with one
        done.add(seq.id)
    return done


def is_complete(out_dir: Path | str, sequences_hash: str | None, top_k: int | None = None) -> bool:
    """True when the folder holds a complete dump of exactly this sequence set (any set for None; this k, when
    given)."""
    m = DumpManifest.read(out_dir)
    return (m is not None and m.status == "complete" and sequences_hash in (None, m.sequences_hash)
            and (top_k is None or m.top_k == top_k) and (Path(out_dir) / DUMP).is_file())


def _parse(body: dict, seq: Sequence, top_k: int) -> dict:
    """One dump line from a /v1/completions answer (prompt_logprobs: [null, {"id": {"logprob", "rank", ...}}, ...])."""
    rows = body["choices"][0]["prompt_logprobs"]
    if len(rows) != len(seq.token_ids):
        raise ValueError(f"{len(rows)} prompt_logprobs rows for {len(seq.token_ids)} tokens")
    lp, top = [], []
    for pos in range(seq.score_from, len(seq.token_ids)):
        row = {int(t): v for t, v in rows[pos].items()}
        lp.append(float(row[seq.token_ids[pos]]["logprob"]))
        ranked = sorted(row.items(), key=lambda kv: (kv[1]["rank"], kv[0]))[:top_k]
        top.append([[t for t, _ in ranked], [float(v["logprob"]) for _, v in ranked]])
    return {"id": seq.id, "category": seq.category, "ids": seq.token_ids, "score_from": seq.score_from,
            "lp": lp, "top": top}


def _fatal(status: int, text: str, top_k: int, model: str) -> QuantgateError | None:
    """An HTTP answer that no retry or other sample can fix (bad k, key or model name), as an error."""
    if status == 400 and "logprobs" in text.lower():
        return ConfigError(f"the server refused prompt_logprobs={top_k}: {text[:300]}", where="fidelity scoring",
                           fix=f"start vLLM with `--max-logprobs {top_k}` (or more), or ask for a smaller top-k")
    if status in (401, 403):
        return QuantgateError(f"the server refused the API key (HTTP {status})", where="fidelity scoring")
    if status == 404:
        return QuantgateError(f"HTTP 404: {text[:300]}", where="fidelity scoring",
                              fix=f"check that the server serves the model name {model!r}")
    return None


async def _score_one(client, url: str, model: str, seq: Sequence, top_k: int,
                     retry: Retry) -> tuple[dict | None, str | None]:
    """(dump line, None) or (None, error) after retries on timeouts, transport errors, 5xx and 429; an answer
    that no retry can fix (_fatal) is raised."""
    payload = {"model": model, "prompt": seq.token_ids, "max_tokens": 1, "temperature": 0.0,
               "prompt_logprobs": top_k}
    ans = await post_json(client, url, payload, retry, parse=lambda body: _parse(body, seq, top_k),
                          fatal=lambda status, text: _fatal(status, text, top_k, model))
    return ans.value, ans.error


async def _score_all(url: str, model: str, api_key: str | None, todo: list[Sequence], path: Path, top_k: int,
                     concurrency: int, retry: Retry, tick: Callable[[], None]) -> list[tuple[str, str]]:
    """Score `todo` with at most `concurrency` requests in flight, appending each line as it comes;
    returns the (id, error) of the sequences that failed. A fatal answer stops every worker and is raised."""
    failed: list[tuple[str, str]] = []

    async def score(client, seq: Sequence) -> None:
        rec, error = await _score_one(client, url, model, seq, top_k, retry)
        if rec is not None:
            writer.write(rec)
        else:
            failed.append((seq.id, error or "unknown error"))
        tick()

    with JsonlAppender(path) as writer:
        await for_each(todo, score, concurrency=concurrency, api_key=api_key,
                       cost=("prefilled tokens", lambda s: len(s.token_ids)))  # a haystack costs 20 short sequences
    return failed


def append_scores(endpoint: Endpoint, sequences: list[Sequence], path: Path, *,
                  top_k: int, concurrency: int, retry: Retry | None = None,
                  tick: Callable[[], None] = lambda: None) -> list[tuple[str, str]]:
    """Score `sequences` and append their lines to the dump file `path` as they come (no manifest: the caller's
    folder says what the lines are); returns the (id, error) of those that failed after retries. A refused top-k,
    API key or model name is raised."""
    return asyncio.run(_score_all(endpoint.base + "/completions", endpoint.model, endpoint.api_key, sequences, path,
                                  top_k, max(1, concurrency), retry or Retry(), tick))


def score_sequences(endpoint: Endpoint, sequences: list[Sequence], out_dir: Path | str,
                    *, top_k: int = 10, concurrency: int = 4, timeout_s: float = 300.0, max_attempts: int = 4,
                    progress: Progress | None = None) -> Path:
    """Score every sequence not yet in out_dir/logprobs.jsonl; return that file's path.

    Resumable: complete lines are kept (a torn last line is dropped) and their ids skipped. manifest.json is
    written at the end of every run: "complete" when every sequence is in the dump, else "partial" and a
    QuantgateError names the failures (re-run to fill them in). A refused top-k (the server's --max-logprobs),
    API key or model name stops the run at once. `progress(done, total)` is called as sequences finish.
    """
    if top_k < 1:
        raise ConfigError(f"top_k must be at least 1, got {top_k}", where="fidelity scoring")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path, digest, t0 = out / DUMP, sequences_hash(sequences), time.monotonic()
    if is_complete(out, digest, top_k):
        return path
    (out / MANIFEST).unlink(missing_ok=True)  # a run in progress never looks complete
    done = _kept(path, sequences, top_k)
    todo = [s for s in sequences if s.id not in done]
    count = [len(done)]

    def tick() -> None:
        count[0] += 1
        if progress is not None:
            progress(count[0], len(sequences))

    failed = append_scores(endpoint, todo, path, top_k=top_k, concurrency=concurrency,
                           retry=Retry(timeout_s=timeout_s, max_attempts=max_attempts), tick=tick) if todo else []
    first = f"{failed[0][0]}: {failed[0][1]}" if failed else None
    DumpManifest(schema=SCHEMA, status="partial" if failed else "complete", n=len(sequences),
                 n_scored=len(sequences) - len(failed), top_k=top_k, model=endpoint.model, endpoint=endpoint.url,
                 sequences_hash=digest, elapsed_s=round(time.monotonic() - t0, 3), error=first).write(out)
    if failed:
        raise QuantgateError(f"{len(failed)} of {len(sequences)} sequences were not scored; first: {first}",
                             where=str(path), fix="check the server; re-run to score the rest (scored lines are kept)")
    return path


def load_dump(out_dir: Path | str) -> dict[str, ScoredSample]:
    """id -> ScoredSample of a complete dump folder."""
    out = Path(out_dir)
    manifest = DumpManifest.read(out)
    if manifest is None:
        raise QuantgateError("no readable manifest.json: the dump is missing or was interrupted", where=str(out),
                             fix="score the sequences into this folder (a re-run resumes)")
    if manifest.status != "complete":
        raise QuantgateError(f"dump status is {manifest.status!r}, not 'complete'", where=str(out / MANIFEST),
                             fix="re-run the scoring into this folder to finish it")
    samples: dict[str, ScoredSample] = {}
    for no, rec in enumerate(read_lines(out / DUMP), start=1):
        try:
            samples[rec["id"]] = ScoredSample.model_validate(rec)
        except (ValidationError, KeyError) as exc:
            raise QuantgateError(f"invalid dump line: {exc}", where=f"{out / DUMP}:{no}") from None
    return samples


def compare_dumps(base_dir: Path | str, cand_dir: Path | str, *, subset: bool = False) -> list[SampleFidelity]:
    """Per-sample fidelity of a candidate dump against a baseline dump; both must hold the same samples (with
    `subset`, the candidate's may be a subset of the baseline's: a floor scored on fewer sequences)."""
    base, cand = load_dump(base_dir), load_dump(cand_dir)
    if subset and cand.keys() <= base.keys():
        base = {i: base[i] for i in cand}
    if base.keys() != cand.keys():
        only_b, only_c = sorted(base.keys() - cand.keys()), sorted(cand.keys() - base.keys())
        raise QuantgateError(
            f"the dumps hold different samples: {len(only_b)} only in the baseline ({only_b[:3]}),"
            f" {len(only_c)} only in the candidate ({only_c[:3]})", where=f"{base_dir} vs {cand_dir}",
            fix="score both variants from the same sequences")
    return [compare_sample(base[i], cand[i]) for i in sorted(base)]


def floor(base_main_dir: Path | str, base_alt_dir: Path | str) -> list[SampleFidelity]:
    """The noise floor: the baseline against itself, scored along two execution paths.

    Score the baseline twice (e.g. concurrency 8 and concurrency 1, so that requests share batches differently,
    or on two server starts) and compare the dumps. What differs is engine numerics, not the model: a candidate's
    fidelity is read against this floor. Same as compare_dumps, named for what it means.
    """
    return compare_dumps(base_main_dir, base_alt_dir)
