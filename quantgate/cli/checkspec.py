"""What a release would refuse of a spec, refused by `quantgate check` and `release --check` before any work, at the
spec's (or its policy's) line: each of these passed `check` and failed the release later, or ran it on wrong terms.

    context            longer than the model's max_position_embeddings (vLLM refused it at the first server start)
    executor.store     a pools release's store URL that fsspec cannot open (the release refused it in 1.7 s: the
                       same function, quantgate.base.objstore.ResultStore, says which schemes the store takes)
    model              a checkpoint that is quantized already (its config.json's quantization_config) with `schemes`
                       to quantize it again, unless `quantization.requantize: true` says so
    policy             a file that is no gate policy (an eval set, a spec): named at the spec's `policy` line, not
                       as a policy's many schema errors
    categories         a policy category that no eval set of the spec has, where the policy writes `required: true`
                       for it (left out, the check does not apply: a warning naming the policy's line)
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

from quantgate.base.errors import ConfigError, QuantgateError
from quantgate.base.objstore import ResultStore
from quantgate.base.paths import REPO, results_dir
from quantgate.base.yamlconfig import read_yaml, top_line
from quantgate.cli.checkkind import Kind, Skip, detect_kind
from quantgate.gate.feeding import Unfed
from quantgate.gate.policy import DEFAULT_POLICY
from quantgate.spec.autoschemes import local_config
from quantgate.spec.external import detect_scheme, read_config
from quantgate.spec.familycheck import findings, spec_schemes
from quantgate.spec.schema import ReleaseSpec


def _at(path: Path, key: tuple) -> str:
    """`spec.yaml:LINE field 'a.b'`: the line of `key` in the file (its top line when the key is not written)."""
    _, lines = read_yaml(path)
    return f"{path}:{lines.get(key, top_line(lines))} field '{'.'.join(map(str, key))}'"


def _model_config(spec: ReleaseSpec) -> tuple[Path, dict] | None:
    """The model's config.json and its content, where the model is on disk and its config is readable (the folder
    check names an unreadable one)."""
    config = local_config(spec.model)
    try:
        return (config, read_config(config.parent)) if config is not None else None
    except ValueError:
        return None


def context_fits(path: Path, spec: ReleaseSpec) -> None:
    """Refuse a `context` longer than the model's max_position_embeddings (its config.json, where the model is on
    disk): vLLM refuses such a --max-model-len at the first server start, seconds into the release, with exit 1."""
    found = _model_config(spec)
    most = found[1].get("max_position_embeddings") if found is not None else None
    if found is None or not isinstance(most, int) or isinstance(most, bool) or spec.context <= most:
        return
    _, lines = read_yaml(path)
    given = ("context",) in lines
    raise QuantgateError(f"context {spec.context}{'' if given else ' (the default)'} is longer than the model's "
                         f"max_position_embeddings {most} ({found[0]}): vLLM would refuse to serve it",
                         where=_at(path, ("context",)), fix=f"set `context` to {most} or less (and recall.lengths to fit it)")


def store_opens(path: Path, spec: ReleaseSpec) -> None:
    """A pools release's `executor.store` opened as the release opens it (ResultStore: fsspec, no transfer)."""
    if spec.executor.kind != "pools" or spec.executor.store is None:
        return
    try:
        ResultStore(spec.executor.store, results_dir())
    except ConfigError as exc:
        raise QuantgateError(exc.message, where=_at(path, ("executor", "store")), fix=exc.fix) from None


def not_quantized_twice(path: Path, spec: ReleaseSpec) -> None:
    """Refuse `schemes` for a `model` whose config.json holds a quantization_config: llmcompressor would quantize
    the quantized weights again (an INT8 checkpoint into W4A16), and the gate would judge the result against a
    baseline that is no 16-bit model. `quantization.requantize: true` says it is meant."""
    found = _model_config(spec)
    quant = found[1].get("quantization_config") if found is not None else None
    if found is None or not quant or not (spec.schemes or spec.auto_schemes) or spec.quantization.requantize:
        return
    _, what = detect_scheme(quant if isinstance(quant, dict) else {})
    schemes = spec.schemes or ["auto"]
    raise QuantgateError(f"model {spec.model} is quantized already: {found[0]} field 'quantization_config' holds "
                         f"{what}; schemes {', '.join(schemes)} would quantize it again",
                         where=_at(path, ("model",)),
                         fix="give its unquantized checkpoint as `model` (to gate this one as it is, list it under "
                             "`candidates` as {name: ..., checkpoint: DIR}), or set `quantization.requantize: true` "
                             "to quantize it again")


_KINDS = {Kind.spec: "a release spec", Kind.policy: "a gate policy", Kind.evalset: "an eval set",
          Kind.review: "a human-review CSV"}


def policy_is_one(path: Path, spec: ReleaseSpec) -> None:
    """Refuse a `policy` that is another kind of file (an eval set, a release spec): read as a policy it gave a
    page of schema errors in that file, naming neither the spec nor its field."""
    if spec.policy is None:
        return
    try:
        kind = _KINDS[detect_kind(spec.policy)]
    except Skip as what:
        kind = str(what)
    except QuantgateError:  # no kind it can tell: loaded as a policy, whose own errors name the file
        return
    if kind != _KINDS[Kind.policy]:
        raise QuantgateError(f"{spec.policy} is not a gate policy: it reads as {kind}", where=_at(path, ("policy",)),
                             fix=f"point `policy` at a gate policy YAML (releases/policies/*.yaml), or remove it for "
                                 f"the default ({DEFAULT_POLICY.relative_to(REPO)})")


def family_warnings(spec: ReleaseSpec) -> list[str]:
    """The support matrix's warnings for the model's family (never measured, or a scheme never measured with it),
    where the model is on disk; its refusals are the resolver's (quantgate.spec.resolve)."""
    found = _model_config(spec)
    if found is None:
        return []
    return findings(found[1], spec.hardware, spec_schemes(spec), spec.serving.python).warnings


def refuse_before_work(path: Path, spec: ReleaseSpec) -> None:
    """Every refusal above that needs only the spec and the files it names (the categories need the eval sets)."""
    for refusal in (context_fits, store_opens, not_quantized_twice, policy_is_one):
        refusal(path, spec)


def absent_categories(spec: ReleaseSpec, warnings: list[Unfed]) -> tuple[list[str], QuantgateError | None]:
    """The unfed-check warnings as `check` prints them, a category that no eval set has at its line in the policy;
    and the refusal of those the policy writes `required: true` for: it demands the category, and the release's
    sets cannot give it (the gate would skip the check as not applying)."""
    policy = spec.policy or DEFAULT_POLICY
    data, _ = read_yaml(policy)
    cats = data.get("categories") if isinstance(data, dict) else None
    cats = cats if isinstance(cats, dict) else {}
    keys = {unicodedata.normalize("NFC", str(k)): k for k in cats}  # the policy loads its names in NFC
    said, demanded = [], []
    for w in warnings:
        if w.absent is None:
            said.append(f"unfed check {w}")
            continue
        cat, why = w.absent
        where = _at(policy, ("categories", keys.get(cat, cat)))
        written = cats.get(keys.get(cat, cat))
        if isinstance(written, dict) and written.get("required") is True:
            demanded.append((where, cat, why))
        else:
            said.append(f"{where}: unfed check {w}")
    if not demanded:
        return said, None
    where, cat, why = demanded[0]
    more = "".join(f"\n  {w}: {c!r} as well" for w, c, _ in demanded[1:])
    return said, QuantgateError(f"the policy requires category {cat!r} (`required: true`), but {why}{more}",
                                where=where, fix=f"add samples of category {cat!r} to an eval set the spec lists "
                                f"(declared in its sidecar's `categories`), or set categories.{cat}.required: false "
                                "in the policy (the check then does not apply to this release)")
