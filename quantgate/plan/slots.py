"""Device slots (pure): the disjoint parts of a machine on which variants are served at the same time.

A plan's replicas are the slots: on GPUs a slot is a replica's device indices (CUDA_VISIBLE_DEVICES or the
vendor's variable), on a CPU a set of cores that the server's threads are bound to (VLLM_CPU_OMP_THREADS_BIND)
and that child processes are pinned to (cpu affinity). A release serves `width` variants at once, one per slot:
  - GPU: one slot per replica; a replica's layout fixes its devices, so slots are never merged;
  - CPU: the host's cores are split evenly into `width` slots, and each server binds every core of its slot,
    its ranks (PP/DP workers) splitting the slot's cores between them. A lone variant gets every core.
How many variants a release serves at once (`width`) is `release_width`: every variant of one release is served on
slots of one size, so that their speed (and any effect of the thread count) compares like with like.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from quantgate.base.errors import QuantgateError
from quantgate.plan.models import Plan, SlotRule

BIND = "VLLM_CPU_OMP_THREADS_BIND"


class Slot(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int
    kind: Literal["gpu", "cpu"]
    devices: list[int] = Field(description="GPU indices (local to the node) or CPU core ids")
    env: dict[str, str] = Field(description="the placement variables only (devices or core binding): they replace the "
                                            "replica's in each variant's own plan")

    @property
    def label(self) -> str:
        what = "cores" if self.kind == "cpu" else "devices"
        return f"slot {self.index} ({what} {span(self.devices)})"


def span(ids: list[int]) -> str:
    """'0-3' for a contiguous run, '0,2,5' otherwise."""
    ids = sorted(ids)
    if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(str(i) for i in ids)


def cpu_bind(cores: list[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` workers sharing `cores`: contiguous groups, one per rank, '|' between.
    Every core is bound (the first groups get one more when they do not divide evenly)."""
    if ranks < 1 or len(cores) < ranks:
        raise QuantgateError(f"{len(cores)} core(s) cannot give each of {ranks} worker(s) a core of its own",
                             where="plan slots", fix="give the slot at least one core per rank (fewer concurrent variants)")
    size, extra = divmod(len(cores), ranks)
    groups, start = [], 0
    for r in range(ranks):
        n = size + (1 if r < extra else 0)
        groups.append(span(cores[start:start + n]))
        start += n
    return "|".join(groups)


def release_width(kind: str, variants: int, slots: int, rule: SlotRule | None) -> int:
    """How many variants a release serves at once: one per slot up to the number of variants; on a CPU only when
    the measured gain of splitting its cores is worth it (else 1: a lone variant on every core)."""
    most = max(1, min(variants, slots))
    if kind == "cpu" and (rule is None or rule.cpu_split_gain < rule.min_gain):
        return 1
    return most


def slots(plan: Plan, width: int) -> list[Slot]:
    """`width` disjoint slots of the plan's machine (fewer on GPUs when the plan has fewer replicas).

    A replica that spans nodes is no slot: [] (the flow then serves one variant at a time, as planned)."""
    reps = plan.replica_plans
    if width < 1:
        raise QuantgateError(f"width {width}: a release serves at least one variant at a time", where="plan slots",
                             fix="pass a width of 1 or more")
    if any(r.multi_node is not None for r in reps):
        return []
    if plan.kind == "gpu":
        return [Slot(index=i, kind="gpu", devices=list(r.devices), env=dict(r.env)) for i, r in enumerate(reps[:width])]
    n = min(width, plan.replicas)
    cores = sorted({c for r in reps for c in cores_of(r.env.get(BIND, ""))}) or list(range(plan.devices_total))
    size = len(cores) // n
    out = []
    for i in range(n):
        mine = cores[i * size:(i + 1) * size]
        out.append(Slot(index=i, kind="cpu", devices=mine, env={BIND: cpu_bind(mine, plan.layout.devices)}))
    return out


def placement_free(env: dict[str, str], visible_vars: list[str]) -> dict[str, str]:
    """`env` with WHICH devices or cores replaced by HOW MANY: a cache key that a variant measured on slot 1 shares
    with the same variant on slot 0 (same size), but not with one measured on a slot of another size."""
    out = dict(env)
    if BIND in out:
        out[BIND] = "cores:" + "|".join(str(len(cores_of(g))) for g in out[BIND].split("|"))
    for var in visible_vars:
        if var in out:
            out[var] = f"devices:{len([d for d in out[var].split(',') if d.strip()])}"
    return out


def cores_of(bind: str) -> list[int]:
    """The core ids of a VLLM_CPU_OMP_THREADS_BIND value ('0-1', '0|1', '0,2|4-5'); [] for ''."""
    out: list[int] = []
    for part in bind.replace("|", ",").split(","):
        if part.strip():
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi or lo) + 1))
    return out
