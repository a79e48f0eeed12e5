"""The names of the files quantgate writes, in one place: every writer and reader uses these constants.

A release's run folder (`results/runs/<run-id>/`):

    run.json               the spec as run, its file, git commit, package versions, and what the machine resolved
                           for it with the reasons (base.runinfo, versioned)
    timings.json           one row per step: start, seconds, status, slot                 (release.runrecord)
    status.json            completed, failed (step, root cause, log) or interrupted (base.runstatus)
    status.json.lock       held by the release's process until status.json is written (base.runstatus.owner_gone)
    summary.json           the release's outcome: decision, candidates, figures, paths    (release.steps)
    decision.json          the gate: one decision per candidate, each check's evidence   (gate.evidence)
    decision.junit.xml     the same decision as JUnit test cases, for CI systems
    publish.json           where promoted entries were published, and how it went
    notify.json            the webhooks told of the decision, and how it went
    fidelity/floor.json    the baseline against itself on a subset: the fidelity noise floor
    schemes_auto.json      `schemes: auto` ranked again at flow start, and what it picked  (release.autoschemes)
    report.html/report.md  the report for people                                           (report)
    <variant>/plan.json        the variant's serving plan; server.log its server's log
    <variant>/evidence.json    what was measured and where the results are (cache folders)
    <variant>/error.json       why its server could not start or died (phase, log tail)   (gate.failurefile)
    <variant>/quantization.json  the quantize manifest of a candidate
    <variant>/checkpoint.json  a `candidates:` checkpoint folder and what its config.json said (release.variants)
    <variant>/promotion.json   its registry entry (or why an endpoint has none), once promoted
    compare/<candidate>.json   the paired comparison with the baseline                       (evals.compare)
    <candidate>/judge/report.json  the LLM judge's calibration and comparison                (judge.run)
    <candidate>/judge/human.json   the blinded human review's verdicts, beside review_key.json

Every file here is written and read through one pydantic model, in the package that owns it (the writer's fields in
the file's order; a newer writer's keys are kept): run.json base.runinfo.RunRecord and evidence.json
release.variants.Evidence (versioned, with migrations: base.typedfile.read_migrated), timings.json
release.runrecord, status.json base.runstatus, summary.json gate.summaryfile, decision.json gate.decisionfile,
error.json gate.failurefile.CandidateError, checkpoint.json release.variants.CheckpointRecord, schemes_auto.json
release.autoschemes.AutoSchemesRecord, quantization.json quantize.manifest.QuantManifest, promotion.json
release.registryfile (PromotedEntry or NoEntry), publish.json release.publishing.PublishLog, notify.json
release.webhook.NotifyLog, fidelity/*.json fidelity.record.FidelityRecord, compare/*.json evals.comparefile, the
judge's report.json, manifest.json, human.json and review_key.json judge.reportfile, judge.manifestfile and
judge.reviewfile. In a cache folder: an eval run's manifest.json evals.manifestfile, cells.json and delta.json
recall.resultfile, parity.json parity.engine.ParityRecord, perf.json perf.models.PerfResult, pay_off.json
perf.payofffile, a fidelity dump's manifest.json fidelity.run.DumpManifest and a samples folder's
fidelity.sampling.SamplesManifest. Readers that must refuse a bad file use base.typedfile.read_model (the file and
the first field that failed); the report reads leniently, to show what an older or broken run still has.

A measured variant's cache folder (`results/cache/variants/<key>/`) holds what the run folder points at:
eval runs (`manifest.json`, `results.jsonl`, `scores.jsonl`), the recall run (`requests.jsonl`, `cells.json`, and
for a candidate `delta.json`), `parity.json`, the perf probe (`perf.json`, `pay_off.json`) and fidelity dumps.
"""

from __future__ import annotations

# run folder
RUN = "run.json"
TIMINGS = "timings.json"
STATUS = "status.json"
SUMMARY = "summary.json"
DECISION = "decision.json"
DECISION_JUNIT = "decision.junit.xml"
PUBLISH = "publish.json"
NOTIFY = "notify.json"
FIDELITY_FLOOR = "fidelity/floor.json"
REPORT_HTML = "report.html"
REPORT_MD = "report.md"
SCHEMES_AUTO = "schemes_auto.json"
# per variant
PLAN = "plan.json"
EVIDENCE = "evidence.json"
ERROR = "error.json"
QUANTIZATION = "quantization.json"
PROMOTION = "promotion.json"
CHECKPOINT = "checkpoint.json"
REPAIR = "repair.json"
COMPARE_DIR = "compare"
JUDGE_DIR = "judge"
# result folders (eval, recall, judge, perf, parity)
MANIFEST = "manifest.json"
RESULTS = "results.jsonl"
SCORES = "scores.jsonl"
REQUESTS = "requests.jsonl"
CELLS = "cells.json"
DELTA = "delta.json"
JUDGE_REPORT = "report.json"
HUMAN_REVIEW = "human.json"
REVIEW_KEY = "review_key.json"
PARITY = "parity.json"
PERF = "perf.json"
PAY_OFF = "pay_off.json"
