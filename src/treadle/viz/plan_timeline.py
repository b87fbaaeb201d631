"""The predicted step of a plan as a timeline: from its price when it has one, else from its rows."""

from __future__ import annotations

from .costs import costs_from_plan
from .price_timeline import timeline_from_price
from .timeline import Timeline, timeline_from_costs


def timeline_from_plan(plan) -> Timeline:
    """The predicted step of a `treadle.planner.Plan` (planned, or loaded from JSON). A plan with a price
    (`plan.price`, or one `plan.estimate()` computes for a planned model) is drawn from it,
    `treadle.viz.price_timeline.timeline_from_price`: the same numbers as `plan.estimate()` and explain.
    A plan without one (a JSON file written before plans carried their price) falls back to its rows and
    `estimated`: `costs_from_plan` (NOTE [plan attribution] in costs.py) laid out by `timeline_from_costs`."""
    notes: list[str] = []
    if plan.price is None:
        from ..errors import PlanError

        try:
            plan.estimate()  # prices a planned model; a loaded plan without a price stays without
        except PlanError as exc:  # a schedule price cannot rehearse: draw the solver's figures, and say so
            notes.append(f"not drawn from the price ({exc}): from the plan's rows and the solver's estimate")
    if plan.price is not None and plan.price.get("segments"):
        name = (plan.model or {}).get("name", "model") if isinstance(plan.model, dict) else "model"
        return timeline_from_price(plan.price, title=f"{name} on {plan.cluster.mesh} ({plan.roles})",
                                   world_size=plan.cluster.world_size, budget_bytes=plan.budget_bytes)
    tl = timeline_from_costs(costs_from_plan(plan))
    tl.notes = notes + tl.notes
    return tl
