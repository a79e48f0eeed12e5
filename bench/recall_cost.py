"""What the recall grid costs a server: the old shape (one needle per haystack, sent as the release used to send it)
against the packed grid (a needle per depth in each haystack, one question per needle over the shared haystack,
paced by quantgate.recall.pace), both against ONE real vLLM server of the demo model in the same run.

    .venv/bin/python bench/recall_cost.py [--full] [--samples 2] [--old-concurrency 16] [--keep DIR]

Lengths 1024 and 2048 tokens by default (--full adds 4096, as releases/demo.yaml does), depths 0/25/50/75/100, the
four kinds. The old shape runs first through the eval client as the release ran it (concurrency 16, one 300 s
deadline per attempt, 32 answer tokens); then the packed grid through `quantgate.recall.run.run_recall`. For each it
prints requests, needles (paired observations), haystacks, prompt tokens sent (the server's own count), prompt
tokens the server computed (sent minus its prefix-cache hits, from /metrics), wall seconds, prefix-cache hit rate,
requests that failed for good and attempts sent again (after a timeout or a refusal); then the ratios packed / old and the recall check's minimum detectable
drop (default policy, 80% power, 10% of needles discordant) at each grid's n, with the CPU model. The machine may
be shared with other work: both grids run in the same minutes on the same server, so compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantgate.evals.client import ClientConfig, Request, run  # noqa: E402
from quantgate.gate.policy import load_policy  # noqa: E402
from quantgate.gate.sizing import recall_sizing  # noqa: E402
from quantgate.recall.run import build_checked_grid, prefix_cache_counters, read_jsonl, run_recall  # noqa: E402
from quantgate.serving.server import ServerConfig, VLLMServer  # noqa: E402
from quantgate.target.catalogue import ensure_demo_model  # noqa: E402

DEPTHS = [0, 25, 50, 75, 100]
KINDS = ["number", "name", "multilingual", "multi"]
POLICY = REPO / "releases" / "policies" / "default.yaml"


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "unknown")


def _usage(answers: list[dict]) -> dict:
    ok = [a for a in answers if a.get("error") is None]
    return {"sent": sum((a.get("usage") or {}).get("prompt_tokens", 0) for a in ok),
            "timeouts": sum(1 for a in answers if "no answer within" in (a.get("error") or "")),
            "resent": sum(max(0, int(a.get("attempts") or 1) - 1) for a in answers),
            "failed": sum(1 for a in answers if a.get("error") is not None)}


def old_shape(srv, model: Path, lengths: list[int], ctx: int, out: Path, concurrency: int) -> dict:
    """One needle per haystack, one per cell, sent through the eval client as the release used to send them."""
    prompts, _ = build_checked_grid(model, lengths, DEPTHS, KINDS, 1, seed=0, max_model_len=ctx, max_answer_tokens=32,
                                    ask="single")
    cfg = ClientConfig(endpoint=srv.base_url, model="demo", api_key=srv.api_key, concurrency=concurrency,
                       timeout_s=300.0, max_error_rate=1.0, progress=False)
    before, t0 = prefix_cache_counters(srv.base_url, srv.api_key), time.monotonic()
    run([Request(p.id, p.messages, 32) for p in prompts], out / "answers.jsonl", cfg)
    wall = time.monotonic() - t0
    after = prefix_cache_counters(srv.base_url, srv.api_key)
    u = _usage(read_jsonl(out / "answers.jsonl"))
    hits = after["hits"] - before["hits"] if before and after else None
    return {"grid": "old: one needle per haystack", "requests": len(prompts), "needles": len(prompts),
            "haystacks": len(prompts), "sent": u["sent"], "computed": u["sent"] - hits if hits is not None else None,
            "hit_rate": hits / (after["queries"] - before["queries"]) if hits is not None else None, "wall_s": wall,
            "timeouts": u["timeouts"], "resent": u["resent"], "failed": u["failed"], "design_effect": 1.0}


def packed(srv, model: Path, lengths: list[int], ctx: int, out: Path, samples: int, concurrency: int) -> dict:
    prompts, grid = build_checked_grid(model, lengths, DEPTHS, KINDS, samples, seed=0, max_model_len=ctx,
                                       max_answer_tokens=32, ask="turns")
    t0 = time.monotonic()
    cells = run_recall(prompts, out, endpoint=srv.endpoint, grid=grid,
                       concurrency=concurrency, log=lambda line: print("  " + line, flush=True))
    wall = time.monotonic() - t0
    c, r = cells.cost, cells.cost["run"]
    u = _usage(read_jsonl(out / "answers.jsonl"))
    hits = r["prefix_cache_hits"]
    clustered = cells.observations["recall_within_haystack"]
    return {"grid": f"packed: turns, {samples} haystacks per length and kind", "requests": c["requests"],
            "needles": c["needles"], "haystacks": c["haystacks"], "sent": u["sent"],
            "computed": u["sent"] - hits if hits is not None else None, "hit_rate": r["prefix_cache_hit_rate"],
            "wall_s": wall, "timeouts": u["timeouts"], "resent": u["resent"], "failed": u["failed"],
            "design_effect": clustered["design_effect"] or 1.0, "icc": clustered["icc"], "recall": cells.overall.recall,
            "most_in_flight": r.get("most_in_flight"), "rate": r.get("rate")}


def _row(r: dict) -> str:
    comp = "-" if r["computed"] is None else f"{int(r['computed']):,}"
    hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.0%}"
    return (f"| {r['grid']} | {r['requests']} | {r['needles']} | {r['haystacks']} | {r['sent']:,} | {comp} | "
            f"{r['wall_s']:.0f} | {hit} | {r['failed']} | {r['resent']} | {r['wall_s'] / r['needles']:.2f} |")


def report(old: dict, new: dict, cpu: str, full: bool) -> None:
    print(f"\nCPU: {cpu}; lengths {'1024/2048/4096' if full else '1024/2048'}, depths {DEPTHS}, kinds {KINDS}")
    print("| grid | requests | needles | haystacks | prompt tokens sent | computed | wall s | prefix-cache hits | "
          "failed | re-sent | wall s per needle |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(_row(old))
    print(_row(new))
    print(f"packed / old: wall {new['wall_s'] / old['wall_s']:.2f}x, prompt tokens computed "
          + (f"{new['computed'] / old['computed']:.2f}x" if new["computed"] and old["computed"] else "-")
          + f", wall per needle {(new['wall_s'] / new['needles']) / (old['wall_s'] / old['needles']):.2f}x, "
          f"needles {new['needles'] / old['needles']:.1f}x")
    policy = load_policy(POLICY)
    n_other = len(policy.primary.metrics) + len(policy.categories) + 1 if policy.primary else 1
    rows = [("old", old["needles"], 1.0), ("packed, needles independent", new["needles"], 1.0),
            (f"packed, design effect {new['design_effect']:.2f} (ICC {new['icc']}) of the recall outcomes within "
             "length and kind",
             new["needles"], new["design_effect"])]
    for name, n, deff in rows:
        s = recall_sizing(policy, n, other_checks=n_other, design_effect=deff)
        print(f"recall check MDD, {name}: n={n}: {s.mdd:.1%} absolute (limit {s.limit:.0%}; {n_other} task checks "
              f"share the non-pooled budget)")
    print(f"packed run: recall {new['recall']:.3f}, at most {new['most_in_flight']} requests in flight, "
          f"measured {new['rate'] or 0:.0f} prompt tokens per busy second")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="add the 4096-token length")
    ap.add_argument("--samples", type=int, default=2, help="haystacks per length and kind in the packed grid")
    ap.add_argument("--old-concurrency", type=int, default=16, help="the release's eval concurrency (old client)")
    ap.add_argument("--concurrency", type=int, default=8, help="most requests in flight for the packed grid")
    ap.add_argument("--keep", type=Path, help="folder for the answers (default: a temporary one)")
    args = ap.parse_args()
    lengths = [1024, 2048, 4096] if args.full else [1024, 2048]
    ctx = max(lengths) + 512
    model = ensure_demo_model()
    work = args.keep or Path(tempfile.mkdtemp(prefix="recall-cost-"))
    cfg = ServerConfig(model=model, name="demo", args=["--enforce-eager", "--dtype", "float32", "--max-model-len", str(ctx)],
                       env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    with VLLMServer(cfg, log_path=work / "server.log") as srv:
        print(f"server up ({srv.base_url}); old shape first; load average {os.getloadavg()[0]:.1f}", flush=True)
        old = old_shape(srv, model, lengths, ctx, work / "old", args.old_concurrency)
        print(f"old shape: {old['wall_s']:.0f} s; packed grid next; load average {os.getloadavg()[0]:.1f}", flush=True)
        new = packed(srv, model, lengths, ctx, work / "packed", args.samples, args.concurrency)
        print(f"packed grid: {new['wall_s']:.0f} s; load average {os.getloadavg()[0]:.1f}", flush=True)
    report(old, new, cpu_model(), args.full)
    (work / "recall_cost.json").write_text(json.dumps({"old": old, "packed": new}, indent=1))
    print(f"answers and figures in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
