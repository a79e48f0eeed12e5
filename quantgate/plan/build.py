"""A plan built from files: the model's config, the hardware profile and the planner policy in, a `Plan` out."""

from __future__ import annotations

from pathlib import Path

from quantgate.base.paths import RECIPES
from quantgate.base.yamlconfig import load_model
from quantgate.plan.models import Plan, PlanRequest, PlannerPolicy
from quantgate.plan.planner import plan as make_plan
from quantgate.target.hardware import get_profile
from quantgate.target.modelshape import load_model_spec

PLANNER_FILE = RECIPES / "planner.yaml"


def load_planner_policy(path: Path = PLANNER_FILE) -> PlannerPolicy:
    return load_model(path, PlannerPolicy)


def build_plan(model: Path | str, hardware: str, *, context: int, concurrency: int, policy_path: Path = PLANNER_FILE,
               **options) -> Plan:
    """Adapter for flows and the CLI: files in, Plan out. `options` are PlanRequest fields (gpus, nodes, ...)."""
    req = PlanRequest(model=load_model_spec(model), hardware=get_profile(hardware), context=context,
                      concurrency=concurrency, **{k: v for k, v in options.items() if v is not None})
    return make_plan(req, load_planner_policy(policy_path))
