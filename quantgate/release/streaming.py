"""A candidate's streaming looks (adapter): its fidelity REJECT decided while the baseline still samples.

The baseline samples the noise floor's prompts first and scores the floor beside the rest of its sampling, then
samples in stream order (quantgate.fidelity.stream.stream_order); the candidate scores each continuation as it
arrives (fidelity_step.score_ahead). After every batch it scores, `StreamJudge.decided()` reads what both sides have
written (the baseline's samples, whose lines carry its own logprobs, and the candidate's stream dump), and once the
first n prompts of the stream order are all in for a planned look n (quantgate.gate.stream), it judges that prefix
with the gate's own fidelity checks at the look's share of alpha (quantgate.gate.early.stream_checks). A failed
check decides the REJECT: the look's record becomes <run>/fidelity/<candidate>.json (its `stream` says which look,
how many prompts per slice, when), the floor's <run>/fidelity/floor.json, and the release's verdicts hear of it
(quantgate.release.early): the candidate skips the rest of its fidelity and the skippable steps, and when every
candidate is decided the baseline stops sampling (quantgate.fidelity.sampling: the lines stay for the next release).
A look that decides nothing leaves no file: the full sample is judged as before.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from pydantic import ValidationError

from quantgate.base.errors import QuantgateError
from quantgate.base.subsets import SEED as SUBSET_SEED
from quantgate.fidelity import sampling
from quantgate.fidelity.core import SampleFidelity, ScoredSample, compare_sample, merge_draws, summarize
from quantgate.fidelity.parts import stream_dir
from quantgate.fidelity.record import POOLED, FidelityRecord, SubsetDraw
from quantgate.fidelity.stream import DRAW, stream_ids
from quantgate.fidelity.run import DUMP, is_complete, load_dump
from quantgate.gate import stream
from quantgate.gate.early import stream_checks
from quantgate.gate.policy import load_policy
from quantgate.release import fidelity_step
from quantgate.release.early import EarlyDecision
from quantgate.spec.schema import policy_path

RULE = "stream: sha256(seed:id) within each category, categories merged in proportion to their sizes"


class StreamJudge:
    """One candidate's streaming looks; `decided()` after every scored batch (see the module docstring)."""

    def __init__(self, early: EarlyDecision, tokenizer: Path, out: Path, started: float) -> None:
        """`out`: the candidate's main dump folder (its stream beside it); `started`: the release's start."""
        self.spec, self.run, self.early, self.log, self.started = early.spec, early.run, early, early.log, started
        self.reference = early.reference
        self.samples = fidelity_step.samples_dir(self.spec, self.reference)
        prompts, _ = fidelity_step.sampled_prompts(self.spec, tokenizer)
        held = fidelity_step.held_out(self.run, early.variant.name)  # a repair's ranking prompts: not its evidence
        self.order = [h for h in stream_ids(prompts) if h not in held]
        self.draws: dict[str, list[str]] = {}
        self.category: dict[str, str] = {}
        for p in prompts:
            head = p.id.split(DRAW, 1)[0]
            self.draws.setdefault(head, []).append(p.id)
            self.category[head] = p.category
        self.policy = load_policy(policy_path(self.spec))  # read once: every look judges by it
        self.fidelity = self.policy.fidelity  # its alpha: each look spends a share
        minimum = self.fidelity.min_category_samples if self.fidelity else stream.MIN_PROMPTS
        self.scopes: dict[str, tuple[list[str], int]] = {POOLED: (self.order, stream.MIN_PROMPTS)}  # its order, minimum
        for c in sorted(set(self.category.values())) if self.fidelity and self.fidelity.per_category else []:
            self.scopes[c] = ([h for h in self.order if self.category[h] == c], minimum)  # the stream's, within it
        self.base_tail = sampling.LinesTail(self.samples / sampling.SAMPLES)
        self.cand_tail = sampling.LinesTail(stream_dir(out) / DUMP)
        self.base: dict[str, ScoredSample | None] = {}  # sequence id -> the baseline's side (None: empty)
        self.cand: dict[str, ScoredSample] = {}
        self.scored: dict[str, SampleFidelity] = {}
        self.judged: dict[str, int] = {}  # scope -> the last look judged
        self.floor: FidelityRecord | None = None

    def decided(self) -> bool:
        """Judge the latest planned look of every scope (pooled, each slice) whose prefix is in, unless judged
        already; True once the REJECT is."""
        if self.early.reason is not None:
            return True
        if self.fidelity is None:
            return False
        try:
            self._read()
            ready = self._ready()
            for scope, (order, minimum) in self.scopes.items():
                n = stream.reached(order, ready, len(order), minimum)
                if n is None or n <= self.judged.get(scope, 0) or self._floor() is None:
                    continue
                self.judged[scope] = n
                if self._judge(scope, order[:n], len(order), minimum):
                    return True
        except QuantgateError as exc:  # files the full sample's judgement will read and report on: no more looks
            self.log(f"{self.early.variant.name}: no more streaming looks ({exc.message}); the full sample decides")
            self.fidelity = None
        return False

    def _read(self) -> None:
        for rec in self.base_tail.new():
            try:
                line = sampling.dump_line(rec)  # the baseline's side: its own logprobs of what it sampled
                self.base[rec["id"]] = ScoredSample.model_validate(line) if line is not None else None
            except (KeyError, ValidationError):
                continue
        for rec in self.cand_tail.new():
            try:
                self.cand[rec["id"]] = ScoredSample.model_validate(rec)
            except (KeyError, ValidationError):
                continue

    def _ready(self) -> set[str]:
        """Prompt ids every draw of which is sampled and (unless empty) scored by the candidate."""
        out = set()
        for head, ids in self.draws.items():
            if all(i in self.base and (self.base[i] is None or i in self.cand) for i in ids):
                out.add(head)
        return out

    def _floor(self) -> FidelityRecord | None:
        """The noise floor, once the baseline's floor dump is complete: its scoring against the sampled side."""
        if self.floor is None:
            alt = fidelity_step.baseline_dumps(self.spec, self.reference)["alt"]
            if not is_complete(alt, None):
                return None
            scored = load_dump(alt)
            if not all(self.base.get(i) is not None for i in scored):
                return None
            samples = merge_draws([compare_sample(self.base[i], s) for i, s in sorted(scored.items())],  # type: ignore[arg-type]
                                  DRAW)
            self.floor = FidelityRecord(summary=summarize(samples), estimator=fidelity_step.ESTIMATOR,
                                        samples=samples, dumps={"baseline": str(self.samples), "alt": str(alt)})
        return self.floor

    def _judge(self, scope: str, heads: list[str], total: int, minimum: int) -> bool:
        """The gate's fidelity checks of `scope` on the prompts `heads` (a planned look's prefix); a failed one
        decides the REJECT: the look's record and the floor's are written where the gate reads them."""
        assert self.fidelity is not None and self.floor is not None
        per_seq = []
        for head in heads:
            for i in self.draws[head]:
                base = self.base[i]
                if base is not None:
                    if i not in self.scored:
                        self.scored[i] = compare_sample(base, self.cand[i])
                    per_seq.append(self.scored[i])
        samples = merge_draws(per_seq, DRAW)
        by_cat = Counter(self.category[head] for head in heads)
        look = stream.look(self.fidelity.alpha, total, len(heads), scope=scope, minimum=minimum, by_category=by_cat,
                           elapsed_s=round(time.time() - self.started, 1), scored_tokens=sum(s.n_tokens for s in samples))
        variant = self.early.variant
        record = FidelityRecord(summary=summarize(samples), estimator=fidelity_step.ESTIMATOR, samples=samples,
                                dumps={"baseline": str(self.samples), "candidate": str(self.cand_tail.path.parent)},
                                draw=SubsetDraw(rule=RULE, seed=SUBSET_SEED, order=self.order), stream=look)
        files = self.run / "fidelity" / f"{variant.name}.json", self.run / "fidelity" / "floor.json"
        checks = stream_checks(self.policy, variant.name, variant.scheme, record, self.floor,
                               (str(files[0]), str(files[1])))
        failed = [c for c in checks if c.outcome == "fail"]
        self.log(f"{variant.name}: streaming look {look.index}/{look.of} of {scope} at {look.n} of {total} prompts "
                 f"({look.elapsed_s:g} s in), alpha {look.alpha:.4g}: "
                 + (f"REJECT ({', '.join(c.name for c in failed[:4])})" if failed else "not decided"))
        if not failed:
            return False
        files[0].parent.mkdir(parents=True, exist_ok=True)
        record.write(files[0])
        self.floor.write(files[1])
        self.early.decide_at_look(failed, look)
        return True


__all__ = ["RULE", "StreamJudge"]
