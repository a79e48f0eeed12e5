"""The gate's decision as JUnit XML (`<run>/decision.junit.xml`), so that CI systems show the checks natively.

One <testsuite> per candidate, named after it, with its decision, scheme, family and policy as properties; one
<testcase> per gate check (classname `quantgate.<candidate>`, name the check's name) plus a `decision` testcase:
- a check that failed (harm detected) is a <failure> whose message is the check's reason and whose text gives the
  measured value, limit, bound and evidence file; the decision testcase fails when the candidate is REJECTed;
- a check that is inconclusive is a <failure type="inconclusive"> with "inconclusive: REASON", and so is the
  decision testcase of an INCONCLUSIVE candidate, with what it needs: nothing was promoted, and CI must show it
  (`inconclusive="skipped"`, the spec's `junit_inconclusive: skipped` or `quantgate gate --junit-inconclusive
  skipped`, renders them <skipped> instead); a check that is not applicable (skipped) is <skipped> with
  "not applicable: REASON";
- a check that passed carries its figures in <system-out>.
A ladder's schemes that were never tried get a testsuite with one skipped testcase saying why.

`render_junit(decision_doc)` is pure (xml.etree); `write_junit(decision_path)` reads decision.json and writes the XML
next to it (decision.json -> decision.junit.xml). The release writes it after every gate, and so does `quantgate gate`.
The exit code of both stays the branch point: 0 PROMOTE, 3 REJECT, 4 INCONCLUSIVE.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from quantgate.base.fileio import write_text

JUNIT_SUFFIX = ".junit.xml"
Inconclusive = Literal["failure", "skipped"]  # how an inconclusive check or decision is rendered


def _figures(c: Mapping[str, Any]) -> str:
    parts = [f"{k}: {c.get(k)}" for k in ("measured", "limit", "bound", "required") if c.get(k) is not None]
    return "\n".join([*parts, f"evidence: {c['evidence_file']}" if c.get("evidence_file") else ""]).strip()


def _outcome(c: Mapping[str, Any]) -> str:
    if c.get("outcome"):
        return str(c["outcome"])
    return {True: "pass", False: "fail", None: "skipped"}.get(c.get("passed"), "skipped")


def _case(suite: ET.Element, cls: str, name: str, outcome: str, reason: str, text: str, *,
          skip_as: str | None = None, inconclusive: Inconclusive = "failure") -> str:
    """One testcase; returns how it counts: "fail" (a failure element), "skipped" or "inconclusive" (a skipped
    element), "pass"."""
    case = ET.SubElement(suite, "testcase", classname=cls, name=name, time="0")
    if outcome == "fail":
        ET.SubElement(case, "failure", message=reason or "failed", type="fail").text = text or reason
    elif outcome == "inconclusive" and inconclusive == "failure":
        ET.SubElement(case, "failure", message=f"inconclusive: {reason}" if reason else "inconclusive",
                      type="inconclusive").text = text or reason
        return "fail"
    elif outcome in ("inconclusive", "skipped"):
        why = skip_as or ("inconclusive" if outcome == "inconclusive" else "not applicable")
        ET.SubElement(case, "skipped", message=f"{why}: {reason}" if reason else why)
    elif text:
        ET.SubElement(case, "system-out").text = text
    return outcome


def _suite(root: ET.Element, name: str, d: Mapping[str, Any], inconclusive: Inconclusive) -> list[str]:
    suite = ET.SubElement(root, "testsuite", name=name)
    props = ET.SubElement(suite, "properties")
    policy = d.get("policy") or {}
    for key, value in (("decision", d.get("decision")), ("scheme", d.get("scheme")), ("family", d.get("family")),
                       ("policy", " ".join(str(policy[k]) for k in ("name", "version") if k in policy))):
        if value:
            ET.SubElement(props, "property", name=key, value=str(value))
    cls = f"quantgate.{name}"
    outcomes = [_case(suite, cls, str(c.get("name")), _outcome(c), str(c.get("reason") or ""), _figures(c),
                      inconclusive=inconclusive) for c in d.get("checks") or []]
    verdict = d.get("decision")
    reasons = "; ".join(map(str, d.get("reasons") or []))
    decided = {"PROMOTE": "pass", "REJECT": "fail", "INCONCLUSIVE": "inconclusive"}.get(str(verdict), "fail")
    why = reasons + (f" (needs {d['needs']})" if d.get("needs") else "")
    outcomes.append(_case(suite, cls, "decision", decided, why or str(verdict), f"decision: {verdict}",
                          inconclusive=inconclusive))
    _count(suite, outcomes)
    return outcomes


def _count(el: ET.Element, outcomes: list[str]) -> None:
    el.set("tests", str(len(outcomes)))
    el.set("failures", str(outcomes.count("fail")))
    el.set("errors", "0")
    el.set("skipped", str(sum(o in ("inconclusive", "skipped") for o in outcomes)))


def render_junit(doc: Mapping[str, Any], inconclusive: Inconclusive = "failure") -> str:
    """decision.json's document -> JUnit XML text (module docstring)."""
    run = Path(str(doc.get("run") or "run")).name
    root = ET.Element("testsuites", name=f"quantgate gate {run}")
    outcomes: list[str] = []
    for name, d in (doc.get("candidates") or {}).items():
        outcomes += _suite(root, str(name), d, inconclusive)
    for rung in doc.get("ladder") or []:
        if rung.get("status") not in ("PROMOTE", "REJECT", "INCONCLUSIVE"):
            suite = ET.SubElement(root, "testsuite", name=str(rung.get("scheme")))
            reason = "; ".join(map(str, rung.get("reasons") or [])) or "not tried"
            got = [_case(suite, f"quantgate.{rung.get('scheme')}", "decision", "skipped", reason, "",
                         skip_as=str(rung.get("status")))]
            _count(suite, got)
            outcomes += got
    _count(root, outcomes)
    root.attrib.pop("errors", None)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def junit_path(decision_path: Path | str) -> Path:
    p = Path(decision_path)
    return p.with_name(p.name.removesuffix(".json") + JUNIT_SUFFIX)


def write_junit(decision_path: Path | str, inconclusive: Inconclusive = "failure") -> Path:
    """Read a decision.json and write its JUnit XML next to it; returns the XML's path."""
    doc = json.loads(Path(decision_path).read_text(encoding="utf-8"))
    out = junit_path(decision_path)
    write_text(out, render_junit(doc, inconclusive))
    return out
