"""The release's fidelity step (adapter): the baseline samples a continuation of every fidelity prompt, every
candidate scores those continuations teacher-forced, and the baseline scores a subset of them for the noise floor.

Prompts: each eval set's samples as chat-template prompts, a stratified subset of `fidelity.limit` (every category
gets its share), the optional text corpus (each passage a prompt), and `fidelity.context_prompts` haystack prompts
per length of the recall grid (category `context:<length>`: a haystack document of that length, which the baseline
continues: the gate judges fidelity at every context length, not only on short answers). The baseline's server
samples one continuation per prompt at temperature 1 (quantgate.fidelity.sampling): on those tokens the mean
log-ratio of the actual token is an unbiased KL estimate (quantgate.fidelity.core).

Two paths, and what each costs. The baseline's side (the "main" dump) is the sampling answers' own logprobs of
the sampled positions (the actual token and the top-k): no second pass. Every candidate's server scores prompt +
continuation teacher-forced (prompt logprobs of the continuation, top-k) at `fidelity.concurrency`: one prefill
per sequence. The baseline's server also scores a stratified subset (`fidelity.floor_samples`, at most
FLOOR_CONTEXT sequences per context length: a haystack's prefill is the expensive part) the candidates' way, the
"alt" dump: KL between the baseline's decoded and its prefilled logprobs on that subset is the noise floor the
gate reads a candidate's KL against, the engine numerics every candidate's comparison carries. On CPU the baseline
serves FP32 and W4A16 candidates BF16 activations: the floor holds the engine's path noise only, so a candidate's
KL includes its activation dtype (stated in the summary's notes).

Files:
    <baseline cache>/fidelity/<key>-samples/                           samples.jsonl + manifest.json
    <variant cache>/fidelity/<key>-main/  and (baseline) <key>-alt/   logprobs.jsonl + manifest.json
    <candidate cache>/fidelity/<key>-main/parts/<i>-of-<n>/          while it is scored in parts (measure_part)
    <candidate cache>/fidelity/<key>-main/parts/stream/              lines scored ahead of the samples (score_ahead)
    <run>/fidelity/<candidate>.json, <run>/fidelity/floor.json      {"summary", "samples", "dumps", "estimator"}
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypedDict

from quantgate.base.errors import QuantgateError, SettingError
from quantgate.base import progress
from quantgate.base.fileio import lock
from quantgate.base.runfiles import MANIFEST, REPAIR
from quantgate.base.subsets import DRAW as SUBSET_DRAW, RULE as SUBSET_RULE, SEED as SUBSET_SEED, order
from quantgate.base.http import Retry
from quantgate.evals.dataset import load_evalset, stratified_subset
from quantgate.evals.setsource import set_names
from quantgate.fidelity import sampling
from quantgate.fidelity.core import CONTEXT_PREFIX, SampleFidelity, merge_draws, summarize
from quantgate.fidelity.stream import DRAW, floor_ids, stream_order
from quantgate.fidelity.parts import finished_lines, merge_parts, part, part_dir, seed, stream_dir
from quantgate.fidelity.record import FidelityRecord, SubsetDraw, load_fidelity_record
from quantgate.fidelity.run import (DUMP, Sequence, append_scores, compare_dumps, is_complete,
                                    read_lines, score_sequences)
from quantgate.gate.repairfile import load_repair
from quantgate.recall.run import build_checked_grid, load_needle_data
from quantgate.spec.schema import ReleaseSpec

Log = Callable[[str], None]
# Decoding is the cost of sampling: a wide batch is many times faster on a CPU. 64 rather than 32: half the demo's
# prompts (318, 18 haystacks) on one core of the AMD EPYC (AVX-512) took 194.8 s against 207.3 s, each on a new server
SAMPLE_CONCURRENCY = 64
AHEAD_POLL_S = 2.0  # how often scoring ahead of the samples looks for new lines
AHEAD_BATCH = 32  # sequences scored ahead between two asks of `finished()` (a streaming look is judged there)
ESTIMATOR = "sampled-logratio"  # what <run>/fidelity/*.json's kl means (quantgate.fidelity.core)


def _key(spec: ReleaseSpec, reference: Mapping[str, Path]) -> str:
    """By the baseline's eval folders (themselves keyed by the baseline's checkpoint, serving arguments, engine and
    eval set) and the fidelity settings. The folders count by their names under the baseline's cache key, not by
    where the results root is: the same on every host of a release on work pools, and after a results folder moves."""
    assert spec.fidelity is not None
    blob = json.dumps({"evals": sorted(p.relative_to(p.parents[2]).as_posix() for p in reference.values()), "samples_schema": sampling.SCHEMA,
                       "draw": SUBSET_DRAW, "fidelity": spec.fidelity.model_dump(mode="json")}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def samples_dir(spec: ReleaseSpec, reference: Mapping[str, Path]) -> Path:
    """The baseline's sampled continuations, in the baseline's cache: the folder above its eval folders."""
    if not reference:
        raise SettingError("fidelity continues the eval sets' prompts, and the release has no eval set",
                           setting="fidelity", fix="list eval_sets, or set fidelity: null")
    base_cache = next(iter(reference.values())).parent.parent
    return base_cache / "fidelity" / f"{_key(spec, reference)}-samples"


def samples_beside(dumps: Mapping[str, Path]) -> Path:
    """The baseline's samples folder, from its dump folders (evidence.json's `fidelity`): the same key, beside them
    (what a release whose eval sets were skipped still has)."""
    main = Path(dumps["main"])
    return main.with_name(main.name.removesuffix("-main") + "-samples")


def dump_dirs(cache: Path, spec: ReleaseSpec, reference: Mapping[str, Path], baseline: bool) -> dict[str, Path]:
    """The variant's dump folders, keyed before anything is measured (see _key)."""
    key = _key(spec, reference)
    out = {"main": cache / "fidelity" / f"{key}-main"}
    if baseline:
        out["alt"] = cache / "fidelity" / f"{key}-alt"
    return out


def baseline_dumps(spec: ReleaseSpec, reference: Mapping[str, Path]) -> dict[str, Path]:
    """The baseline's dump folders (main and alt), in its cache beside its samples: what a candidate's fidelity is
    compared with."""
    return dump_dirs(samples_dir(spec, reference).parent.parent, spec, reference, baseline=True)


def done(dirs: Mapping[str, Path], samples: Path) -> bool:
    """Every dump complete, and the baseline's samples they scored (candidates beside it wait for those). The
    folders' key already names the sequences (the baseline's eval folders and the fidelity settings), so any
    complete dump in them is this one."""
    return sampling.is_complete(samples) and all(is_complete(d, None) for d in dirs.values())


class ChatRecord(TypedDict):
    """A prompt to sample a continuation of (quantgate.fidelity.sampling.build_prompts)."""
    id: str
    category: str
    messages: list[dict[str, str]]


def prompt_records(spec: ReleaseSpec) -> list[ChatRecord]:
    """The chat prompts of the eval samples the release asks (`eval.limit`: the same subset), ids prefixed by their
    eval set's name in the release (quantgate.evals.setsource.set_names: two sets of one file name stay apart)."""
    out: list[ChatRecord] = []
    for name, path in zip(set_names(spec.eval_sets), spec.eval_sets):
        es = load_evalset(path, with_dataset=False)
        out += [{"id": f"{name}/{s.id}", "category": s.category, "messages": s.chat()}
                for s in stratified_subset(es.samples, spec.eval.limit)]
    return out


def context_records(spec: ReleaseSpec, tokenizer: Path) -> list[ChatRecord]:
    """`fidelity.context_prompts` prompts per length of the recall grid, category `context:<length>`: a haystack
    document of that length (the recall grid's own, then more of the same kind) followed by
    `fidelity.context_instruction`, so that the baseline's continuation is long text written at that depth of
    context: the positions where long-context damage shows."""
    f, r = spec.fidelity, spec.recall
    assert f is not None
    if r is None or f.context_prompts == 0:
        return []
    per_kind = -(-f.context_prompts // len(r.kinds))  # haystacks of each kind, per length
    prompts, _ = build_checked_grid(tokenizer, r.lengths, r.depths, r.kinds, max(r.samples, per_kind), seed=r.seed,
                                    ask=r.ask, max_model_len=spec.context, max_answer_tokens=f.context_new_tokens,
                                    source="spec context")
    docs: dict[int, dict[str, str]] = {}  # length -> haystack -> document
    for p in prompts:
        docs.setdefault(p.length, {}).setdefault(p.haystack, document_of(p.messages))
    out: list[ChatRecord] = []
    for length, by_haystack in sorted(docs.items()):
        for hay, doc in sorted(by_haystack.items())[: f.context_prompts]:
            out.append({"id": f"context/{hay}", "category": f"{CONTEXT_PREFIX}{length}",
                        "messages": [{"role": "user", "content": f"{doc}\n\n{f.context_instruction}"}]})
    return out


def document_of(messages: list[dict]) -> str:
    """The haystack document of a recall request (the text between the user template's parts around {document})."""
    head, rest = load_needle_data().user.split("{document}", 1)
    tail = rest.split("{question}", 1)[0]
    text = messages[-1]["content"]
    if not text.startswith(head) or tail not in text[len(head):]:
        raise QuantgateError("a recall request does not follow the needle data's user template", where="fidelity "
                             "context prompts", fix="report this: the recall grid and its template disagree")
    return text[len(head): text.index(tail, len(head))]


def sampled_prompts(spec: ReleaseSpec, tokenizer: Path) -> tuple[list[sampling.Prompt], int]:
    """(every prompt the baseline continues, how many of them are haystacks): `fidelity.limit` eval prompts of the
    release's eval subset drawn at random within each category (quantgate.base.subsets), `fidelity.draws` times
    each, then `fidelity.context_prompts` haystacks per recall length."""
    f = spec.fidelity
    assert f is not None
    prompts = sampling.build_prompts(prompt_records(spec), tokenizer, limit=f.limit, corpus=f.corpus,
                                     max_len=spec.context - f.max_new_tokens)
    prompts = [p.model_copy(update={"id": f"{p.id}{DRAW}{k}"}) for p in prompts for k in range(f.draws)]
    context = sampling.build_prompts(context_records(spec, tokenizer), tokenizer,
                                     max_len=spec.context - f.context_new_tokens + 1)
    return prompts + [p.model_copy(update={"max_tokens": f.context_new_tokens}) for p in context], len(context)


def sample(spec: ReleaseSpec, reference: Mapping[str, Path], tokenizer: Path, srv, log: Log,
           stop: Callable[[], bool] | None = None) -> Path:
    """The baseline's continuations of the fidelity prompts, sampled on `srv` unless already complete. Under a lock:
    two of the baseline's servers asking at once sample once (the second finds them complete).

    The noise floor's prompts go first, and the floor is scored (the "alt" dump) on the same server as soon as they
    are sampled, while the rest are: a streaming look needs the floor. The eval prompts follow in stream order, then
    the haystacks: a haystack costs as much as ten eval prompts, so the eval slices' looks come first (a look reads
    a prefix of the stream order whatever the order they were sent in). `stop()` true (every candidate's REJECT
    decided) stops the sampling; what was sampled is kept for the next release."""
    f = spec.fidelity
    assert f is not None
    out = samples_dir(spec, reference)
    out.parent.mkdir(parents=True, exist_ok=True)
    with lock(out, timeout=None, what="sample the fidelity continuations"):
        if not sampling.is_complete(out) and not (stop is not None and stop()):  # stopped: resumed by the next release
            prompts, context = sampled_prompts(spec, tokenizer)
            log(f"baseline: fidelity continuations: {len(prompts) - context} eval prompts up to "
                f"{f.max_new_tokens} tokens, {context} haystack documents up to {f.context_new_tokens}, "
                "sampled at temperature 1, the noise floor's first, then in stream order")
            every = max(1, len(prompts) // 5)

            def progress(n: int, total: int) -> None:
                if n % every == 0 or n == total:
                    log(f"baseline: fidelity continuations {n}/{total} prompts")

            keep = floor_ids(prompts, f.floor_samples)
            ordered = [p for p in stream_order(prompts) if p.id not in keep]  # sent: the floor's as a batch first,
            short = [p for p in ordered if not p.category.startswith(CONTEXT_PREFIX)]  # then the eval prompts
            ordered = [p for p in prompts if p.id in keep] + short + [p for p in ordered
                                                                       if p.category.startswith(CONTEXT_PREFIX)]
            floor = threading.Thread(target=_floor_ahead, args=(spec, reference, srv, out, keep, log), daemon=True,
                                     name="floor ahead")
            floor.start()
            try:
                sampling.sample_continuations(srv.endpoint, ordered, out,
                                              max_tokens=f.max_new_tokens, top_k=f.top_k,
                                              concurrency=max(f.concurrency, SAMPLE_CONCURRENCY),
                                              progress=progress, stop=stop, first=len(keep))
            finally:
                floor.join()
            if sampling.is_stopped(out):
                m = sampling.SamplesManifest.read(out)
                log(f"baseline: fidelity continuations stopped at {m.n_sampled if m else '?'}/{len(prompts)} prompts:"
                    " every candidate's REJECT is decided (the next release that needs them resumes)")
    return out


def _floor_ahead(spec: ReleaseSpec, reference: Mapping[str, Path], srv, samples: Path, keep: set[str],
                 log: Log) -> None:
    """Score the noise floor's sequences (the baseline's "alt" dump) once every one of them is sampled, beside the
    sampling on the same server. Best effort: a failure leaves the floor to the step after the sampling."""
    alt = baseline_dumps(spec, reference)["alt"]
    if is_complete(alt, None):
        return
    tail, lines = sampling.LinesTail(samples / sampling.SAMPLES), dict[str, dict]()
    try:
        while not keep <= lines.keys():
            lines |= {r["id"]: r for r in tail.new() if r.get("id") in keep}
            if sampling.is_final(samples) and not keep <= lines.keys():
                return  # stopped or failed before the floor's prompts were in: the step after it scores them
            time.sleep(AHEAD_POLL_S)
        seqs = sampling.sequences_of(list(lines.values()))
        log(f"baseline: fidelity (alt, the noise floor): {len(seqs)} sequences, all at once beside the sampling (their"
            " share of the server's batch)")
        assert spec.fidelity is not None
        score_sequences(srv.endpoint, seqs, alt, top_k=spec.fidelity.top_k,
                        concurrency=len(seqs))
    except QuantgateError as exc:
        log(f"baseline: the noise floor beside the sampling failed ({exc.message}); scored after it")


def measure(spec: ReleaseSpec, srv, dirs: Mapping[str, Path], samples: Path, log: Log, *,
            baseline: bool = False) -> None:
    """Fill the variant's dump folders from the baseline's complete samples folder: the baseline's "main" from its
    sampling answers (no request), every other path by scoring on the running server `srv` (the baseline's "alt":
    the floor's subset), under the name it serves."""
    name = srv.config.name
    f = spec.fidelity
    assert f is not None
    if sampling.is_stopped(samples):
        log(f"{name}: fidelity ({', '.join(dirs)}) not scored: the sampling was stopped, every candidate's REJECT "
            "decided at a streaming look")
        return
    seqs = sampling.load_sequences(samples)
    for path_name, folder in dirs.items():
        if baseline and path_name == "main":
            sampling.write_dump(samples, folder)
            log(f"{name}: fidelity (main): the sampling answers' own logprobs of {len(seqs)} sequences")
            continue
        if path_name == "alt":
            keep = floor_ids(read_lines(samples / sampling.SAMPLES), f.floor_samples)
            scored = [s for s in seqs if s.id in keep]
        else:
            scored = seqs
        _score(spec, srv, scored, folder, f"{name}: fidelity ({path_name})", log)


def measure_part(spec: ReleaseSpec, srv, out: Path, samples: Path, log: Log, which: tuple[int, int]) -> bool:
    """Score part `which` = (index, count) of a candidate's main dump on `srv` (quantgate.fidelity.parts), then
    merge the dump if every part is in; True when `out` is complete."""
    index, count = which
    assert spec.fidelity is not None
    seqs = sampling.load_sequences(samples)
    mine, folder, label = part(seqs, index, count), part_dir(out, index, count), \
        f"{srv.config.name}: fidelity (main, part {index + 1}/{count})"
    if ahead := seed(out, mine, folder, spec.fidelity.top_k):
        log(f"{label}: {ahead} of its {len(mine)} sequences were scored ahead of the samples")
    _score(spec, srv, mine, folder, label, log)
    return merge_parts(out, seqs, count, spec.fidelity.top_k)


def score_ahead(spec: ReleaseSpec, srv, out: Path, samples: Path, finished: Callable[[], bool], log: Log) -> int:
    """While the baseline samples, score each continuation whose line is written into `out`'s stream folder
    (quantgate.fidelity.parts), until `finished()`, asked after every batch, says the samples are final (it raises
    when the baseline's job failed) or the REJECT is decided (a streaming look: quantgate.release.streaming);
    returns how many were scored. The parts then score only what the stream did not."""
    f = spec.fidelity
    assert f is not None
    tail, path = sampling.SamplesTail(samples), stream_dir(out) / DUMP
    path.parent.mkdir(parents=True, exist_ok=True)
    seen = {rec.get("id") for rec in finished_lines(path)} if path.is_file() else set()
    scored = tokens = 0
    said = time.monotonic()
    pending: list[Sequence] = []
    while not finished():
        pending += [s for s in tail.sequences() if s.id not in seen]  # each line comes once from the tail
        new, pending = pending[:AHEAD_BATCH], pending[AHEAD_BATCH:]  # a few at a time: `finished()` between them
        if not new:
            time.sleep(AHEAD_POLL_S)
            continue
        with progress.reporting(f"{srv.config.name}: fidelity ahead of the samples"):  # a bar, no line per batch
            failed = append_scores(srv.endpoint, new, path, top_k=f.top_k,
                                   concurrency=f.concurrency, retry=Retry(timeout_s=300.0, max_attempts=4))
        seen |= {s.id for s in new}  # a failed one is the parts' to score
        lost = {sid for sid, _ in failed}
        scored += len(new) - len(lost)
        tokens += sum(len(s.token_ids) - s.score_from for s in new if s.id not in lost)
        if time.monotonic() - said >= 30:
            log(f"{srv.config.name}: fidelity ahead of the samples: {scored} sequences scored so far")
            said = time.monotonic()
    if scored:
        log(f"{srv.config.name}: fidelity ahead of the samples: {scored} sequences ({tokens} scored tokens) scored "
            "while the baseline sampled")
    return scored


def _score(spec: ReleaseSpec, srv, scored: list[Sequence], folder: Path, label: str, log: Log) -> None:
    """Score `scored` into the dump folder on `srv` under the name it serves, saying how much and how far."""
    f = spec.fidelity
    assert f is not None
    tokens, every = sum(len(s.token_ids) - s.score_from for s in scored), max(1, len(scored) // 5)
    log(f"{label}: {len(scored)} sequences, {tokens} scored tokens, top-{f.top_k}, concurrency {f.concurrency}")

    def progress(n: int, total: int) -> None:
        if n % every == 0 or n == total:
            log(f"{label} {n}/{total} sequences")

    score_sequences(srv.endpoint, scored, folder, top_k=f.top_k,
                    concurrency=f.concurrency, progress=progress)


def _write(path: Path, dumps: dict[str, str], compare: Callable[[], list[SampleFidelity]]) -> None:
    """`path` from `compare()`, unless it holds the comparison of these very dumps already: written after each
    dump's manifest, which a dump writes last (the candidate's early decision wrote it; comparing the demo's 636
    sequences again took 3 s, on the release's critical path)."""
    if _current(path, dumps):
        return
    samples = merge_draws(compare(), DRAW)  # a prompt's draws are one sample (cluster) in the intervals
    drawn = SubsetDraw(rule=SUBSET_RULE, seed=SUBSET_SEED,
                       order=[s.id for s in order(samples, lambda s: s.id, lambda s: s.category)])
    FidelityRecord(summary=summarize(samples), estimator=ESTIMATOR, samples=samples, dumps=dumps,
                   draw=drawn).write(path)


def _current(path: Path, dumps: dict[str, str]) -> bool:
    try:
        written = path.stat().st_mtime_ns
        if max((Path(d) / MANIFEST).stat().st_mtime_ns for d in dumps.values()) > written:
            return False
        record = FidelityRecord.model_validate_json(path.read_bytes())
        return record.dumps == dumps and record.estimator == ESTIMATOR
    except (OSError, ValueError):  # missing, torn or of another schema (pydantic's error is a ValueError): again
        return False


def decided_at_look(path: Path) -> bool:
    """Whether `path` is a candidate's fidelity record written at the streaming look that decided its REJECT."""
    try:
        return load_fidelity_record(path).stream is not None
    except QuantgateError:
        return False


def compare(run: Path, base_dirs: Mapping[str, Path], cand_name: str, cand_dirs: Mapping[str, Path]) -> None:
    """<run>/fidelity/<candidate>.json and floor.json, read by the gate (each kept when it holds these dumps'
    comparison already)."""
    out, base, cand = run / "fidelity", base_dirs["main"], cand_dirs["main"]
    if decided_at_look(out / f"{cand_name}.json") and not (is_complete(base, None) and is_complete(cand, None)):
        return  # its REJECT was decided at a streaming look: that look's record is the evidence
    drop = held_out(run, cand_name)
    _write(out / f"{cand_name}.json", {"baseline": str(base), "candidate": str(cand)},
           lambda: [s for s in compare_dumps(base, cand) if s.id.split(DRAW, 1)[0] not in drop])
    if "alt" in base_dirs:
        alt = base_dirs["alt"]
        _write(out / "floor.json", {"baseline": str(base), "alt": str(alt)}, lambda: compare_dumps(base, alt, subset=True))


def held_out(run: Path, candidate: str) -> set[str]:
    """The prompt ids a repaired candidate's fidelity sample leaves out: those that chose the layers it keeps
    (<run>/<candidate>/repair.json, quantgate.release.repair_step); empty for any other candidate."""
    path = run / candidate / REPAIR
    return set(load_repair(path).ranking.prompts) if path.is_file() else set()


__all__ = ["baseline_dumps", "compare", "done", "dump_dirs", "held_out", "measure", "sample", "samples_beside",
           "samples_dir"]
