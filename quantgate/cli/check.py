"""`quantgate check PATH... [--kind KIND]`: validate input files without serving or quantizing anything.

Kinds (detected per file, or forced with --kind):
  spec     release spec YAML: a `model:` key, or a YAML file under releases/ (not releases/policies/)
  policy   gate policy YAML: `primary:` or another check key, or a YAML file under releases/policies/
  evalset  eval set: `<name>.jsonl` (or .parquet, .csv with a sidecar, a folder saved by `datasets`) with its
           `<name>.meta.yaml` sidecar (either may be named); its prompts are
           checked against a context (an estimate of characters/4) when one is given: `--context N`, `--spec SPEC`
           (its `context`) or `--model MODEL` (its config.json's max_position_embeddings); without one a `note` says
           that lengths were not checked
  review   filled human-review CSV (`quantgate review export`); its review ids are matched against the key given
           with `--review-key` (the key file or the judge folder holding review_key.json), else a `note` says not
A spec is checked with everything it names: each eval set (prompts against the spec's `context`) and its gate policy
(default: releases/policies/default.yaml); its model folder (unless a catalogue id), each candidate checkpoint and a
judge it serves from a folder: there, readable, no symlink loop, a config.json, weights files, and for a quantized
checkpoint weights stored as its scheme says (safetensors headers; quantgate.spec.external.checkpoint_problems).
A relative `model` folder is taken from the current directory, as the release resolves it. What the release would
refuse later is refused here (quantgate.cli.checkspec): a `context` longer than the model's max_position_embeddings,
a pools store URL fsspec cannot open, `schemes` for a model quantized already, a `policy` that is no policy, a
category the policy requires (`required: true`) that no eval set has. Its schemes are checked
against what this machine's serving build runs (the kernel probe, quantgate.serving.cpu_kernels) when its hardware is a CPU profile:
an explicit scheme that cannot run here is an error naming the probe's finding (`skip_unsupported: true` drops it
instead); what `hardware: auto` and `skip_unsupported` decided is printed as `note` lines on stderr.

Output: `ok KIND PATH` per good file (stdout); per bad file `error KIND PATH` and the problem with its file, line,
field and fix (stderr); `skip PATH` for YAML files of another kind (the model catalogue, the engine parity policy).
A good spec's policy checks that its eval sets and sections cannot feed are `warning` lines, each with the field
that fixes it (quantgate.gate.feeding). Exit 0 when every file is good, 2 when any is bad, 6 (CANNOT_PROMOTE) when
every file is good but a spec cannot PROMOTE as written (a required check it cannot feed). No traceback for bad input.
"""

from __future__ import annotations

import errno
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from quantgate.base.errors import QuantgateError
from quantgate.base.yamlconfig import read_yaml, top_line
from quantgate.cli.checkkind import Kind, Skip, detect_kind
from quantgate.cli.checkspec import absent_categories, family_warnings, refuse_before_work
from quantgate.evals.dataset import load_evalset
from quantgate.evals.setsource import is_evalset_folder, meta_path_for, samples_beside
from quantgate.gate.feeding import CANNOT_PROMOTE
from quantgate.gate.policy import DEFAULT_POLICY, load_policy
from quantgate.judge.review import check_csv, key_path_for, load_key
from quantgate.judge.reviewfile import ReviewKey
from quantgate.spec.autoschemes import local_config
from quantgate.spec.external import checkpoint_problems, read_config
from quantgate.spec.resolve import load_spec, refuse_unservable
from quantgate.spec.schema import ReleaseSpec
from quantgate.spec.warn import eval_subsets, feed_warnings, own_categories
from quantgate.target.catalogue import load_catalogue


def _show(path: Path) -> str:
    """A path as the user would write it: relative to the current directory when below it."""
    try:
        return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd().resolve()) else str(path)
    except ValueError:
        return str(path)


Result = tuple[Kind | None, Path, QuantgateError | None]


def _attempt(kind: Kind | None, path: Path, fn, *args, **kwargs) -> tuple[Result, Any]:
    """Run one loader: ((kind, path, error or None), its value). Anything but a QuantgateError is a bug in quantgate,
    still reported as one message."""
    try:
        return (kind, path, None), fn(*args, **kwargs)
    except Skip:
        raise
    except QuantgateError as exc:
        return (kind, path, exc), None
    except Exception as exc:  # noqa: BLE001 - not the user's input: no traceback either
        return (kind, path, QuantgateError(f"unexpected {type(exc).__name__}: {exc}", where=str(path),
                                           fix="report this as a quantgate bug, with the file")), None


@dataclass
class Checked:
    """What checking the files found so far: the files already checked (a spec's policy or eval set named twice is
    checked once), how many were bad, and the good specs that cannot PROMOTE as written."""
    done: set[Path] = field(default_factory=set)
    bad: int = 0
    cannot_promote: list[Path] = field(default_factory=list)

    def exit(self, unpromotable: bool = True) -> None:
        """Exit 2 when any file was bad, else (`unpromotable`) CANNOT_PROMOTE when a spec cannot PROMOTE as written,
        else return: a CI job that checks a spec before spending GPU hours learns it from the code alone."""
        if self.bad:
            print(f"check: {self.bad} bad file(s)", file=sys.stderr)
            raise typer.Exit(2)
        if unpromotable and self.cannot_promote:
            print(f"check: {', '.join(map(_show, self.cannot_promote))} cannot PROMOTE as written: a required check "
                  f"is unfed, or its slices are too few to bound a candidate at half its limits (the `unfed check` "
                  f"warnings above, each with its fix); exit {CANNOT_PROMOTE}",
                  file=sys.stderr)
            raise typer.Exit(CANNOT_PROMOTE)


@dataclass
class Given:
    """What the options gave the checks: the context standalone eval sets are checked against, the review key."""
    context: int | None = None
    key: ReviewKey | None = None


def _check_evalset(path: Path, max_context: int | None = None) -> None:
    if not path.exists() and meta_path_for(path).is_file():
        raise QuantgateError("eval set not found (its sidecar is there)", where=str(path),
                             fix="write the samples beside the sidecar: <name>.jsonl, .parquet or .csv, or a "
                                 "datasets folder <name>")
    load_evalset(path, max_context=max_context)


def _model_folders(spec: ReleaseSpec) -> list[tuple[tuple, Path, str | None, bool, str]]:
    """(key path, folder, scheme, weights needed, fix) of every checkpoint folder the spec names: `model` and a
    `judge.serve` when they are no catalogue id (taken from the current directory, as `resolve_model` does), each
    candidate checkpoint. The model needs weights unless only its config and tokenizer are used (endpoint baseline,
    no scheme to quantize)."""
    catalogue = load_catalogue()
    fix_model = (f"give a catalogue id ({', '.join(sorted(catalogue))}: releases/models.yaml) or a Hugging Face "
                 "checkpoint folder holding config.json and its weights")
    out: list[tuple[tuple, Path, str | None, bool, str]] = []
    if spec.model not in catalogue:
        weights = spec.baseline is None or bool(spec.schemes) or bool(spec.auto_schemes)
        out.append((("model",), Path(spec.model).expanduser(), None, weights, fix_model))
    serve = spec.judge.serve if spec.judge is not None else None
    if serve and serve not in catalogue:
        out.append((("judge", "serve"), Path(serve).expanduser(), None, True, fix_model))
    for i, c in enumerate(spec.candidates):
        if c.checkpoint is not None:
            out.append((("candidates", i, "checkpoint"), c.checkpoint, c.scheme, True,
                        "point `checkpoint` at a folder holding config.json and the weights it describes (what "
                        "`quantgate quantize` or llmcompressor wrote)"))
    return out


def _check_folders(path: Path, spec: ReleaseSpec) -> None:
    """Refuse a model, judge or candidate folder that quantgate could not serve, at the line of the field naming it."""
    problems = []
    for at, folder, scheme, weights, fix in _model_folders(spec):
        found = checkpoint_problems(folder, scheme, weights=weights)
        beside = path.parent / folder
        if found and at[0] != "candidates" and not folder.is_absolute() and not os.path.lexists(folder) \
                and os.path.lexists(beside):
            found[-1] += (f"; a relative folder is taken from the current directory ({Path.cwd()}), not from the "
                          f"spec's: write {os.path.realpath(beside)}")  # realpath: a loop is no error here
        problems += [(at, why, fix) for why in found]
    if not problems:
        return
    _, lines = read_yaml(path)
    where = [f"{path}:{lines.get(at, top_line(lines))} field '{'.'.join(map(str, at))}'" for at, _, _ in problems]
    (at, why, fix), rest = problems[0], "".join(f"\n  {w}: {p[1]}" for w, p in zip(where[1:], problems[1:]))
    raise QuantgateError(why + rest, where=where[0], fix=fix)


def _load_spec(path: Path) -> ReleaseSpec:
    """The spec, its schemes checked against this machine, its model and checkpoint folders looked at, and what the
    release would refuse before work (quantgate.cli.checkspec); the notes of `hardware: auto` / skip_unsupported."""
    spec = load_spec(path)
    refuse_unservable(spec, path)
    _check_folders(path, spec)
    refuse_before_work(path, spec)
    for note in spec.machine_notes:
        print(f"note spec {_show(path)}: {note}", file=sys.stderr, flush=True)
    for warning in family_warnings(spec):
        print(f"warning spec {_show(path)}: {warning}", file=sys.stderr, flush=True)
    return spec


def _note(kind: Kind, path: Path, given: Given) -> None:
    """What a check of a good file could not do for want of an option, on stderr (the file is still ok)."""
    if kind is Kind.evalset and given.context is None:
        why = "prompt lengths not checked: no context given (--context N, --spec SPEC or --model MODEL)"
    elif kind is Kind.review and given.key is None:
        why = "review ids not matched against a key (--review-key KEY, or the judge folder holding review_key.json)"
    else:
        return
    print(f"note {kind.value} {_show(path)}: {why}", file=sys.stderr, flush=True)


def _check_one(path: Path, kind: Kind, seen: Checked, given: Given | None = None) -> list[Result]:
    """(kind, path, error or None) for the file and, for a spec, every file it names; files in `seen.done` are
    skipped, and a good spec that cannot PROMOTE is added to `seen.cannot_promote`."""
    given = given or Given()
    if kind is Kind.evalset and path.name.endswith(".meta.yaml"):
        path = samples_beside(path)
    real = Path(os.path.realpath(path))  # not Path.resolve(): it raises on a symlink loop
    if real in seen.done:
        return []
    seen.done.add(real)
    loader = {Kind.spec: _load_spec, Kind.policy: load_policy,
              Kind.evalset: lambda p: _check_evalset(p, given.context), Kind.review: lambda p: check_csv(p, given.key)}
    result, value = _attempt(kind, path, loader[kind], path)
    if result[2] is None:
        _note(kind, path, given)
    results = [result]
    if kind is Kind.spec and isinstance(value, ReleaseSpec):
        for es in value.eval_sets:
            if (real_es := Path(os.path.realpath(es))) not in seen.done:
                seen.done.add(real_es)
                results.append(_attempt(Kind.evalset, es, _check_evalset, es, max_context=value.context)[0])
        results += _check_one(value.policy or DEFAULT_POLICY, Kind.policy, seen, given)
        if all(err is None for _, _, err in results):
            subsets = eval_subsets(value)  # read once for both
            warnings = feed_warnings(value, subsets)  # the policy's checks its eval sets cannot feed (stderr)
            said, refused = absent_categories(value, warnings)
            for line in said:
                print(f"warning spec {_show(path)}: {line}", file=sys.stderr, flush=True)
            if (own := own_categories(value, subsets)) is not None:
                print(f"note spec {_show(path)}: {own}", file=sys.stderr, flush=True)
            if refused is not None:  # a category the policy requires and no set has: the spec is bad
                results[0] = (Kind.spec, path, refused)
            elif any(w.blocks for w in warnings):
                seen.cannot_promote.append(path)
    return results


def _model_context(model: str) -> int:
    """max_position_embeddings of a catalogue model on disk or a checkpoint folder's config.json."""
    config = local_config(model)
    if config is None:
        raise QuantgateError("no config.json for this model on disk", where=model,
                             fix="give a checkpoint folder, a catalogue model already fetched (quantgate models demo), "
                                 "or --context N")
    try:
        n = read_config(config.parent).get("max_position_embeddings")
    except ValueError as exc:
        raise QuantgateError(str(exc), where=str(config), fix="give another model, or --context N") from None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise QuantgateError(f"config.json has no max_position_embeddings (got {n!r})", where=str(config),
                             fix="give the served context with --context N")
    return n


def _given(context: int | None, spec: Path | None, model: str | None,
           review_key: Path | None) -> tuple[Given, list[Result]]:
    """The options as a Given, and an error (kind None) for each option whose file could not be used."""
    errors: list[Result]
    given, errors = Given(), []
    if context is not None:
        given.context = context
    elif spec is not None:
        (_, _, err), value = _attempt(Kind.spec, spec, load_spec, spec)
        if err is not None:
            errors.append((Kind.spec, spec, err))
        else:
            given.context = value.context
    elif model is not None:
        (_, _, err), value = _attempt(None, Path(model), _model_context, model)
        if err is not None:
            errors.append((None, Path(model), err))
        else:
            given.context = value
    if review_key is not None:
        (_, _, err), value = _attempt(Kind.review, key_path_for(review_key), load_key, review_key)
        if err is not None:
            errors.append((Kind.review, key_path_for(review_key), err))
        given.key = value
    return given, errors


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def _is_loop(path: Path) -> bool:
    """A path whose symlinks point back at themselves (Path.exists() only says False)."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def _report(results: list[Result]) -> int:
    """Print `ok` (stdout) or `error` (stderr) per result; the number of errors."""
    bad = 0
    for k, p, err in results:
        label = k.value if k else ("yaml" if p.suffix in (".yaml", ".yml") else "file")
        if err is None:
            print(f"ok {label} {_show(p)}", flush=True)
        else:
            bad += 1
            print(f"error {label} {_show(p)}\n{_indent(err.render())}", file=sys.stderr, flush=True)
    return bad


def check(
    paths: Annotated[list[Path], typer.Argument(help="files to check: release specs, gate policies, eval sets "
                                                     "(.jsonl, .parquet, a datasets folder), human-review CSVs", show_default=False)],
    kind: Annotated[Kind | None, typer.Option(help="the kind of every PATH (default: detected per file)")] = None,
    context: Annotated[int | None, typer.Option(min=1, help="served context in tokens: eval-set prompts "
                                                   "(characters/4) plus max_tokens must fit it")] = None,
    spec: Annotated[Path | None, typer.Option(help="release spec whose `context` eval sets must fit (when no "
                                                 "--context)")] = None,
    model: Annotated[str | None, typer.Option(help="model (catalogue id on disk, or checkpoint folder) whose "
                                                 "max_position_embeddings eval sets must fit (when no --context "
                                                 "or --spec)")] = None,
    review_key: Annotated[Path | None, typer.Option(help="review key (review_key.json) or the judge folder "
                                                       "holding it: review CSV ids must be in it")] = None,
) -> None:
    """Validate input files without serving or quantizing anything: `ok KIND PATH` per good file, the problem
    (file, line, field, fix) per bad one. Exit 0 when all are good, 2 when any is bad, 6 when all are good but a spec
    cannot PROMOTE as written (a required check its eval sets or sections cannot feed: the warnings name the fix)."""
    given, errors = _given(context, spec, model, review_key)
    seen = Checked(bad=_report(errors))
    validate(paths, kind, seen, given)
    seen.exit()


def validate(paths: list[Path], kind: Kind | None, seen: Checked, given: Given | None = None) -> Checked:
    """Check each path (its kind detected when `kind` is None) and every file a spec names, printing `ok`, `error`,
    `skip` and `warning` lines; what was found is added to `seen`, which is returned."""
    given = given or Given()
    for path in paths:
        results: list[Result]
        if path.is_dir() and (kind is Kind.evalset or (kind is None and is_evalset_folder(path))):
            results = _check_one(path, Kind.evalset, seen, given)
        elif path.is_dir():
            results = [(kind, path, QuantgateError("is a folder", where=str(path), fix="name the files, e.g. "
                                                   "releases/*.yaml (a folder saved by datasets is an eval set when "
                                                   "its <name>.meta.yaml sidecar is beside it)"))]
        elif not path.exists():
            results = [(kind, path, QuantgateError("a symlink loop" if _is_loop(path) else "file not found",
                                                   where=str(path), fix="check the path"))]
        else:
            result: Result
            try:
                result, detected = (kind, path, None), kind
                if detected is None:
                    result, detected = _attempt(kind, path, detect_kind, path)
            except Skip as why:
                print(f"skip {_show(path)}: {why}, not a kind `quantgate check` validates", flush=True)
                continue
            results = _check_one(path, detected, seen, given) if detected else [result]
        seen.bad += _report(results)
    return seen
