"""Serving knobs in the release spec and `quantgate plan` (quantgate.plan.knobs): checked against the hardware
profile with field and line, fed into the plan's capacity math and vLLM command, refused in serving.extra_args, and
a changed KV cache dtype making the gate's recall check required. The slow test serves the demo model with a
spec's scheduler and prefix-cache settings and reads them back from vLLM's own log."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from quantgate.base.errors import ConfigError
from quantgate.cli.main import user_error
from quantgate.gate.checks import evaluate
from quantgate.gate.evidence import kv_cache_change
from quantgate.gate.models import GateEvidence, KvCacheChange, RateEvidence, PairedStat
from quantgate.gate.policy import GatePolicy
from quantgate.plan.build import build_plan, load_planner_policy
from quantgate.plan.knobs import ServingKnobs, knob_arg, knob_problems
from quantgate.spec.resolve import load_spec
from quantgate.spec.sections import ServingSpec
from quantgate.release.variants import Variant, server_config
from quantgate.target.hardware import get_profile

DATA = Path(__file__).parent / "data"
DEMO = DATA / "model_configs" / "smollm2-135m.json"
M8B = DATA / "model_shapes" / "dense-8b-fp8.yaml"


# ---- the knobs against a profile (pure) ------------------------------------------------------------------

PROBLEMS = [
    # (hardware, knobs, concurrency, the field refused, or None)
    ("h100", dict(kv_cache_dtype="fp8"), 8, None),
    ("h100", dict(kv_cache_dtype="fp8_e5m2"), 8, None),
    ("mi300x", dict(kv_cache_dtype="fp8_e5m2"), 8, "kv_cache_dtype"),   # ROCm: fp8 = e4m3 only
    ("a100", dict(kv_cache_dtype="fp8"), 8, "kv_cache_dtype"),         # no FP8 on Ampere
    ("x86-cpu", dict(kv_cache_dtype="fp8"), 8, "kv_cache_dtype"),
    ("x86-cpu", dict(gpu_memory_utilization=0.5), 8, "gpu_memory_utilization"),
    ("h100", dict(gpu_memory_utilization=0.5), 8, None),
    ("x86-cpu", dict(cudagraph_mode="FULL"), 8, "cudagraph_mode"),
    ("h100", dict(cudagraph_mode="FULL", enforce_eager=True), 8, "cudagraph_mode"),
    ("h100", dict(cudagraph_mode="NONE", enforce_eager=True), 8, None),
    ("x86-cpu", dict(enforce_eager=False), 8, None),
    ("x86-cpu", dict(max_num_seqs=4), 8, "max_num_seqs"),
    ("x86-cpu", dict(max_num_seqs=8), 8, None),
    ("x86-cpu", dict(max_num_seqs=16, max_num_batched_tokens=8), 8, "max_num_batched_tokens"),
    ("x86-cpu", dict(max_num_batched_tokens=64), 8, "max_num_batched_tokens"),  # below vLLM's CPU default of seqs
    ("x86-cpu", dict(max_num_batched_tokens=load_planner_policy().vllm_max_num_seqs["cpu"]), 8, None),
    ("x86-cpu", dict(enable_prefix_caching=False), 8, None),
]


@pytest.mark.parametrize("hw,knobs,concurrency,refused", PROBLEMS, ids=[f"{p[0]}-{p[1]}" for p in PROBLEMS])
def test_knob_problems_table(hw, knobs, concurrency, refused):
    profile = get_profile(hw)
    found = knob_problems(ServingKnobs(**knobs), profile, concurrency, load_planner_policy().vllm_max_num_seqs[profile.kind])
    assert [f for f, _ in found][:1] == ([refused] if refused else [])
    if refused == "kv_cache_dtype":  # the reason names what the profile does list
        assert ", ".join(get_profile(hw).kv_cache_dtypes) in found[0][1]


@pytest.mark.parametrize("arg,field", [
    ("--kv-cache-dtype=fp8", "kv_cache_dtype"), ("--max_num_seqs", "max_num_seqs"), ("--max-num-batched", "max_num_batched_tokens"),
    ("--no-enable-prefix-caching", "enable_prefix_caching"), ("--enable-prefix-caching", "enable_prefix_caching"),
    ("--enforce-eager", "enforce_eager"), ("-O3", "enforce_eager"), ("--gpu-memory-utilization", "gpu_memory_utilization"),
    ("-cc.cudagraph_mode=FULL", "cudagraph_mode"), ("--compilation-config.cudagraph_mode=FULL", "cudagraph_mode"),
    ("-cc", "cudagraph_mode"), ("--block-size", None), ("--max-model-len", None), ("-q", None), ("fp8", None),
])
def test_knob_flags_are_managed_in_extra_args(arg, field):
    why = knob_arg(arg)
    assert (why is None) == (field is None)
    if field:
        assert f"serving.{field}" in why
        with pytest.raises(ValueError, match=f"serving.{field}"):
            ServingSpec(extra_args=["--seed", "1", arg])


# ---- the spec: field and line ----------------------------------------------------------------------------

SPEC = """version: 1
name: knobs
model: demo
hardware: {hardware}
concurrency: 8
schemes: [{scheme}]
eval_sets: []
serving:
  max_num_seqs: 16
  kv_cache_dtype: {kv}
"""


def write_spec(tmp_path: Path, hardware: str = "h100", scheme: str = "fp8-dynamic", kv: str = "fp8", tail: str = "") -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC.format(hardware=hardware, scheme=scheme, kv=kv) + tail, encoding="utf-8")
    return path


def test_spec_takes_fp8_kv_on_h100(tmp_path):
    spec = load_spec(write_spec(tmp_path))
    assert spec.serving.kv_cache_dtype == "fp8" and spec.serving.max_num_seqs == 16


def test_spec_refuses_fp8_kv_on_cpu_at_its_line(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_spec(write_spec(tmp_path, hardware="x86-cpu", scheme="int8-w8a8"))
    assert exc.value.where.endswith("spec.yaml:10 field 'serving.kv_cache_dtype'"), exc.value.where
    assert "x86-cpu" in exc.value.message and "auto" in exc.value.message


def test_spec_refuses_max_num_seqs_below_concurrency_at_its_line(tmp_path):
    path = write_spec(tmp_path, kv="auto")
    path.write_text(path.read_text().replace("max_num_seqs: 16", "max_num_seqs: 4"))
    with pytest.raises(ConfigError) as exc:
        load_spec(path)
    assert exc.value.where.endswith(":9 field 'serving.max_num_seqs'") and "concurrency 8" in exc.value.message


def test_spec_refuses_fp8_kv_without_recall(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_spec(write_spec(tmp_path, tail="recall: null\n"))
    assert "serving.kv_cache_dtype" in exc.value.where and "recall" in exc.value.message


def test_spec_notes_prefix_caching_off_under_a_shared_haystack_grid(tmp_path):
    path = write_spec(tmp_path, kv="auto", tail="  enable_prefix_caching: false\n")
    assert any("enable_prefix_caching is false" in n for n in load_spec(path).machine_notes)


def test_repository_specs_with_knobs_pass_the_check():
    """The spec under tests/data that uses every knob a CPU profile takes loads (`quantgate release --check`)."""
    spec = load_spec(DATA / "release_knobs.yaml")
    s = spec.serving
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.enable_prefix_caching, s.enforce_eager) == (16, 4096, True, True)


# ---- the plan: capacity and command -----------------------------------------------------------------------

def test_fp8_kv_halves_kv_bytes_and_grows_the_pool_in_tokens():
    auto = build_plan(M8B, "h100", context=8192, concurrency=8, replicas=1, gpus=1)
    fp8 = build_plan(M8B, "h100", context=8192, concurrency=8, replicas=1, gpus=1, kv_dtype="fp8")
    assert fp8.capacity.kv_bytes_per_token * 2 == auto.capacity.kv_bytes_per_token
    assert fp8.capacity.kv_tokens_per_replica == pytest.approx(2 * auto.capacity.kv_tokens_per_replica, rel=1e-6)
    assert fp8.vllm_args["--kv-cache-dtype"] == "fp8"


def test_memory_utilization_shrinks_the_pool_and_reaches_the_command():
    default = build_plan(M8B, "h100", context=8192, concurrency=8, replicas=1, gpus=1)
    low = build_plan(M8B, "h100", context=8192, concurrency=8, replicas=1, gpu_memory_utilization=0.5, gpus=1)
    drop = (load_planner_policy().gpu_memory_utilization - 0.5) * get_profile("h100").memory_gib
    assert default.capacity.kv_pool_gib_per_device - low.capacity.kv_pool_gib_per_device == pytest.approx(drop, abs=0.02)
    assert low.vllm_args["--gpu-memory-utilization"] == 0.5


def test_scheduler_prefix_and_compile_knobs_reach_the_command():
    p = build_plan(M8B, "h100", context=8192, concurrency=8, max_num_seqs=32, max_num_batched_tokens=4096,
                   enable_prefix_caching=False, enforce_eager=False, cudagraph_mode="PIECEWISE")
    a = p.vllm_args
    assert (a["--max-num-seqs"], a["--max-num-batched-tokens"], a["--no-enable-prefix-caching"]) == (32, 4096, True)
    assert a["--compilation-config"] == '{"cudagraph_mode": "PIECEWISE"}' and "--enforce-eager" not in a
    sched = next(d for d in p.decisions if d.topic == "scheduler")
    assert sched.numbers["max_num_seqs"] == 32 and not p.warnings


def test_max_num_seqs_below_concurrency_is_a_plan_warning():
    p = build_plan(DEMO, "x86-cpu", context=2048, concurrency=8, max_num_seqs=4)
    assert any("max_num_seqs 4 is below the target concurrency 8" in w for w in p.warnings)


def test_cpu_compiled_on_request_and_eager_refused_with_pp():
    compiled = build_plan(DEMO, "x86-cpu", context=2048, concurrency=8, enforce_eager=False)
    assert "--enforce-eager" not in compiled.vllm_args and compiled.layout.pp == 1
    with pytest.raises(ConfigError, match="PP=2 in eager mode crashed"):
        build_plan(DEMO, "x86-cpu", context=2048, concurrency=8, replicas=1, enforce_eager=True)


def test_plan_refuses_gpu_knobs_on_cpu_naming_the_field_or_the_flag():
    with pytest.raises(ConfigError) as exc:
        build_plan(DEMO, "x86-cpu", context=2048, concurrency=8, gpu_memory_utilization=0.5)
    assert exc.value.where == "serving.gpu_memory_utilization" and "VLLM_CPU_KVCACHE_SPACE" in exc.value.message
    assert user_error(exc.value).where == "--gpu-memory-utilization"  # as `quantgate plan` shows it


def test_server_config_kv_dtype_for_candidates_only(tmp_path, demo_model):
    """serving.kv_cache_dtype reaches the candidates' servers; the baseline keeps auto KV (the reference)."""
    spec = load_spec(write_spec(tmp_path))
    base = Variant(name="baseline", path=demo_model, content_hash="b", size_bytes=1)
    cand = Variant(name="fp8-dynamic", path=demo_model, scheme="fp8-dynamic", content_hash="c", size_bytes=1)
    args = {v.name: server_config(spec, v, tmp_path / v.name).args for v in (base, cand)}
    flag = {n: a[a.index("--kv-cache-dtype") + 1] for n, a in args.items()}
    assert flag == {"baseline": "auto", "fp8-dynamic": "fp8"}
    for a in args.values():
        assert a[a.index("--max-num-seqs") + 1] == "16"
    assert (tmp_path / "fp8-dynamic" / "plan.json").is_file()


# ---- the gate: a changed KV cache requires recall ----------------------------------------------------------

def policy(recall: dict | None) -> GatePolicy:
    return GatePolicy.model_validate({"version": 1, "name": "t", "source": "test", "error_rate": {"max": 0.05},
                                      **({"recall": recall} if recall is not None else {})})


RECALL_STAT = PairedStat(n=120, base_mean=0.9, cand_mean=0.9, delta=0.0, ci_low=-0.02, ci_high=0.02, higher_is_better=True)
KV = KvCacheChange(baseline="auto", candidate="fp8", file="ev.json")
GATE = [
    # (policy recall section, KV change, recall evidence, decision, the recall check's outcome)
    ({"max_absolute_drop": 0.05, "required": False}, None, None, "PROMOTE", "skipped"),
    ({"max_absolute_drop": 0.05, "required": False}, KV, None, "INCONCLUSIVE", "inconclusive"),
    ({"max_absolute_drop": 0.05, "required": False}, KV, RECALL_STAT, "PROMOTE", "pass"),
    (None, None, None, "PROMOTE", None),
    (None, KV, None, "INCONCLUSIVE", "inconclusive"),
]


@pytest.mark.parametrize("recall,kv,stat,decision,outcome", GATE)
def test_kv_change_makes_recall_required(recall, kv, stat, decision, outcome):
    ev = GateEvidence(candidate="fp8-dynamic", scheme="fp8-dynamic", kv_cache=kv,
                      error_rates=[RateEvidence(name="fp8-dynamic/default", rate=0.0, n=100)],
                      recall={"recall": stat} if stat else {})
    d = evaluate(policy(recall), ev)
    assert d.decision == decision
    checks = [c for c in d.checks if c.name.startswith("recall")]
    assert [c.outcome for c in checks] == ([outcome] if outcome else [])
    if kv is not None and outcome == "inconclusive":
        assert "KV cache dtype is fp8" in checks[0].reason


@pytest.mark.parametrize("base,cand,changed", [
    (["vllm", "serve", "m", "--kv-cache-dtype", "auto"], ["vllm", "serve", "m", "--kv-cache-dtype", "fp8"], ("auto", "fp8")),
    (["vllm", "serve", "m"], ["vllm", "serve", "m", "--kv-cache-dtype=fp8_e5m2"], ("auto", "fp8_e5m2")),
    (["vllm", "serve", "m", "--kv-cache-dtype", "auto"], ["vllm", "serve", "m"], None),
    (["vllm", "serve", "m"], None, None),
    (["vllm", "serve", "m"], [], None),  # an endpoint: no command, the dtype is unknown
])
def test_kv_cache_change_from_the_serve_commands(base, cand, changed):
    found = kv_cache_change({"serve_command": base}, {"serve_command": cand} if cand is not None else {}, "f")
    assert (None if found is None else (found.baseline, found.candidate)) == changed


# ---- real: the server got the knobs -----------------------------------------------------------------------

@pytest.mark.slow
def test_served_demo_gets_the_spec_knobs(tmp_path, demo_model):
    """A spec's max_num_seqs, max_num_batched_tokens and enable_prefix_caching reach a real vLLM server of the demo
    model: vLLM logs the arguments it was given ("non-default args") and the scheduler's chunk size."""
    import httpx

    from quantgate.base import http
    from quantgate.release.variants import make_server

    spec = load_spec(DATA / "release_knobs.yaml")
    base = Variant(name="baseline", path=demo_model, content_hash="b", size_bytes=1)
    config = server_config(spec, base, tmp_path)
    with make_server(config, tmp_path) as srv:
        reply = httpx.post(f"{srv.base_url}/completions", headers=http.auth_headers(srv.api_key), timeout=600,
                           json={"model": "baseline", "prompt": "Hello", "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] is not None
    log = (tmp_path / "server.log").read_text()
    args = re.search(r"non-default args: (\{.*\})", log)
    assert args, log[-2000:]
    assert "'max_num_seqs': 16" in args.group(1) and "'max_num_batched_tokens': 4096" in args.group(1)
    assert "'enable_prefix_caching': True" in args.group(1)
    assert "max_num_batched_tokens=4096" in log  # the scheduler took it (chunked prefill line)


@pytest.mark.parametrize("cand_kv,outcome", [("fp8", "inconclusive"), ("auto", "skipped")])
def test_run_folder_kv_change_reaches_the_gate(tmp_path, cand_kv, outcome):
    """From a run folder (tests/_gate_fixtures.make_run) whose candidate lost its recall evidence, under a policy
    where recall is optional: the servers' --kv-cache-dtype decides whether the gate may still promote."""
    import json
    import shutil

    from _gate_fixtures import make_run
    from quantgate.gate.evidence import collect
    from quantgate.gate.policy import DEFAULT_POLICY, load_policy

    run = make_run(tmp_path, "fp8-dynamic")
    for name, kv in (("baseline", "auto"), ("fp8-dynamic", cand_kv)):
        path = run / name / "evidence.json"
        doc = json.loads(path.read_text())
        path.write_text(json.dumps({**doc, "serve_command": ["vllm", "serve", "m", "--kv-cache-dtype", kv]}))
    shutil.rmtree(run / "fp8-dynamic" / "recall")
    pol = load_policy(DEFAULT_POLICY)
    pol = pol.model_copy(update={"recall": pol.recall.model_copy(update={"required": False})})
    d = evaluate(pol, collect(run, "fp8-dynamic"))
    recall = next(c for c in d.checks if c.name.startswith("recall"))
    assert recall.outcome == outcome
    assert (d.decision == "INCONCLUSIVE") == (outcome == "inconclusive")


def test_a_servers_dtype_is_a_value_set_beside_its_flag():
    """The activation dtype a server runs in is its config's `dtype`, set where its --dtype is (the plan's, or the
    spec's serving.dtype over it): the release reads that value, not the command line back."""
    from quantgate.serving.server import config_from_plan

    cpu = build_plan(DEMO, "x86-cpu", context=2048, concurrency=4, replicas=2)
    planned, over = config_from_plan(cpu, Path("/m"), "b"), config_from_plan(cpu, Path("/m"), "b", dtype="bfloat16")
    assert (planned.dtype, planned.args[planned.args.index("--dtype") + 1]) == ("float32", "float32")
    assert (over.dtype, over.args[over.args.index("--dtype") + 1]) == ("bfloat16", "bfloat16")
    gpu = config_from_plan(build_plan(M8B, "h100", context=8192, concurrency=8), Path("/m"), "g")
    assert gpu.dtype is None and "--dtype" not in gpu.args


def test_only_a_one_worker_cpu_plan_runs_in_one_process_bound_by_openmps_variables():
    """A one-worker CPU replica runs in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and the serving manager binds
    it by OpenMP's variables to the slot's one core (VLLM_CPU_OMP_THREADS_BIND); on a slot of more cores, a PP plan
    (ranks split by '|') and a GPU plan, vLLM's worker processes and its own binding stay."""
    from quantgate.plan.commands import ONE_PROCESS
    from quantgate.plan.slots import BIND
    from quantgate.serving.server import one_process_binding

    split = build_plan(DEMO, "x86-cpu", context=2048, concurrency=4, replicas=2)
    pp = build_plan(DEMO, "x86-cpu", context=2048, concurrency=4, replicas=1)
    gpu = build_plan(M8B, "h100", context=8192, concurrency=8)
    assert [r.env.get(ONE_PROCESS) for r in split.replica_plans] == ["0", "0"] and pp.layout.pp == 2
    assert all(ONE_PROCESS not in r.env for p in (pp, gpu) for r in p.replica_plans)
    one = {**split.replica_plans[1].env, BIND: "1"}
    assert one_process_binding(one) == {"OMP_NUM_THREADS": "1", "OMP_PLACES": "{1}", "OMP_PROC_BIND": "close"}
    assert one_process_binding({**one, BIND: "2-3"}) == {ONE_PROCESS: "1"}  # more cores: vLLM's worker process
    assert one_process_binding({**one, BIND: "0|1"}) == one_process_binding({**one, BIND: "auto"}) == {}
    assert one_process_binding(pp.replica_plans[0].env) == {}
