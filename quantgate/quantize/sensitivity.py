"""Which decoder layers of a quantized candidate cost the most fidelity (adapter: transformers and torch, on CPU).

    seqs = [Scored(id, category, ids, score_from), ...]        # the baseline's own sampled continuations
    with Pair(baseline_dir, candidate_dir) as pair:
        m = pair.measure(seqs, proxy=True, restore=range(30))  # -> Measured
    m.kl["all"], m.kl["keep:12"], m.proxy["rel"]               # per-sample KL sums; per-layer proxy scores

Both checkpoints are run in transformers in FP32; a compressed-tensors candidate is loaded fake-quant (weights
dequantized, its activation quantization still applied at run time), as bench/fidelity_exact.py runs it. Every
sequence is teacher-forced on both models; at each scored position (the continuation, `score_from` on) the exact
KL(P_base || P_cand) over the whole vocabulary is summed per sample, so slices are ratios of sums, as the gate's.

- `restore`: the truth of "keep layer l at 16 bits" for each l given: the candidate with decoder layer l replaced
  by the baseline's (its norms too, which SmoothQuant rescales with the layer's weights). The candidate's hidden
  states at every layer's input are kept from one pass, so keeping layer l re-runs layers l..L only: about half a
  pass per layer instead of a whole one.
- `keep`: named sets of layers restored together (a repair the ranking proposes), one pass each.
- `proxy`: one pass of the baseline; at every layer, the candidate's layer is run on the baseline's own input and
  its output error is summed over the scored positions: "abs" (squared error) and "rel" (over the squared size of
  the layer's own update, output minus input). No KL: a ranking only, validated against `restore_each` by
  bench/repair_sensitivity.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quantgate.base.errors import QuantgateError


@dataclass(frozen=True)
class Scored:
    """One sequence to score: prompt and continuation token ids; positions from `score_from` on are scored."""
    id: str
    category: str
    ids: list[int]
    score_from: int


@dataclass
class Measured:
    """Per-sample exact KL sums per variant ("all": the candidate as quantized; "keep:<l>": layer l restored; and
    the `keep` sets by name), the scored tokens per sample, their categories, and per-layer proxy scores."""
    ids: list[str]
    categories: list[str]
    tokens: np.ndarray
    kl: dict[str, np.ndarray] = field(default_factory=dict)
    agree: dict[str, np.ndarray] = field(default_factory=dict)  # per sample: positions where both argmaxes agree
    proxy: dict[str, np.ndarray] = field(default_factory=dict)
    layers: int = 0


def load(path: Path):
    """A causal LM in FP32 on CPU; a compressed-tensors checkpoint as fake-quant: weights dequantized at load, the
    scheme's activation quantization still applied at run time (bench/fidelity_exact.py loads its models here too)."""
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    kwargs: dict = {"dtype": torch.float32}
    if "quantization_config" in json.loads((Path(path) / "config.json").read_text(encoding="utf-8")):
        try:
            kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
        except TypeError:  # transformers before `dequantize`
            kwargs["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()


def _parts(model, where: str):
    """(decoder layers, final norm, head) of a decoder-only transformers model."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "norm") or not hasattr(model, "lm_head"):
        raise QuantgateError(f"{where}: not a decoder-only model with model.layers, model.norm and lm_head",
                             where=where, fix="sensitivity ranks the layers of Llama-like transformers models")
    return inner.layers, inner.norm, model.lm_head


class Pair:
    """The baseline and a candidate of the same architecture, loaded once for several measurements."""

    def __init__(self, baseline: Path, candidate: Path, threads: int | None = None) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.base, self.cand = load(baseline), load(candidate)
        self.base_layers, _, _ = _parts(self.base, str(baseline))
        self.cand_layers, self.cand_norm, self.cand_head = _parts(self.cand, str(candidate))
        if len(self.base_layers) != len(self.cand_layers):
            raise QuantgateError(f"{candidate} has {len(self.cand_layers)} layers, {baseline} {len(self.base_layers)}",
                                 where=str(candidate), fix="compare a candidate with its own baseline")

    @property
    def layers(self) -> int:
        return len(self.cand_layers)

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        del self.base, self.cand

    def measure(self, seqs: list[Scored], *, restore: Iterable[int] = (), keep: dict[str, list[int]] | None = None,
                proxy: bool = False, batch: int = 8, progress=None) -> Measured:
        """Teacher-force `seqs` (sorted by length into right-padded batches) and measure what was asked."""
        n_layers = len(self.cand_layers)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
        out = Measured(ids=[s.id for s in seqs], categories=[s.category for s in seqs],
                       tokens=np.array([len(s.ids) - s.score_from for s in seqs], dtype=np.float64), layers=n_layers)
        restore = sorted(set(restore))
        if restore and not 0 <= restore[0] <= restore[-1] < n_layers:
            raise QuantgateError(f"layers to restore {restore} outside 0..{n_layers - 1}", where="sensitivity",
                                 fix=f"the candidate has {n_layers} decoder layers")
        names = ["all"] + [f"keep:{i}" for i in restore] + list(keep or {})
        out.kl = {name: np.zeros(len(seqs)) for name in names}
        out.agree = {name: np.zeros(len(seqs)) for name in names}
        if proxy:
            out.proxy = {"abs": np.zeros(n_layers), "rel": np.zeros(n_layers)}
        for start in range(0, len(order), batch):
            part = [seqs[i] for i in order[start:start + batch]]
            sums = self._batch(part, restore, keep or {}, out.proxy if proxy else None)
            for name, (per, agree) in sums.items():
                out.kl[name][order[start:start + batch]] = per
                out.agree[name][order[start:start + batch]] = agree
            if progress is not None:
                progress(min(start + batch, len(order)), len(order))
        return out

    def _batch(self, part: list[Scored], restore: list[int], keep: dict[str, list[int]],
               proxy: dict[str, np.ndarray] | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        import torch

        width = max(len(s.ids) for s in part)
        x = torch.zeros((len(part), width), dtype=torch.long)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        scored = torch.zeros((len(part), width), dtype=torch.bool)  # logits at t predict token t + 1
        for i, s in enumerate(part):
            x[i, :len(s.ids)] = torch.tensor(s.ids)
            mask[i, :len(s.ids)] = 1
            scored[i, s.score_from - 1:len(s.ids) - 1] = True
        rows = scored.nonzero()[:, 0].numpy()  # the sample of each scored position
        with torch.inference_mode():
            base_lp = torch.log_softmax(self._base_pass(x, mask, scored, proxy).double(), dim=-1)
            inputs, kwargs = self._cand_inputs(x, mask)

            def kl(hidden) -> tuple[np.ndarray, np.ndarray]:  # per sample: the sum of exact KL(P_base || P_cand)
                # at its positions, and the positions where both models' most likely tokens agree (the gate's top-1)
                cand_lp = torch.log_softmax(self.cand_head(self.cand_norm(hidden)[scored]).double(), dim=-1)
                per_position = (base_lp.exp() * (base_lp - cand_lp)).sum(dim=-1).numpy()
                same = (base_lp.argmax(dim=-1) == cand_lp.argmax(dim=-1)).double().numpy()
                return (np.bincount(rows, weights=per_position, minlength=len(part)),
                        np.bincount(rows, weights=same, minlength=len(part)))

            out = {"all": kl(inputs[-1])}
            for name, layers in keep.items():  # the layers below the first one kept are the candidate's as they were
                start = min(layers, default=len(self.cand_layers))
                out[name] = kl(self._run_from(inputs, kwargs, start, set(layers)))
            for i in restore:
                out[f"keep:{i}"] = kl(self._run_from(inputs, kwargs, i, {i}))
        return out

    def _base_pass(self, x, mask, scored, proxy: dict[str, np.ndarray] | None):
        """The baseline's logits at the scored positions; with `proxy`, each candidate layer's error on the
        baseline's own input added to it."""
        handles = []
        if proxy is not None:
            sel = scored[..., None]
            for i, layer in enumerate(self.base_layers):
                def hook(_mod, args, kwargs, output, i=i):
                    hidden = args[0] if args else kwargs["hidden_states"]
                    rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                    mine = self.cand_layers[i](hidden, *args[1:], **rest)
                    mine = mine[0] if isinstance(mine, tuple) else mine
                    theirs = output[0] if isinstance(output, tuple) else output
                    err = ((mine - theirs) ** 2 * sel).sum().item()
                    update = ((theirs - hidden) ** 2 * sel).sum().item()
                    proxy["abs"][i] += err
                    proxy["rel"][i] += err / max(update, 1e-30)
                handles.append(layer.register_forward_hook(hook, with_kwargs=True))
        try:
            hidden = self.base.model(x, attention_mask=mask, use_cache=False).last_hidden_state  # after the norm
        finally:
            for h in handles:
                h.remove()
        return self.base.lm_head(hidden[scored])

    def _cand_inputs(self, x, mask):
        """The candidate's hidden state at every layer's input and after the last ([L + 1]), and the keyword
        arguments its layers were called with (rotary embeddings, the causal mask)."""
        inputs: list = []
        kwargs: dict = {}

        def hook(_mod, args, kw):
            inputs.append(args[0] if args else kw["hidden_states"])
            if not kwargs:
                kwargs.update({k: v for k, v in kw.items() if k != "hidden_states"})

        handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in self.cand_layers]
        last: list = []
        handles.append(self.cand_norm.register_forward_pre_hook(lambda _m, args: last.append(args[0])))
        try:
            self.cand.model(x, attention_mask=mask, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        return [*inputs, last[0]], kwargs

    def _run_from(self, inputs: list, kwargs: dict, start: int, restored: set[int]):
        """The candidate's last hidden state (before its norm), run from layer `start` on with the layers in
        `restored` the baseline's."""
        hidden = inputs[start]
        for i in range(start, len(self.cand_layers)):
            layer = self.base_layers[i] if i in restored else self.cand_layers[i]
            hidden = layer(hidden, **kwargs)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        return hidden


def read_samples(path: Path, categories: set[str] | None = None) -> list[Scored]:
    """The sequences of a fidelity samples file (quantgate.fidelity.sampling: prompt_ids + sampled ids), scored
    from the continuation on."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if categories is not None and r["category"] not in categories:
            continue
        prompt = list(r["prompt_ids"])
        if r["ids"]:
            out.append(Scored(id=r["id"], category=r["category"], ids=prompt + list(r["ids"]), score_from=len(prompt)))
    return out
