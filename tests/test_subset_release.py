"""A release's fidelity subset of an ordered eval set: the prompts the release itself draws
(quantgate.release.fidelity_step.sampled_prompts, `fidelity.limit` below the set's size) reach the later ids of
every category, so damage carried by a category's later ids fails the gate's own fidelity checks, as it does on the
whole set; the first ids of each category (the draw before the seeded one) would have passed them. Per-sample
fidelity is made here by id (no server): what is tested is which ids the release asks, and what the gate reads."""

from __future__ import annotations

from pathlib import Path

from quantgate.base.paths import EVAL_SETS, RELEASES
from quantgate.evals.dataset import load_evalset
from quantgate.fidelity.core import SampleFidelity, summarize
from quantgate.fidelity.record import FidelityRecord
from quantgate.gate.early import early_fidelity_checks
from quantgate.gate.policy import load_policy
from quantgate.spec.adaptive import fidelity_looks, fidelity_size
from quantgate.release.fidelity_step import DRAW, sampled_prompts
from quantgate.spec.resolve import load_spec

POLICY = RELEASES / "policies" / "default.yaml"
LIMIT = load_policy(POLICY).fidelity.families["int8"].max_kl  # type: ignore[union-attr]
DAMAGED = "arithmetic_numbers"
SPEC = f"""\
version: 1
name: ordered
model: demo
hardware: a100
schemes: [int8-w8a8]
eval_sets: [{EVAL_SETS / 'default.jsonl'}]
recall: null
perf: null
fidelity: {{limit: 120, draws: 1, context_prompts: 0}}
"""


def _position() -> dict[str, tuple[str, float]]:
    """Eval id -> (its category, its place in the category in file order, from 0 to 1)."""
    samples = load_evalset(EVAL_SETS / "default.jsonl", with_dataset=False).samples
    by_cat: dict[str, list[str]] = {}
    for s in samples:
        by_cat.setdefault(s.category, []).append(s.id)
    return {f"default/{i}": (c, k / len(ids)) for c, ids in by_cat.items() for k, i in enumerate(ids)}


def _fidelity(ids: list[str], where: dict[str, tuple[str, float]]) -> list[SampleFidelity]:
    """The damaged category's later half at 3x the KL limit, everything else at 0.2x (a small spread, 40 tokens)."""
    out = []
    for k, i in enumerate(sorted(ids)):
        cat, at = where[i]
        kl = (3.0 if cat == DAMAGED and at >= 0.5 else 0.2) * LIMIT * (0.8 + 0.2 * (k % 3))
        out.append(SampleFidelity(id=i, category=cat, n_tokens=40, kl_sum=kl * 40, top1_agree=39, dnll_sum=kl * 40,
                                  kl_max=3 * kl, kl_topk_sum=kl * 40))
    return out


def _checks(run: Path, samples: list[SampleFidelity], looks: tuple[list[int], int]) -> dict[str, str]:
    """The gate's own fidelity checks on a run folder holding these samples (and a quiet noise floor): the outcome
    of each one that does not pass (a PROMOTE needs every one to pass)."""
    floor = [s.model_copy(update={"kl_sum": 0.0002 * s.n_tokens, "top1_agree": 40}) for s in samples]
    for name, rows in (("int8-w8a8", samples), ("floor", floor)):
        FidelityRecord(summary=summarize(rows), estimator="sampled-logratio", samples=rows,
                       dumps={}).write(run / "fidelity" / f"{name}.json")
    checks = early_fidelity_checks(run, POLICY, "int8-w8a8", "int8-w8a8", looks)
    assert checks and "fidelity:kl" in {c.name for c in checks}
    return {c.name: c.outcome for c in checks if c.outcome != "pass"}


def test_damage_on_the_later_ids_fails_the_fidelity_subset_a_release_draws(tmp_path, demo_model):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    spec = load_spec(path)
    looks = fidelity_looks(spec)
    assert looks == [120] and fidelity_size(spec) == 120  # fidelity.limit below the set's 300 prompts: one look
    where = _position()
    drawn = sorted({p.id.split(DRAW)[0] for p in sampled_prompts(spec, demo_model)[0]})
    assert len(drawn) == 120 and any(where[i] == (DAMAGED, where[i][1]) and where[i][1] >= 0.5 for i in drawn)
    # the whole set fails the damaged category; the release's subset does not pass it either (not PROMOTEd)
    assert _checks(tmp_path / "all", _fidelity(list(where), where), ([300], 300)) == {f"fidelity:kl:{DAMAGED}": "fail"}
    assert list(_checks(tmp_path / "drawn", _fidelity(drawn, where), (looks, 120))) == [f"fidelity:kl:{DAMAGED}"]
    # the first 20 ids of each category (the draw before the seeded one) would have passed every fidelity check
    first = sorted(i for i in where if where[i][1] < 20 / 50)
    assert len(first) == 120 and _checks(tmp_path / "first", _fidelity(first, where), (looks, 120)) == {}


def test_two_sets_of_one_file_name_give_the_fidelity_step_distinct_prompt_ids(tmp_path):
    """`a/small.jsonl` and `b/small.jsonl` with the same sample ids: each set's prompts carry the set's name in the
    release (emea.small / apac.small), so fidelity does not stop on a duplicate id minutes into the release."""
    from quantgate.release.fidelity_step import prompt_records

    rows = (EVAL_SETS / "default.jsonl").read_text(encoding="utf-8").splitlines()[:12]
    for region in ("emea", "apac"):
        (tmp_path / region).mkdir()
        (tmp_path / region / "small.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
        (tmp_path / region / "small.meta.yaml").write_bytes((EVAL_SETS / "default.meta.yaml").read_bytes())
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC.replace(f"[{EVAL_SETS / 'default.jsonl'}]", "[emea/small.jsonl, apac/small.jsonl]"))
    ids = [r["id"] for r in prompt_records(load_spec(path))]
    assert len(ids) == 24 == len(set(ids))
    assert {i.split("/")[0] for i in ids} == {"emea.small", "apac.small"}
