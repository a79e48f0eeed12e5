"""Whether two run folders hold the same decision.json and summary.json, apart from what differs by nature between
two runs: timestamps (`created`, `finished`, ...), the run id, schema versions and the checkout's folder.

A refactor that must not change behaviour is checked with it: decide one run's cached evidence twice, with the
code before and after (an unchanged re-run serves nothing), then compare.

    QUANTGATE_RESULTS=R quantgate release releases/demo.yaml --run-id before   # in a checkout of the old commit
    QUANTGATE_RESULTS=R quantgate release releases/demo.yaml --run-id after    # in this one
    python bench/same_decision.py R/runs/before R/runs/after [--root OLD_CHECKOUT]

Exit 0 when both files are the same, 1 with a unified diff of the sorted JSON otherwise.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

VOLATILE = frozenset({"created", "decided_at", "written", "finished", "started", "schema_version"})
FILES = ("decision.json", "summary.json")
REPO = Path(__file__).resolve().parents[1]


def normalized(doc: Any, run: str, roots: list[str]) -> Any:
    """The document without volatile keys, with the run id and checkout folders replaced by placeholders."""
    if isinstance(doc, dict):
        return {k: normalized(v, run, roots) for k, v in doc.items() if k not in VOLATILE}
    if isinstance(doc, list):
        return [normalized(v, run, roots) for v in doc]
    if isinstance(doc, str):
        for root in roots:
            doc = doc.replace(root, "<checkout>/")
        return doc.replace(run, "<run>")
    return doc


def differences(a: Path, b: Path, roots: list[str]) -> dict[str, list[str]]:
    """File name -> unified diff lines of the two runs' normalized documents (empty when the same)."""
    out = {}
    for name in FILES:
        sides = [json.dumps(normalized(json.loads((d / name).read_text(encoding="utf-8")), d.name, roots), indent=1,
                            sort_keys=True).splitlines() for d in (a, b)]
        out[name] = list(difflib.unified_diff(*sides, f"{a.name}/{name}", f"{b.name}/{name}", lineterm="", n=1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--root", action="append", default=[], help="another checkout whose folder the runs name "
                    "(this one's is always replaced)")
    args = ap.parse_args()
    roots = [str(Path(r).resolve()) + "/" for r in args.root] + [str(REPO) + "/"]
    found = differences(args.a, args.b, roots)
    for name, diff in found.items():
        print(f"{name}: {'identical' if not diff else f'{len(diff)} diff lines'}")
        print("\n".join(diff), end="\n" if diff else "")
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
