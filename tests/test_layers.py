"""The dependency rule of quantgate's packages (docs/design.md, "Layers"), checked on every import the code has.

Every `import` and `from ... import` is read with `ast`, inside functions too:
- `base` (plumbing) imports nothing of quantgate outside itself;
- a capability package imports `base` and the packages before it in LAYERS, never one after it;
- nothing imports `cli` but `cli` itself, and nothing in `quantgate` imports `flows`;
- imports of quantgate modules stand at module top (inside a function they would hide the graph);
- pure modules import neither an I/O library nor an adapter module;
- Prefect is imported only by `release`, `pools` and `cli`, inside functions too.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "quantgate"

# Lowest first: a package may import those before it.
LAYERS = ["base", "target", "plan", "quantize", "serving", "evals", "recall", "parity", "perf", "fidelity", "judge",
          "gate", "report", "publishing", "spec", "release", "kinds", "pools", "cli"]

# Pure modules: computation only, no I/O; table-driven unit tests cover them.
PURE = {"base.errors", "base.stats", "base.subsets", "base.runfiles", "plan.knobs", "quantize.devices", "quantize.repair", "plan.planner", "plan.commands", "plan.models", "plan.slots", "evals.compare", "recall.needle",
        "recall.score", "parity.core", "perf.compare", "perf.models", "perf.intervals", "perf.sweep", "perf.metrics",
        "gate.payoff", "gate.sizeratio", "judge.core", "judge.corrupt", "judge.report",
        "gate.checks", "gate.models", "gate.statistical", "gate.sizing", "gate.looks", "gate.stream", "gate.fidelityevidence", "fidelity.bounds", "release.ladder", "fidelity.core",
        "report.sections"}
IO_LIBS = {"subprocess", "socket", "shutil", "sqlite3", "asyncio", "urllib", "http", "httpx", "openai", "prefect",
           "transformers", "torch", "datasets", "evaluate", "matplotlib", "requests", "aiohttp", "psutil"}
# The orchestration layer: the capability packages below it run without Prefect (a key in a Prefect Secret block is
# read by release.secrets and handed down).
PREFECT_PACKAGES = {"release", "pools", "cli"}
# Adapter modules (they touch files, processes or the network): a pure module must not import them.
ADAPTER_PREFIXES = ("base.fileio", "base.yamlconfig", "base.http", "serving.", "evals.client", "evals.run", "evals.scoring",
                    "evals.dataset", "recall.run", "parity.engine", "perf.probe", "judge.client", "judge.run",
                    "judge.review", "quantize.run", "quantize.runner", "quantize.calibration", "quantize.sensitivity", "report.", "release.", "publishing.", "spec.", "pools.",
                    "target.catalogue", "cli.", "fidelity.run")


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    target: str
    rule: str

    def __str__(self) -> str:
        return f"quantgate/{self.module.replace('.', '/')}.py:{self.line} imports {self.target}: {self.rule}"


def _imports(tree: ast.AST) -> list[tuple[int, str, bool]]:
    """(line, imported module, inside a function) for every import of the tree."""
    inner: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner.update(id(n) for n in ast.walk(fn) if n is not fn)
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            names = [f"{n.module}.{a.name}" for a in n.names] if n.module == "quantgate" else [n.module]
            out += [(n.lineno, m, id(n) in inner) for m in names]
        elif isinstance(n, ast.Import):
            out += [(n.lineno, a.name, id(n) in inner) for a in n.names]
    return out


def check_source(module: str, source: str) -> list[Violation]:
    """Every rule above, for one module given by its dotted name inside quantgate ("gate.checks")."""
    pkg = module.split(".")[0]
    found = []
    for line, target, inside in _imports(ast.parse(source)):
        top = target.split(".")[0]
        if top != "quantgate":
            if module in PURE and top in IO_LIBS:
                found.append(Violation(module, line, target, "a pure module imports an I/O library"))
            if top == "prefect" and pkg not in PREFECT_PACKAGES:
                found.append(Violation(module, line, target, "Prefect is imported by release, pools and cli only"))
            continue
        rel = target.removeprefix("quantgate").lstrip(".")
        tpkg = rel.split(".")[0]
        if inside:
            found.append(Violation(module, line, target, "quantgate imports go at module top"))
        if tpkg == "flows" or (tpkg == "cli" and pkg != "cli"):
            found.append(Violation(module, line, target, "nothing imports cli or flows"))
        elif tpkg != pkg and tpkg in LAYERS and pkg in LAYERS and LAYERS.index(tpkg) > LAYERS.index(pkg):
            found.append(Violation(module, line, target, f"{pkg} is below {tpkg} in the layer order"))
        elif tpkg not in LAYERS and rel:
            found.append(Violation(module, line, target, "not a package of the layer order"))
        if module in PURE and (rel + ".").startswith(ADAPTER_PREFIXES):
            found.append(Violation(module, line, target, "a pure module imports an adapter"))
    return found


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG).with_suffix("").parts
        out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__", path))
    return out


def test_every_module_follows_the_dependency_rule():
    violations = [v for name, path in _modules() for v in check_source(name, path.read_text(encoding="utf-8"))]
    assert not violations, "\n".join(map(str, violations))


def test_every_module_sits_in_a_package_of_the_order():
    loose = [name for name, _ in _modules() if name != "__init__" and name.split(".")[0] not in LAYERS]
    assert not loose, f"modules outside the layer packages: {loose}"
    top = [p.name for p in PKG.iterdir() if p.name != "__pycache__"]
    assert len(top) <= 20, f"{len(top)} top-level entries in quantgate/: {sorted(top)}"


def test_pure_modules_exist():
    names = {name for name, _ in _modules()}
    missing = {m for m in PURE if m not in names}
    assert not missing, missing


@pytest.mark.parametrize(("module", "source", "rule"), [
    ("base.fileio", "from quantgate.gate.checks import evaluate\n", "below gate"),
    ("plan.planner", "from quantgate.report.store import Store\n", "below report"),
    ("gate.checks", "import httpx\n", "I/O library"),
    ("gate.checks", "from quantgate.evals.run import run_eval\n", "adapter"),
    ("evals.run", "def f():\n    from quantgate.base.errors import ConfigError\n", "module top"),
    ("release.steps", "from quantgate.cli.plan import plan\n", "cli or flows"),
    ("gate.evidence", "from quantgate import cli_plan\n", "not a package"),
    ("base.fileio", "def f():\n    from prefect.blocks.system import Secret\n", "Prefect"),
    ("serving.endpoint", "import prefect\n", "Prefect"),
])
def test_a_deliberate_violation_is_caught(module, source, rule):
    found = check_source(module, source)
    assert any(rule in v.rule for v in found), found


def test_allowed_imports_pass():
    assert check_source("release.steps", "from quantgate.gate.checks import evaluate\nimport httpx\n") == []
    assert check_source("cli.plan", "from quantgate.cli.main import app\n") == []
    assert check_source("evals.run", "def f():\n    import torch\n") == []
    assert check_source("release.secrets", "def f():\n    from prefect.blocks.system import Secret\n") == []


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60


def size_problems(name: str, source: str) -> list[str]:
    """A module over MAX_MODULE_LINES lines, and each function over MAX_FUNCTION_LINES (decorators excluded)."""
    out = [f"{name}: {n} lines > {MAX_MODULE_LINES}"] if (n := len(source.splitlines())) > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                out.append(f"{name}:{node.lineno} {node.name}() has {length} lines > {MAX_FUNCTION_LINES}")
    return out


def test_modules_and_functions_stay_small():
    """Read in an afternoon: no module over 400 lines, no function over 60 (quantgate/ and flows/)."""
    files = [*PKG.rglob("*.py"), *(PKG.parent / "flows").rglob("*.py")]
    problems = [p for f in files for p in size_problems(str(f.relative_to(PKG.parent)), f.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


def test_the_size_rule_catches_a_long_function_and_a_long_module():
    long_fn = "def f():\n" + "    x = 1\n" * 60
    assert [p for p in size_problems("m", long_fn) if "f() has 61 lines" in p]
    assert [p for p in size_problems("m", "x = 1\n" * 401) if "401 lines > 400" in p]
    assert size_problems("m", "def f():\n" + "    x = 1\n" * 59) == []


MAX_PARAMETERS = 6
# Functions of the release path (quantgate/release, flows/) allowed over MAX_PARAMETERS: none. A function that
# needs more takes a typed settings or job object (docs/design.md: MeasureRequest, VariantJob, registry.Promotion).
OVER_PARAMETERS: set[str] = set()


def parameter_problems(name: str, source: str) -> set[str]:
    """`name:function` for each function taking more than MAX_PARAMETERS parameters (self and cls not counted)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = [x for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg not in ("self", "cls")]
            if len(params) + bool(a.vararg) + bool(a.kwarg) > MAX_PARAMETERS:
                out.add(f"{name}:{node.name}")
    return out


def test_release_path_functions_take_few_parameters():
    """No function on the release path takes more than 6 parameters, but those still listed (a ratchet)."""
    files = [*(f for p in ("release", "spec", "publishing", "pools") for f in (PKG / p).rglob("*.py")),
             *(PKG.parent / "flows").rglob("*.py")]
    found = set().union(*(parameter_problems(str(f.relative_to(PKG)) if f.is_relative_to(PKG) else
                                             str(f.relative_to(PKG.parent)), f.read_text(encoding="utf-8"))
                          for f in files))
    assert not found - OVER_PARAMETERS, f"over {MAX_PARAMETERS} parameters: {sorted(found - OVER_PARAMETERS)}"
    assert not OVER_PARAMETERS - found, f"no longer over the limit, take them off the list: {sorted(OVER_PARAMETERS - found)}"


def test_the_parameter_rule_counts_keyword_only_and_star_args():
    assert parameter_problems("m", "def f(a, b, c, *, d, e, f, g): pass") == {"m:f"}
    assert parameter_problems("m", "def f(self, a, b, c, d, e, g): pass") == set()
    assert parameter_problems("m", "def f(a, b, c, d, e, *args, **kw): pass") == {"m:f"}


def test_class_names_are_unique_across_the_package():
    """One name, one thing: a public class name is defined once in quantgate/ (private bases like `_Model` may
    repeat), so that `Decision` or `Variant` in a traceback or a review means one class."""
    seen: dict[str, list[str]] = {}
    for name, path in _modules():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                seen.setdefault(node.name, []).append(name)
    twice = {c: mods for c, mods in seen.items() if len(mods) > 1}
    assert not twice, f"defined in more than one module: {twice}"
