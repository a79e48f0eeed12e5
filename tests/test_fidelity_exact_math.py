"""The math of bench/fidelity_exact.py on tiny synthetic distributions (no checkpoint, seconds):

- its exact KL matches a direct numpy computation (0 for equal logits, the closed form for two tokens);
- tokens drawn from P_base and pushed through the project's ScoredSample -> compare_sample -> summarize give a mean
  that agrees with the exact KL of the same positions within Monte Carlo error, while tokens drawn from the other
  side (a swapped estimator) do not;
- its decoding and teacher forcing (left-padded batches, a shared, repeated KV cache) give the logits of a plain
  forward, and its seeded sampling is reproducible and batch-independent (a tiny random Llama).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parent.parent / "bench" / "fidelity_exact.py"


@pytest.fixture(scope="module")
def fx():
    spec = importlib.util.spec_from_file_location("bench_fidelity_exact", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def _np_kl(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    la = a - np.logaddexp.reduce(a, axis=-1, keepdims=True)
    lb = b - np.logaddexp.reduce(b, axis=-1, keepdims=True)
    return (np.exp(la) * (la - lb)).sum(axis=-1)


def test_exact_kl_matches_numpy_and_closed_forms(fx):
    rng = np.random.default_rng(1)
    a, b = rng.normal(0, 2, (7, 50)), rng.normal(0, 2, (7, 50))
    got = fx.exact_kl(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(got, _np_kl(a.astype(np.float32).astype(np.float64),
                                           b.astype(np.float32).astype(np.float64)), rtol=1e-9, atol=1e-12)
    assert np.all(got > 0)
    same = fx.exact_kl(torch.tensor(a), torch.tensor(a)).numpy()
    np.testing.assert_allclose(same, 0.0, atol=1e-12)
    # two tokens: p = (0.8, 0.2), q = (0.5, 0.5)
    p, q = torch.log(torch.tensor([[0.8, 0.2]])), torch.log(torch.tensor([[0.5, 0.5]]))
    assert fx.exact_kl(p, q).item() == pytest.approx(0.8 * math.log(1.6) + 0.2 * math.log(0.4), rel=1e-6)
    # positions(): the same KL, the actual token's logprobs and top-k as an endpoint reports them
    pos = fx.positions(torch.tensor(a), torch.tensor(b), [3] * 7, k=4)
    np.testing.assert_allclose(pos.kl, _np_kl(a, b), rtol=1e-9)
    la = a - np.logaddexp.reduce(a, axis=-1, keepdims=True)
    np.testing.assert_allclose(pos.base_lp, la[:, 3], rtol=1e-9)
    assert pos.base_top[0][0] == list(np.argsort(-a[0])[:4])


def _synthetic(fx, draw_from: str, n_samples=300, per_sample=20, vocab=40, seed=0) -> dict:
    """Random pairs of distributions per position (cand = base + noise), tokens drawn from `draw_from`'s side and
    scored through the project's records: the estimate, the exact KL of the same positions and the analytic SE of
    the estimate (per-position variances of log p - log q under P_base)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n_samples, per_sample, vocab, generator=g, dtype=torch.float64) * 2.0
    cand = base + torch.randn(n_samples, per_sample, vocab, generator=g, dtype=torch.float64) * 0.5
    fids, exact_sums, var_sum = [], [], 0.0
    for i in range(n_samples):
        src = base[i] if draw_from == "base" else cand[i]
        targets = [fx.sample_token(src[j], g) for j in range(per_sample)]
        pos = fx.positions(base[i], cand[i], targets, k=5)
        ids = [0] + targets  # one prompt token, scored from position 1
        fb, fc = fx.scored_pair(f"s{i:03d}", "synthetic", ids, 1, pos)
        fids.append(fx.compare_sample(fb, fc))
        exact_sums.append(sum(pos.kl))
        lp, lq = torch.log_softmax(base[i], -1), torch.log_softmax(cand[i], -1)
        d = lp - lq
        var_sum += float(((lp.exp() * d * d).sum(-1) - (lp.exp() * d).sum(-1) ** 2).sum())
    n = n_samples * per_sample
    summ = fx.summarize(fids, n_boot=500, level=0.90)
    est, _, _ = fx.gate_view(summ)
    return {"est": est, "log_ratio": summ.dnll, "exact": sum(exact_sums) / n, "se": math.sqrt(var_sum) / n,
            "fids": fids, "exact_sums": exact_sums}


@pytest.mark.parametrize("seed", [0, 3])
def test_sampled_estimates_agree_with_exact_kl(fx, seed):
    """The gate's estimate and the plain log-ratio mean, both unbiased for KL(P_base || P_cand): within 4 standard
    errors of the log-ratio (the gate's estimate, with the exact head over shared top-k, is no noisier)."""
    r = _synthetic(fx, "base", seed=seed)
    exact, se = r["exact"], r["se"]
    assert 0.05 < exact < 0.5  # a KL of the size the gate sees for weak candidates
    for name in ("est", "log_ratio"):
        iv = r[name]
        assert abs(iv.mean - exact) < 4 * se, (name, iv.mean, exact, se)
        assert iv.high > iv.mean > iv.low
    toks = [f.n_tokens for f in r["fids"]]
    assert sum(fx.estimate_sum(f) for f in r["fids"]) / sum(toks) == pytest.approx(r["est"].mean)
    # the bench's bias and its cluster-bootstrap SE: consistent with the analytic SE of the log-ratio
    bias, boot_se = fx.cluster_bias([f.dnll_sum for f in r["fids"]], r["exact_sums"], toks)
    assert bias == pytest.approx(r["log_ratio"].mean - exact, abs=1e-9)
    assert 0.6 * se < boot_se < 1.6 * se, (boot_se, se)
    bias, boot_se = fx.cluster_bias([fx.estimate_sum(f) for f in r["fids"]], r["exact_sums"], toks)
    assert bias == pytest.approx(r["est"].mean - exact, abs=1e-9)
    assert boot_se < 1.6 * se


def test_tokens_not_drawn_from_the_baseline_give_no_kl_estimate(fx):
    """The same means over tokens drawn from the candidate miss KL(P_base || P_cand) by far: the agreement above is
    not a tolerance so wide that anything passes (the log-ratio then estimates -KL(P_cand || P_base))."""
    r = _synthetic(fx, "cand")
    exact, se = r["exact"], r["se"]
    assert r["log_ratio"].mean < 0 < exact
    assert abs(r["log_ratio"].mean - exact) > 10 * se
    assert r["est"].mean < exact - 4 * se


def test_decoding_and_teacher_forcing_match_a_plain_forward(fx):
    """Left-padded batches, a repeated KV cache and right-padded rows give the logits of one unpadded forward per
    sequence; seeded sampling is reproducible and does not depend on the batch."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=2, eos_token_id=2, bos_token_id=1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    prompts = [[1, 5, 9, 13, 7], [1, 8, 3]]

    def gens(ids):
        return [[torch.Generator().manual_seed(fx.seed_for(s, i)) for s in (0, 1)] for i in ids]

    eos = {2, *range(40, 64)}  # a third of the vocabulary ends a row: rows finish early, at different steps
    rows, seen, plog = fx.continuations(model, prompts, gens(["a", "b"]), 12, eos, pad=2)
    alone, _, _ = fx.continuations(model, prompts[1:], gens(["b"]), 12, eos, pad=2)
    assert rows[1] == alone[0]
    assert all(1 <= len(r) <= 12 and (len(r) == 12 or r[-1] in eos) for rs in rows for r in rs)
    assert len({len(r) for rs in rows for r in rs}) > 2

    def full(prompt, row):
        with torch.inference_mode():
            return model(torch.tensor([prompt + row])).logits[0].float()

    for p, rs, ss, pl in zip(prompts, rows, seen, plog):
        assert torch.allclose(pl, full(p, [])[: len(p)], atol=1e-5)
        for r, got in zip(rs, ss):
            assert got.shape == (len(r), 64)
            assert torch.allclose(got, full(p, r)[len(p) - 1: len(p) + len(r) - 1], atol=1e-5)
    forced = [[rows[0][1], [7], [], rows[0][2] + [3, 4]], [[], rows[1][1] + [5], [9, 9, 9], [4]]]
    plog2, per_row = fx.teacher_forced(model, prompts, forced, pad=2, group=3)
    for p, rs, got_rows, pl in zip(prompts, forced, per_row, plog2):
        assert torch.allclose(pl, full(p, [])[: len(p)], atol=1e-5)
        for r, got in zip(rs, got_rows):
            assert got.shape == (len(r), 64)
            assert torch.allclose(got, full(p, r)[len(p) - 1: len(p) + len(r) - 1], atol=1e-5)
