"""quantgate.quantize.sensitivity on the real demo model and a real llmcompressor checkpoint in which only decoder
layer 0 is quantized (INT8 W8A8, tests/conftest.py's `layer0_int8`): the one-layer-at-a-time truth and the one-pass
proxy must both name layer 0, and restoring it must give back nearly all of the candidate's KL. Slow; CI runs it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from quantgate.base.paths import EVAL_SETS
from quantgate.quantize.repair import POOLED, layer_gains, order_by, slice_kl
from quantgate.quantize.sensitivity import Pair, Scored


def _sequences(demo_model, n: int = 4) -> list[Scored]:
    """Eval prompts with their reference answers, as one text each, scored from the answer on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model))
    rows = [json.loads(line) for line in (EVAL_SETS / "default.jsonl").read_text().splitlines()]
    picked = [r for k, r in enumerate(rows) if k % (len(rows) // n) == 0][:n]
    out = []
    for r in picked:
        prompt = tok(r["prompt"] + "\n")["input_ids"]
        answer = tok(" ".join(r["references"]) + ". That is the answer, and here is why it is right.")["input_ids"]
        out.append(Scored(id=r["id"], category=r["category"], ids=prompt + answer, score_from=len(prompt)))
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_only_quantized_layer_is_the_one_the_truth_and_the_proxy_name(demo_model, layer0_int8):
    seqs = _sequences(demo_model)
    with Pair(demo_model, layer0_int8, threads=1) as pair:  # the first layers and the last one (the rest: the bench)
        m = pair.measure(seqs, restore=[0, 1, 2, 15, 29], proxy=True, keep={"first-two": [0, 1]}, batch=4)
    assert m.layers == 30 and m.tokens.sum() > 60
    kl = slice_kl(m.kl["all"], m.tokens, m.categories)[POOLED]
    gains = layer_gains(m.kl, m.tokens, m.categories, m.layers)[POOLED]
    others = gains[[1, 2, 15, 29]]
    print(f"\nKL as quantized {kl:.5f}; restoring layer 0 removes {gains[0]:.5f}; the others at most "
          f"{others.max():.2e}; proxy abs {m.proxy['abs'][:3]}, rel {m.proxy['rel'][:3]}")
    assert kl > 1e-4  # quantizing one layer's weights and activations to 8 bits changes the distributions
    assert gains[0] > 0.9 * kl and gains[0] > 20 * np.abs(others).max()  # layer 0 is where the KL comes from
    assert order_by(gains)[0] == 0 and order_by(m.proxy["abs"])[0] == 0 and order_by(m.proxy["rel"])[0] == 0
    # a set starting at layer 0 restores it too (run from its first layer on): the same KL as keeping layer 0 alone
    assert m.kl["first-two"].sum() == pytest.approx(m.kl["keep:0"].sum(), rel=0.2, abs=1e-6 * m.tokens.sum())
