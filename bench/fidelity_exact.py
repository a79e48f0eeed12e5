"""The gate's sampled KL estimate against the exact full-vocabulary KL, on the same sequences (transformers, CPU).

    .venv/bin/python bench/fidelity_exact.py [--limit 120] [--max-new-tokens 64] [--seeds 3] [--work /tmp/qg-exact]
                                             [--candidates int8-w8a8,w4a16-gptq] [--threads 1] [--batch 8]

What it does:
1. The baseline is the demo checkpoint (`quantgate models demo`, BF16 safetensors) loaded in FP32, as the project
   serves baselines on CPU. Each candidate is made with the project's own quantization (quantgate.quantize.run:
   the scheme's recipe and calibration, 64 x 256 tokens) into --work/<scheme>, reused when already there; a
   candidate may also be given as a checkpoint folder. transformers loads compressed-tensors checkpoints as
   fake-quant (dequantized weights; W8A8 also quantizes activations per token at run time), in FP32.
2. Prompts: a stratified subset of eval_sets/default.jsonl (round-robin over sorted categories, ids sorted within
   each, the rule of quantgate.fidelity.run), through the checkpoint's chat template with the generation prompt.
3. Per prompt and seed, the FP32 baseline samples a continuation at temperature 1 (no top-k/top-p, no penalties;
   a torch generator seeded from (seed, sample id)) of up to --max-new-tokens tokens; a sampled EOS ends it and is
   scored. The greedy answer is decoded in the same batch (row 0) for the old estimate.
4. The baseline's side is the distributions it sampled from (its KV-cached decoding pass); the candidate is run
   teacher-forced over prompt + continuation (the prompt once, then every row from a copy of its KV cache; several
   prompts per batch, left-padded). At every continuation position the bench computes the exact
   KL(P_base || P_cand) over the whole vocabulary (float64), the actual token's logprob on both sides and each
   side's top-10. From these it builds the project's `ScoredSample` records (score_from = prompt length) and runs
   the project's `compare_sample` and `summarize` (level 0.90), so the estimate, the top-10 diagnostic and the
   bound come from the project's code.
5. Per candidate: exact mean KL (ratio of sums over the same positions), the estimate with its one-sided 95% upper
   bound and whether it holds the exact mean, bias = estimate - exact with its cluster-bootstrap standard error,
   the top-10 KL and its ratio to exact; and, for the record, the old way: top-10 KL over prompt + greedy answer
   positions against exact KL on those positions.

What it does not do: the release scores through vLLM; here both sides run in transformers (vLLM FP32 prompt
logprobs agree with transformers FP32 within ~6e-6 nats on this project). Real W4A16 serving uses BF16
activations on CPU; this bench runs the W4A16 weights with FP32 activations, so it measures the weights' KL only.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantgate.base.paths import EVAL_SETS  # noqa: E402
from quantgate.evals.dataset import load_evalset  # noqa: E402
from quantgate.fidelity.core import (FidelityStats, SampleFidelity, ScoredSample, compare_sample,  # noqa: E402
                                     summarize)

TOP_K = 10
LEVEL = 0.90  # two-sided level handed to summarize: `high` is a one-sided 95% upper bound
N_BOOT = 2000


# --- the math (imported by tests/test_fidelity_exact_math.py) -----------------------------------------------------

def exact_kl(base_logits, cand_logits):
    """Per-position KL(P_base || P_cand) in nats over the whole vocabulary, from logits [n, V] (float64 inside)."""
    import torch

    lb = torch.log_softmax(base_logits.to(torch.float64), dim=-1)
    lc = torch.log_softmax(cand_logits.to(torch.float64), dim=-1)
    return (lb.exp() * (lb - lc)).sum(dim=-1)


@dataclass
class Positions:
    """Per-position values for one scored stretch: exact KL, the actual tokens' logprobs and both top-k lists."""
    kl: list[float]
    base_lp: list[float]
    cand_lp: list[float]
    base_top: list[tuple[list[int], list[float]]]
    cand_top: list[tuple[list[int], list[float]]]


def positions(base_logits, cand_logits, targets, k: int = TOP_K) -> Positions:
    """Exact KL and what an endpoint reports (actual token's logprob, top-k) at each position; `targets` [n] are
    the actual tokens, row i of the logits predicts targets[i]."""
    import torch

    lb = torch.log_softmax(base_logits.to(torch.float64), dim=-1)
    lc = torch.log_softmax(cand_logits.to(torch.float64), dim=-1)
    kl = (lb.exp() * (lb - lc)).sum(dim=-1)
    idx = torch.as_tensor(targets, dtype=torch.long)[:, None]
    k = min(k, lb.shape[-1])
    bt, ct = lb.topk(k, dim=-1), lc.topk(k, dim=-1)

    def tops(t) -> list[tuple[list[int], list[float]]]:
        return [(i, v) for i, v in zip(t.indices.tolist(), t.values.tolist())]

    return Positions(kl=kl.tolist(), base_lp=lb.gather(-1, idx)[:, 0].tolist(),
                     cand_lp=lc.gather(-1, idx)[:, 0].tolist(), base_top=tops(bt), cand_top=tops(ct))


def scored_pair(sample_id: str, category: str, ids: list[int], score_from: int,
                pos: Positions) -> tuple[ScoredSample, ScoredSample]:
    """The project's records of one sequence as the baseline and the candidate endpoint would have scored it."""
    base = ScoredSample(id=sample_id, category=category, ids=ids, score_from=score_from, lp=pos.base_lp,
                        top=pos.base_top)
    cand = ScoredSample(id=sample_id, category=category, ids=ids, score_from=score_from, lp=pos.cand_lp,
                        top=pos.cand_top)
    return base, cand


def sample_token(logits, generator) -> int:
    """One token drawn from softmax(logits) at temperature 1, nothing truncated."""
    import torch

    probs = torch.softmax(logits.to(torch.float64), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def seed_for(seed: int, sample_id: str) -> int:
    """A sample's own generator seed: the same for the same (seed, id) whatever the batch."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()[:8], "big") & (2**63 - 1)


NEW_CORE = "kl_topk" in FidelityStats.model_fields  # the project's summary since the sampled estimator


def gate_view(stats: FidelityStats):
    """(the gate's KL estimate as a FidelityInterval, the pooled top-k KL, the field's name) in either version of the
    project's summary: newer ones put the sampled estimate in `kl` and the top-k diagnostic in `kl_topk`; older ones
    have the top-k KL in `kl`, and the plain log-ratio mean (`dnll`) is the estimate."""
    if NEW_CORE:
        return stats.kl, stats.kl_topk, "kl"
    return stats.dnll, stats.kl.mean, "dnll"


def estimate_sum(s: SampleFidelity) -> float:
    """A sample's sum of the gate's per-token KL estimates (see gate_view)."""
    return s.kl_sum if NEW_CORE else s.dnll_sum


def cluster_bias(est_sums, exact_sums, tokens, *, n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float]:
    """(pooled estimate - pooled exact, its cluster-bootstrap standard error): whole samples are resampled."""
    est, ex, n = (np.asarray(a, dtype=np.float64) for a in (est_sums, exact_sums, tokens))
    diff = est - ex
    bias = float(diff.sum() / n.sum())
    rng = np.random.default_rng(seed)
    draws = []
    for start in range(0, n_boot, 256):
        idx = rng.integers(0, len(n), size=(min(256, n_boot - start), len(n)))
        draws.append(diff[idx].sum(axis=1) / n[idx].sum(axis=1))
    return bias, float(np.std(np.concatenate(draws), ddof=1)) if len(n) > 1 else float("nan")


def stratified(items: list, limit: int | None) -> list:
    """`limit` items round-robin over sorted categories, ids sorted within each (quantgate.fidelity.run's rule)."""
    if limit is None or limit >= len(items):
        return list(items)
    by_cat: dict[str, list] = {}
    for it in sorted(items, key=lambda it: it.id):
        by_cat.setdefault(it.category, []).append(it)
    groups = [by_cat[c] for c in sorted(by_cat)]
    chosen: list = []
    depth = 0
    while len(chosen) < limit:
        chosen += [g[depth] for g in groups if depth < len(g)][: limit - len(chosen)]
        depth += 1
    return chosen


# --- models --------------------------------------------------------------------------------------------------------

def load_model(path: Path):
    """A checkpoint in FP32; a compressed-tensors one decompressed (fake-quant), as transformers runs it on CPU."""
    from quantgate.quantize.sensitivity import load

    return load(path)


def _prompt_forward(model, prompts: list[list[int]], pad: int):
    """Left-padded prompts in one batch: (logits at each prompt's own positions [P, V], the KV cache (one row per
    prompt), the attention mask of the padded prompts [n, L], each prompt's length)."""
    import torch

    width = max(len(p) for p in prompts)
    x = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        x[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(x, attention_mask=mask, position_ids=pos, use_cache=True)
    logits = out.logits.float()
    plog = [logits[i, width - len(p):] for i, p in enumerate(prompts)]
    return plog, out.past_key_values, mask, torch.tensor([len(p) for p in prompts])


def continuations(model, prompts: list[list[int]], gens: list[list], max_new: int, eos: set[int], pad: int):
    """Per prompt, row 0: the greedy answer; row 1 + s: a continuation sampled with gens[prompt][s] (each
    generator draws once per token of its own row: the draws do not depend on the batch). A row ends with the EOS
    it drew (kept) or after max_new tokens; finished rows leave the batch. All prompts decode in one left-padded
    batch from their shared prompt KV cache.

    Returns (rows[prompt][row] token ids, logits[prompt][row] [len, V] predicting each of them, prompt logits
    [P, V] per prompt): the model's distributions at the positions it sampled, reused as the baseline's side."""
    import torch

    per = 1 + len(gens[0])
    with torch.inference_mode():
        plog, cache, mask, plen = _prompt_forward(model, prompts, pad)
        owner = torch.arange(len(prompts)).repeat_interleave(per)
        cache.batch_select_indices(owner)
        mask, nxt = mask[owner], plen[owner]
        logits = torch.stack([pl[-1] for pl in plog])[owner]
        n = len(owner)
        rows: list[list[int]] = [[] for _ in range(n)]
        seen: list[list] = [[] for _ in range(n)]
        active = list(range(n))
        for step in range(max_new):
            still = []
            for k, b in enumerate(active):
                p, r = divmod(b, per)
                t = int(logits[k].argmax()) if r == 0 else sample_token(logits[k], gens[p][r - 1])
                rows[b].append(t)
                seen[b].append(logits[k].clone())
                if t not in eos and len(rows[b]) < max_new:
                    still.append(k)
            if not still:
                break
            if len(still) < len(active):
                keep = torch.tensor(still)
                cache.batch_select_indices(keep)
                mask, nxt = mask[keep], nxt[keep]
                active = [active[k] for k in still]
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=mask.dtype)], dim=1)
            feed = torch.tensor([rows[b][-1] for b in active])[:, None]
            out = model(feed, attention_mask=mask, position_ids=(nxt + step)[:, None], past_key_values=cache,
                        use_cache=True)
            logits = out.logits[:, -1].float()
    return ([rows[p * per:(p + 1) * per] for p in range(len(prompts))],
            [[torch.stack(seen[b]) for b in range(p * per, (p + 1) * per)] for p in range(len(prompts))], plog)


def teacher_forced(model, prompts: list[list[int]], rows: list[list[list[int]]], pad: int, group: int = 8):
    """(logits at each prompt's positions [P, V], per prompt and row the logits predicting each of the row's
    tokens [len, V]): the prompts once (left-padded), then the rows, sorted by length, `group` at a time, each from
    a copy of its prompt's KV cache (right-padded: causal attention keeps the pads out of the real positions)."""
    import copy

    import torch

    with torch.inference_mode():
        plog, cache, pmask, plen = _prompt_forward(model, prompts, pad)
        out = [[plog[p][-1:][: len(r)] for r in rs] for p, rs in enumerate(rows)]
        todo = sorted(((p, j) for p, rs in enumerate(rows) for j, r in enumerate(rs) if len(r) > 1),
                      key=lambda pj: -len(rows[pj[0]][pj[1]]))
        for start in range(0, len(todo), group):
            part = todo[start:start + group]
            owner = torch.tensor([p for p, _ in part])
            c = copy.deepcopy(cache)
            c.batch_select_indices(owner)
            width = len(rows[part[0][0]][part[0][1]]) - 1
            x = torch.full((len(part), width), pad, dtype=torch.long)
            for i, (p, j) in enumerate(part):
                r = rows[p][j]
                x[i, : len(r) - 1] = torch.tensor(r[:-1], dtype=torch.long)
            mask = torch.cat([pmask[owner], torch.ones_like(x)], dim=1)
            pos = plen[owner][:, None] + torch.arange(width)[None, :]
            logits = model(x, attention_mask=mask, position_ids=pos, past_key_values=c, use_cache=False).logits
            for i, (p, j) in enumerate(part):
                out[p][j] = torch.cat([plog[p][-1:], logits[i, : len(rows[p][j]) - 1].float()])
    return plog, out


def ensure_candidate(name: str, baseline: Path, work: Path, log) -> Path:
    """A checkpoint folder as given, or the scheme quantized with the project's own pipeline (reused)."""
    if Path(name).is_dir():
        return Path(name).resolve()
    from quantgate.quantize.calibration import CalibrationSpec
    from quantgate.quantize.run import QuantizeRequest, quantize

    t0 = time.time()
    res = quantize(QuantizeRequest(model=baseline, scheme=name, out=work / name, calibration=CalibrationSpec()),
                   log=log)
    log(f"{name}: {'reused' if res.reused else 'quantized'} {res.out} ({time.time() - t0:.0f} s)")
    return Path(res.out)


# --- the run ---------------------------------------------------------------------------------------------------------

@dataclass
class Acc:
    """Per candidate and sequence set: the project's per-sample results and the exact KL sums on the same positions;
    `*_noeos`: the same with each continuation's final EOS left out (a selection that depends on the token)."""
    fid: list[SampleFidelity] = field(default_factory=list)
    exact: list[float] = field(default_factory=list)
    fid_noeos: list[SampleFidelity] = field(default_factory=list)
    exact_noeos: list[float] = field(default_factory=list)

    def add(self, fid: SampleFidelity, exact: float) -> None:
        self.fid.append(fid)
        self.exact.append(exact)


@dataclass
class Row:
    """One line of the report: the project's summary of a sequence set against the exact KL of its positions."""
    summ: object
    exact: float
    est: object           # the gate's estimate (FidelityInterval)
    topk: float
    bias: float
    se: float
    lr_bias: float        # the plain log-ratio mean (dnll) - exact
    lr_se: float


def report_row(a_fid: list[SampleFidelity], a_exact: list[float]) -> Row:
    summ = summarize(a_fid, n_boot=N_BOOT, level=LEVEL)
    est, topk, _ = gate_view(summ)
    toks = [f.n_tokens for f in a_fid]
    exact = sum(a_exact) / sum(toks)
    bias, se = cluster_bias([estimate_sum(f) for f in a_fid], a_exact, toks)
    lr_bias, lr_se = cluster_bias([f.dnll_sum for f in a_fid], a_exact, toks)
    return Row(summ, exact, est, topk, bias, se, lr_bias, lr_se)


def cpu_model() -> str:
    """The CPU's model name, core count and vector extensions, from /proc/cpuinfo."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    cores = sum(ln.startswith("processor") for ln in lines)
    isa = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags) or "no AVX2"
    return f"{name}, {cores} logical CPUs ({isa})"


def _version(pkg: str) -> str:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "-"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b > 0 else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=120, help="prompts (stratified over categories)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3, help="sampling seeds 0 .. N-1")
    ap.add_argument("--work", type=Path, default=Path("/tmp/qg-exact"), help="candidate checkpoints are kept here")
    ap.add_argument("--candidates", default="int8-w8a8,w4a16-gptq",
                    help="schemes or checkpoint folders, comma-separated")
    ap.add_argument("--model", type=Path, default=None, help="baseline checkpoint (default: the demo model)")
    ap.add_argument("--evalset", type=Path, default=EVAL_SETS / "default.jsonl")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core machine)")
    ap.add_argument("--batch", type=int, default=8, help="prompts decoded and scored together")
    args = ap.parse_args()
    if args.seeds < 1 or args.limit < 2 or args.max_new_tokens < 1 or args.batch < 1:
        ap.error("--seeds >= 1, --limit >= 2, --max-new-tokens >= 1 and --batch >= 1")

    import torch
    import transformers
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    if args.model is None:
        from quantgate.target.catalogue import ensure_demo_model
        args.model = ensure_demo_model()
    args.work.mkdir(parents=True, exist_ok=True)
    names = [c.strip() for c in args.candidates.split(",") if c.strip()]
    cand_dirs = {n: ensure_candidate(n, args.model, args.work, log) for n in names}
    t_quant = time.time() - t_start

    tok = AutoTokenizer.from_pretrained(str(args.model))
    samples = stratified(load_evalset(args.evalset, with_dataset=False).samples, args.limit)
    samples.sort(key=lambda s: s.id)
    base = load_model(args.model)
    cands = {n: load_model(d) for n, d in cand_dirs.items()}
    gc = base.generation_config.eos_token_id
    eos = {int(t) for t in ([gc] if isinstance(gc, int) else (gc or []))}
    if tok.eos_token_id is not None:
        eos.add(int(tok.eos_token_id))
    pad = int(base.config.pad_token_id if base.config.pad_token_id is not None else min(eos))
    log(f"{len(samples)} prompts, seeds 0..{args.seeds - 1}, EOS ids {sorted(eos)}, candidates {names}")

    seeds = list(range(args.seeds))
    acc = {n: {s: Acc() for s in seeds} for n in names}
    old = {n: {"all": Acc(), "answer": Acc()} for n in names}
    t_sample = t_score = 0.0
    for start in range(0, len(samples), args.batch):
        batch = samples[start:start + args.batch]
        prompts = [list(tok(tok.apply_chat_template(s.chat(), add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)["input_ids"]) for s in batch]
        t0 = time.time()
        gens = [[torch.Generator().manual_seed(seed_for(sd, s.id)) for sd in seeds] for s in batch]
        rows, b_rows, b_plog = continuations(base, prompts, gens, args.max_new_tokens, eos, pad)
        for k in range(len(batch)):  # the old way's answer is a server's answer text: no EOS
            if rows[k][0] and rows[k][0][-1] in eos:
                rows[k][0], b_rows[k][0] = rows[k][0][:-1], b_rows[k][0][:-1]
        t1 = time.time()
        t_sample += t1 - t0
        for n, model in cands.items():
            c_plog, c_rows = teacher_forced(model, prompts, rows, pad)
            for k, s in enumerate(batch):
                prompt, p_len = prompts[k], len(prompts[k])
                for j, sd in enumerate(seeds, start=1):
                    row = rows[k][j]
                    pos = positions(b_rows[k][j], c_rows[k][j], row)
                    fb, fc = scored_pair(s.id, s.category, prompt + row, p_len, pos)
                    a = acc[n][sd]
                    a.add(compare_sample(fb, fc), float(sum(pos.kl)))
                    if row[-1] in eos and len(row) > 1:
                        cut = Positions(*(v[:-1] for v in (pos.kl, pos.base_lp, pos.cand_lp, pos.base_top,
                                                           pos.cand_top)))
                        fb, fc = scored_pair(s.id, s.category, prompt + row[:-1], p_len, cut)
                        a.fid_noeos.append(compare_sample(fb, fc))
                        a.exact_noeos.append(float(sum(cut.kl)))
                    elif row[-1] not in eos:
                        a.fid_noeos.append(a.fid[-1])
                        a.exact_noeos.append(a.exact[-1])
                # the old way: every position from 1 of prompt + greedy answer, and the answer positions alone
                greedy = rows[k][0]
                ids = prompt + greedy
                pos = positions(torch.cat([b_plog[k][:-1], b_rows[k][0]]), torch.cat([c_plog[k][:-1], c_rows[k][0]]),
                                ids[1:])
                fb, fc = scored_pair(s.id, s.category, ids, 1, pos)
                old[n]["all"].add(compare_sample(fb, fc), float(sum(pos.kl)))
                if greedy:
                    tail = p_len - 1
                    ans = Positions(pos.kl[tail:], pos.base_lp[tail:], pos.cand_lp[tail:], pos.base_top[tail:],
                                    pos.cand_top[tail:])
                    fb, fc = scored_pair(s.id, s.category, ids, p_len, ans)
                    old[n]["answer"].add(compare_sample(fb, fc), float(sum(ans.kl)))
        t_score += time.time() - t1
        log(f"{start + len(batch)}/{len(samples)} prompts (sampling {t_sample:.0f} s, scoring {t_score:.0f} s)")

    wall = time.time() - t_start
    print(f"# Sampled KL estimate vs exact full-vocabulary KL: {args.model.name}\n")
    print(f"- CPU: {cpu_model()} ({args.threads} torch threads); torch {torch.__version__}, transformers "
          f"{transformers.__version__}, compressed-tensors {_version('compressed-tensors')}, "
          f"llmcompressor {_version('llmcompressor')}; Python {platform.python_version()}")
    print(f"- wall time {wall:.0f} s (candidates ready {t_quant:.0f} s, sampling {t_sample:.0f} s, "
          f"scoring {t_score:.0f} s)")
    print(f"- {len(samples)} prompts of {args.evalset.name} (stratified), chat template with the generation prompt;"
          f" continuations sampled by the FP32 baseline at temperature 1, up to {args.max_new_tokens} new tokens, "
          f"seeds {seeds}; baseline logits from its sampling pass, candidates teacher-forced, all in transformers "
          f"FP32 (candidates as compressed-tensors fake-quant), {args.batch} prompts per batch")
    field_name = "kl" if NEW_CORE else "dnll"
    print(f"- estimate: the project's summarize(level={LEVEL}) `{field_name}`"
          + (" (per token: exact KL over the tokens both top-10 lists hold + the sampled log-ratio of the actual "
             "token outside them)" if NEW_CORE else " (mean of base_lp - cand_lp of the actual tokens)")
          + f"; score_from = prompt length; bound: its `high` (one-sided 95%); log-ratio: `dnll` (mean of "
          f"base_lp - cand_lp); top-10: the project's top-k KL diagnostic; bias = estimate - exact on the same "
          f"positions, SE from a cluster bootstrap over samples ({N_BOOT} resamples)\n")
    overall = []
    for n in names:
        print(f"## {n} ({cand_dirs[n]})\n")
        print("| seed | samples | tokens | exact KL | estimate | 95% upper bound | bound >= exact | bias +- SE "
              "| est/exact | log-ratio mean (bias +- SE) | log-ratio bound >= exact | top-10 KL | top-10/exact |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        rows_ = [report_row(acc[n][sd].fid, acc[n][sd].exact) for sd in seeds]
        for sd, r in zip(seeds, rows_):
            lr = r.summ.dnll
            print(f"| {sd} | {r.summ.n_samples} | {r.summ.n_tokens} | {r.exact:.5f} | {r.est.mean:.5f} | "
                  f"{r.est.high:.5f} | {'yes' if r.est.high >= r.exact else 'NO'} | {r.bias:+.6f} +- {r.se:.6f} | "
                  f"{_ratio(r.est.mean, r.exact)} | {lr.mean:.5f} ({r.lr_bias:+.6f} +- {r.lr_se:.6f}) | "
                  f"{'yes' if lr.high >= r.exact else 'NO'} | {r.topk:.5f} | {_ratio(r.topk, r.exact)} |")
        tok_all = sum(r.summ.n_tokens for r in rows_)
        pooled = sum(sum(acc[n][sd].exact) for sd in seeds) / tok_all
        est_pooled = sum(estimate_sum(f) for sd in seeds for f in acc[n][sd].fid) / tok_all
        held = sum(r.est.high >= r.exact for r in rows_)
        held_pooled = sum(r.est.high >= pooled for r in rows_)
        biases = [r.bias for r in rows_]
        sd_b = float(np.std(biases, ddof=1)) if len(biases) > 1 else float("nan")
        print(f"\n- upper bound >= exact mean of the same positions: {held}/{len(seeds)} seeds; >= the exact mean "
              f"pooled over all seeds ({pooled:.5f}): {held_pooled}/{len(seeds)}")
        print(f"- bias over seeds: mean {np.mean(biases):+.5f}, SD {sd_b:.5f}, range [{min(biases):+.5f}, "
              f"{max(biases):+.5f}] (mean SE per seed {np.mean([r.se for r in rows_]):.5f}); pooled estimate "
              f"{est_pooled:.5f} vs exact {pooled:.5f} (ratio {_ratio(est_pooled, pooled)}, {tok_all} tokens)")
        cut = [report_row(acc[n][sd].fid_noeos, acc[n][sd].exact_noeos) for sd in seeds if acc[n][sd].fid_noeos]
        if cut:
            print(f"- each continuation's final EOS left out (as if the scored text were the answer text): bias "
                  + ", ".join(f"{r.bias:+.6f} +- {r.se:.6f}" for r in cut) + " per seed")
        for label, key in (("prompt + greedy answer (every position from 1)", "all"), ("greedy answer only", "answer")):
            o = old[n][key]
            if not o.fid:
                continue
            r = report_row(o.fid, o.exact)
            print(f"- old way, {label}: {r.summ.n_samples} samples, {r.summ.n_tokens} tokens; top-10 KL {r.topk:.5f}"
                  f" vs exact {r.exact:.5f} (ratio {_ratio(r.topk, r.exact)}); the estimate's formula there "
                  f"{r.est.mean:+.5f} and log-ratio {r.summ.dnll.mean:+.5f} (no KL estimates: these tokens are "
                  f"not drawn from P_base)")
        print()
        overall.append((n, held, len(seeds), biases, [r.se for r in rows_], pooled))
    print("## Summary\n")
    for n, held, total, biases, ses, pooled in overall:
        print(f"- {n}: bound >= exact in {held}/{total} seeds; bias per seed "
              + ", ".join(f"{b:+.6f} +- {e:.6f}" for b, e in zip(biases, ses)) + f" (exact KL {pooled:.5f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
