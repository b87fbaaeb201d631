"""The automatic planner: joint intra-op sharding and activation checkpointing whose output is a Schedule.

    plan = plan_model(model, example_inputs, cluster=parse_cluster("2x2:cpu"), memory_budget_bytes=...)
    print(plan.explain()); sch = plan.schedule

Pipeline: `capture` (torch.export, repeated blocks captured small) -> `dims` (strategies by dimension
algebra) -> `cost_graph` / `node_costs` (units, costs, layout edges) -> `ilp` (HiGHS MILP with checkpoint
counts) or `checkpoint_dp` (two-stage) -> `to_schedule` (decisions -> primitives) -> `plan.Plan`.
"""

from .capture import CapturedGraph, capture
from .cost_graph import Roles, TrainSpec
from .plan import Estimate, Plan, enumerate_roles, plan_model
from ..pricing import Price, PriceRow, price
from .to_schedule import Decision

__all__ = ["capture", "CapturedGraph", "plan_model", "Plan", "Estimate", "Decision", "Roles", "TrainSpec",
           "enumerate_roles", "price", "Price", "PriceRow"]
