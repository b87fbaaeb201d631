"""The automatic planner: joint intra-op sharding and activation checkpointing whose output is a Schedule.

    plan = plan_model(model, example_inputs, cluster=parse_cluster("2x2:cpu"), memory_budget_bytes=...)
    print(plan.explain()); sch = plan.schedule

The steps (`search.plan_model`): `capture` (torch.export, repeated blocks captured small) -> `roles` (what each
parallel form does with which mesh axis) -> `dims` (strategies by dimension algebra) -> `cost_graph` /
`node_costs` (units, costs, layout edges; each form's terms) -> `ilp` (HiGHS MILP with checkpoint counts) or
`checkpoint_dp` (two-stage) -> `by_price` (the best plans priced as built) -> `to_schedule` (decisions ->
primitives) -> `plan.Plan` (data).
"""

from . import dim_rules as _dim_rules  # noqa: F401  (registers the dimension rules)
from .capture import CapturedGraph, capture
from .cost_graph import Roles, TrainSpec
from ..pricing import Estimate, Price, PriceRow, price
from .plan import Plan
from .roles import enumerate_roles
from .search import PlanRequest, plan_model
from .to_schedule import Decision

__all__ = ["capture", "CapturedGraph", "plan_model", "Plan", "Estimate", "Decision", "Roles", "TrainSpec",
           "enumerate_roles", "price", "Price", "PriceRow", "PlanRequest"]
