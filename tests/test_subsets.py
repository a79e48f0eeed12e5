"""Every subset the gate judges is a seeded random draw within each slice (quantgate.base.subsets)."""

from __future__ import annotations

from quantgate.base import subsets

ITEMS = [{"id": f"{c}-{i:03d}", "category": c} for c in ("numbers", "qa", "multilingual") for i in range(50)]


def _draw(items, limit, seed=subsets.SEED):
    return subsets.draw(items, limit, lambda it: it["id"], lambda it: it["category"], seed)


def test_a_subset_of_an_ordered_set_reaches_its_later_ids():
    """The first ids of an ordered set are not what a subset proves closeness on: 20 of 50 per category come from
    all over each category (the later half included), not from its first 20."""
    picked = _draw(ITEMS, 60)
    for cat in ("numbers", "qa", "multilingual"):
        ranks = sorted(int(it["id"].rsplit("-", 1)[1]) for it in picked if it["category"] == cat)
        assert len(ranks) == 20
        assert ranks != list(range(20)) and sum(r >= 25 for r in ranks) >= 5


def test_looks_are_nested_and_every_category_gets_its_share():
    looks = [_draw(ITEMS, n) for n in (30, 75, 120, 150)]
    for small, large in zip(looks, looks[1:]):
        assert {it["id"] for it in small} <= {it["id"] for it in large}
    for look in looks:
        counts = [sum(it["category"] == c for it in look) for c in ("numbers", "qa", "multilingual")]
        assert max(counts) - min(counts) <= 1


def test_the_draw_depends_on_the_seed_and_ids_only():
    picked = {it["id"] for it in _draw(ITEMS, 30)}
    assert picked == {it["id"] for it in _draw(list(reversed(ITEMS)), 30)}
    assert picked == {it["id"] for it in _draw(ITEMS + [{"id": "zz-1", "category": "zz"}], 31)} - {"zz-1"}
    assert picked != {it["id"] for it in _draw(ITEMS, 30, seed=1)}


def test_a_category_that_runs_out_leaves_its_turns_to_the_others():
    items = ITEMS[:50] + [{"id": "rare-1", "category": "rare"}]
    picked = _draw(items, 10)
    assert sum(it["category"] == "rare" for it in picked) == 1 and len(picked) == 10
    assert _draw(items, None) == items and _draw(items, 1000) == items


def test_a_fidelity_subset_of_an_eval_subset_stays_nested_as_both_widen():
    """An adaptive round widens eval.limit and fidelity.limit together: the fidelity prompts (ids prefixed by their
    eval set) are drawn from the eval subset, and look 2's hold look 1's."""
    from types import SimpleNamespace

    from quantgate.evals.dataset import stratified_subset
    from quantgate.fidelity.run import stratified

    rows = [SimpleNamespace(id=it["id"], category=it["category"]) for it in ITEMS]

    def fidelity_ids(eval_limit: int, fidelity_limit: int) -> set[str]:
        records = [{"id": f"default/{r.id}", "category": r.category} for r in stratified_subset(rows, eval_limit)]
        return {it["id"] for it in stratified(records, fidelity_limit)}

    looks = [fidelity_ids(60, 30), fidelity_ids(120, 60), fidelity_ids(150, 120)]
    assert looks[0] <= looks[1] <= looks[2] and [len(x) for x in looks] == [30, 60, 120]
