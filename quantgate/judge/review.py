"""Human review of judged pairs: export a blinded, stratified sample (CSV + self-contained HTML form), import the
filled CSV, and compute the human win rate and human-judge agreement.

Blinding: reviewers see `review_id`, the request, the reference and answers A and B; which of A/B is the baseline is
drawn per row from a seeded generator and written only to the key file (JSON, kept apart: by default in the judge
directory, not beside the CSV). Identical answers are left out unless asked for: a reviewer learns nothing from them.
The key and the imported result (human.json) are written and read through quantgate.judge.reviewfile's models.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from quantgate.base.runfiles import HUMAN_REVIEW, JUDGE_REPORT, REVIEW_KEY
from quantgate.base.errors import QuantgateError
from quantgate.base.fileio import write_json
from quantgate.base.typedfile import field_path
from quantgate.base.yamlconfig import read_text
from quantgate.judge.core import wilson
from quantgate.judge.report import render_markdown
from quantgate.judge.reportfile import Rate, load_judge_report
from quantgate.judge.reviewfile import HumanJudgeAgreement, HumanRates, HumanReview, ReviewItem, ReviewKey

COLUMNS = ["review_id", "category", "question", "reference", "answer_a", "answer_b", "choice", "comment"]
CHOICES = ("A", "B", "TIE")
MIN_PAIRS = 50
MAX_PROBLEMS_SHOWN = 30
KEY_FILE = REVIEW_KEY  # the key's default place: in the judge directory


def allocate(sizes: dict[str, int], n: int) -> dict[str, int]:
    """Split n over categories in proportion to their sizes (largest remainder), never more than a category has."""
    total = sum(sizes.values())
    if n >= total:
        return dict(sizes)
    exact = {c: n * s / total for c, s in sizes.items()}
    got = {c: int(x) for c, x in exact.items()}
    for c in sorted(sizes, key=lambda c: (-(exact[c] - got[c]), c)):
        if sum(got.values()) >= n:
            break
        if got[c] < sizes[c]:
            got[c] += 1
    return got


def select_pairs(pairs: Sequence[dict], n: int, seed: int, *, include_identical: bool = False) -> list[dict]:
    pool = [p for p in pairs if include_identical or p["baseline"].strip() != p["candidate"].strip()]
    if len(pool) < n:
        raise QuantgateError(f"only {len(pool)} pairs with differing answers, {n} asked for",
                             where="review export", fix="ask for fewer pairs (`n`), or include identical pairs (`include_identical`)")
    by_cat: dict[str, list[dict]] = {}
    for p in pool:
        by_cat.setdefault(p["category"], []).append(p)
    rng = random.Random(seed)
    chosen = []
    for cat, k in sorted(allocate({c: len(v) for c, v in by_cat.items()}, n).items()):
        chosen += rng.sample(sorted(by_cat[cat], key=lambda p: p["id"]), k)
    rng.shuffle(chosen)
    return chosen


def blind(chosen: Sequence[dict], seed: int) -> tuple[list[dict], ReviewKey]:
    """(CSV rows, key). The key maps review_id -> pair id and which side answer A is."""
    rng = random.Random(f"blind:{seed}")
    rows, items = [], {}
    for i, p in enumerate(chosen, start=1):
        rid = f"R{i:03d}"
        a_side = rng.choice(["baseline", "candidate"])
        b_side = "candidate" if a_side == "baseline" else "baseline"
        rows.append({"review_id": rid, "category": p["category"], "question": p["question"],
                     "reference": p.get("reference") or "", "answer_a": p[a_side], "answer_b": p[b_side],
                     "choice": "", "comment": ""})
        items[rid] = ReviewItem(pair_id=p["id"], a=a_side)
    return rows, ReviewKey(schema=1, seed=seed, items=items)


def to_csv(rows: Sequence[dict]) -> str:
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def to_html(rows: Sequence[dict], title: str = "quantgate human review") -> str:
    """A self-contained form (no network): pick A, B or TIE per item, then download the filled CSV."""
    data = json.dumps(list(rows), ensure_ascii=False).replace("</", "<\\/")
    template = (Path(__file__).with_name("review_form.html")).read_text(encoding="utf-8")
    return template.replace("__TITLE__", title).replace("__ROWS__", data).replace("__COLUMNS__", json.dumps(COLUMNS))


def parse_filled(text: str, key: ReviewKey | None, source: str) -> tuple[dict[str, str], int, int]:
    """review_id -> choice ('A'/'B'/'TIE') from a filled CSV; (choices, blank rows, rows). Every bad row is reported
    with its CSV line (the line where the row starts). Without a key review ids are not matched against one."""
    problems: list[str] = []
    rdr = csv.reader(io.StringIO(text.lstrip("\ufeff"), newline=""))
    try:
        header = [h.strip() for h in next(rdr)]
    except StopIteration:
        raise QuantgateError("the CSV is empty", where=f"{source}:1", fix="export again with `quantgate review export`") from None
    missing = [c for c in ("review_id", "choice") if c not in header]
    if missing:
        raise QuantgateError(f"missing column(s) {', '.join(missing)}; header is {header}", where=f"{source}:1",
                             fix="keep the header row of the exported CSV")
    idx_id, idx_choice = header.index("review_id"), header.index("choice")
    choices: dict[str, str] = {}
    first_line: dict[str, int] = {}
    blank = rows = 0
    while True:
        start = rdr.line_num + 1
        try:
            row = next(rdr)
        except StopIteration:
            break
        except csv.Error as exc:
            problems.append(f"{source}:{start}: unreadable CSV row: {exc}")
            break
        if not any(cell.strip() for cell in row):
            continue
        rows += 1
        if len(row) != len(header):
            problems.append(f"{source}:{start}: {len(row)} fields, the header has {len(header)}")
            continue
        rid, choice = row[idx_id].strip(), row[idx_choice].strip().upper()
        if key is not None and rid not in key.items:
            problems.append(f"{source}:{start}: unknown review_id {rid!r} (not in the key)")
            continue
        if rid in first_line:
            problems.append(f"{source}:{start}: duplicate review_id {rid!r} (first at line {first_line[rid]})")
            continue
        first_line[rid] = start
        if not choice:
            blank += 1
        elif choice not in CHOICES:
            problems.append(f"{source}:{start}: invalid choice {row[idx_choice].strip()!r} for {rid}; "
                            "write A, B or TIE (or leave it blank)")
        else:
            choices[rid] = choice
    if problems:
        shown = problems[:MAX_PROBLEMS_SHOWN] + ([f"... and {len(problems) - MAX_PROBLEMS_SHOWN} more"]
                                                 if len(problems) > MAX_PROBLEMS_SHOWN else [])
        line, msg = problems[0][len(source):].split(": ", 1)  # problems read "<source>:<line>: <message>"
        where = source + line
        raise QuantgateError(f"{len(problems)} bad row(s) in the review CSV: {msg}" + "".join(f"\n  {p}" for p in shown[1:]),
                             where=where, fix="correct the rows named above and import again")
    if not choices:
        raise QuantgateError("no row has a choice", where=source, fix="fill the 'choice' column with A, B or TIE")
    return choices, blank, rows


def read_csv(path: Path | str) -> str:
    """A review CSV's text: UTF-8 (a byte-order mark and CRLF accepted); a byte that is not UTF-8 names its line."""
    return read_text(path)


def key_path_for(path: Path | str) -> Path:
    """A key file, or the judge directory holding one (`review_key.json`)."""
    path = Path(path)
    return path / KEY_FILE if path.is_dir() else path


def load_key(path: Path | str) -> ReviewKey:
    """The review key (`export_review`'s JSON: review_id -> pair id and the side shown as A), or a QuantgateError
    naming the file, line and field. `path` may be the judge directory that holds it."""
    path = key_path_for(path)
    fix = "give the key written by `quantgate review export` (by default <judge-dir>/review_key.json)"
    if not path.is_file():
        raise QuantgateError("review key not found", where=str(path), fix=fix)
    text = read_text(path)
    try:
        key = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QuantgateError(f"the review key is not JSON: {exc.msg} (column {exc.colno})",
                             where=f"{path}:{exc.lineno}", fix=fix) from None
    except (RecursionError, ValueError) as exc:  # the parser's limits: nesting, digits
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split("; use sys.", 1)[0]
        raise QuantgateError(f"the review key cannot be read: {why}", where=str(path), fix=fix) from None
    items = key.get("items") if isinstance(key, dict) else None
    if not isinstance(items, dict) or not items:
        raise QuantgateError("not a review key: no 'items' mapping of review ids", where=f"{path} field 'items'",
                             fix=fix)
    try:
        return ReviewKey.model_validate(key)
    except ValidationError as exc:  # the first bad item (in the file's order), else the first bad field
        err = next((e for e in exc.errors() if e["loc"][:1] == ("items",)), exc.errors()[0])
        if err["loc"][:1] == ("items",) and len(err["loc"]) > 1:
            rid = str(err["loc"][1])
            raise QuantgateError(f"review id {rid!r}: expected {{pair_id: TEXT, a: baseline|candidate}}, "
                                 f"got {items[rid]!r:.80}", where=f"{path} field 'items.{rid}'", fix=fix) from None
        field = field_path(err["loc"])
        raise QuantgateError(f"unexpected content in the review key's field {field}: {err['msg']}",
                             where=f"{path} field '{field}'", fix=fix) from None


def check_csv(path: Path | str, key: ReviewKey | None = None) -> int:
    """Validate a filled review CSV as `import_review` would: with its `key` (`load_key`), review ids not in it are
    refused at their line; without one they are not matched. The number of rows."""
    return parse_filled(read_csv(path), key, str(path))[2]


def unblind(choices: dict[str, str], key: ReviewKey) -> dict[str, str]:
    """pair_id -> 'candidate' | 'baseline' | 'tie' (who the reviewer preferred)."""
    out = {}
    for rid, c in choices.items():
        item = key.items[rid]
        if c == "TIE":
            out[item.pair_id] = "tie"
        else:
            a = item.a
            out[item.pair_id] = a if c == "A" else ("candidate" if a == "baseline" else "baseline")
    return out


def human_summary(prefs: dict[str, str], judge_winners: dict[str, str | None], *, n_exported: int,
                  n_blank: int) -> HumanReview:
    """Human win/tie/loss rates (candidate's view) and agreement with the judge's combined verdicts."""
    n = len(prefs)
    count = Counter(prefs.values())
    rates = {}
    for name, side in (("win", "candidate"), ("tie", "tie"), ("loss", "baseline")):
        lo, hi = wilson(count[side], n)
        rates[name] = Rate(count=count[side], rate=count[side] / n if n else float("nan"), ci_low=lo, ci_high=hi)
    as_judge = {"candidate": "second", "baseline": "first", "tie": "tie"}
    both = [(as_judge[h], judge_winners[p]) for p, h in prefs.items() if judge_winners.get(p) is not None]
    agree = sum(h == j for h, j in both)
    lo, hi = wilson(agree, len(both))
    return HumanReview(n_exported=n_exported, n_reviewed=n, n_blank=n_blank, rates=HumanRates(**rates),
                       agreement=HumanJudgeAgreement(n=len(both), agree=agree,
                                                     rate=agree / len(both) if both else float("nan"),
                                                     ci_low=lo, ci_high=hi))


# --- files -----------------------------------------------------------------------------------------------

def export_review(judge_dir: Path | str, out: Path | str, *, n: int = MIN_PAIRS, seed: int = 0,
                  key_path: Path | str | None = None, include_identical: bool = False) -> dict[str, Path]:
    judge_dir, out = Path(judge_dir), Path(out)
    pairs_path = judge_dir / "pairs.jsonl"
    if not pairs_path.is_file():
        raise QuantgateError("missing file", where=str(pairs_path), fix="give a directory written by `quantgate judge`")
    pairs = [json.loads(line) for line in pairs_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows, key = blind(select_pairs(pairs, n, seed, include_identical=include_identical), seed)
    key = key.model_copy(update={"pairs_sha256": hashlib.sha256(pairs_path.read_bytes()).hexdigest()})
    out.mkdir(parents=True, exist_ok=True)
    key_path = Path(key_path) if key_path else judge_dir / KEY_FILE
    paths = {"csv": out / "review.csv", "html": out / "review.html", "key": key_path}
    paths["csv"].write_text(to_csv(rows), encoding="utf-8")
    paths["html"].write_text(to_html(rows), encoding="utf-8")
    key_path.parent.mkdir(parents=True, exist_ok=True)
    key.write(key_path)
    return paths


def import_review(judge_dir: Path | str, csv_path: Path | str, key_path: Path | str | None = None) -> dict:
    """Read a filled CSV, write human.json into the judge directory and add the human section to its report.
    Returns human.json's content as a dict (HumanReview.dump: what the CLI prints and report.json's `human` holds)."""
    judge_dir, csv_path = Path(judge_dir), Path(csv_path)
    key_path = Path(key_path) if key_path else judge_dir / KEY_FILE
    for p, fix in ((csv_path, "give the filled CSV"), (key_path, "give the key written by `quantgate review export`"),
                   (judge_dir / JUDGE_REPORT, "give a directory written by `quantgate judge`")):
        if not p.is_file():
            raise QuantgateError("file not found", where=str(p), fix=fix)
    key = load_key(key_path)
    report = load_judge_report(judge_dir / JUDGE_REPORT)
    choices, blank, _ = parse_filled(read_csv(csv_path), key, str(csv_path))
    human = human_summary(unblind(choices, key), report.comparison.winners, n_exported=len(key.items), n_blank=blank)
    human.write(judge_dir / HUMAN_REVIEW)
    report.human = written = human.dump()
    write_json(judge_dir / JUDGE_REPORT, report.to_file())
    (judge_dir / "report.md").write_text(render_markdown(report), encoding="utf-8")
    return written
