"""Check `plan_model`'s arguments before any capture or solve: mesh axes, pins, forbidden axes, budget.

Each mistake raises a PlanError naming the argument, the bad value and the valid choices, instead of a
late "no plan meets the budget" (a pin on an axis the mesh lacks used to read as an infeasible budget).
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

from torch import nn

from ..errors import PlanError
from ..placement import ANY_SHARD

_REPLICATE = ("R", "replicate", None)


def _axes(cluster: Any) -> list[str]:
    clusters = list(cluster) if isinstance(cluster, (list, tuple)) else [cluster]
    names: list[str] = []
    for cl in clusters:
        mesh = getattr(cl, "mesh", None)
        if mesh is None:
            raise PlanError(f"plan_model: cluster must be a ClusterSpec (treadle.cost.cluster.parse_cluster) or a "
                            f"list of them, got {type(cl).__name__}")
        names += [n for n in mesh.names if n not in names]
    return names


def _dim_text(dim: int) -> str:
    return "a dim" if dim == ANY_SHARD else f"dim {dim}"


def _pin_dim(pattern: str, axis: str, value: Any) -> int | None:
    """The tensor dim a pin value names (None: Replicate; `ANY_SHARD` for "S", sharded on a dim the solver picks).
    Raises PlanError for anything else."""
    if value in _REPLICATE:
        return None
    if isinstance(value, str) and value.strip().upper() == "S":
        return ANY_SHARD
    if isinstance(value, bool):
        raise PlanError(f"pin {pattern!r} axis {axis!r}: {value!r} is not a dim; use an int dim, 'S<dim>', 'S' or 'R'")
    if isinstance(value, int):
        dim = value
    elif isinstance(value, str) and value.lstrip("S").isdigit():
        dim = int(value.lstrip("S"))
    else:
        raise PlanError(f"pin {pattern!r} axis {axis!r}: cannot read {value!r}; use an int dim, 'S<dim>', 'S' "
                        f"(sharded, the solver picks the dim) or 'R'")
    if dim < 0:
        raise PlanError(f"pin {pattern!r} axis {axis!r}: dim {dim} is negative; use a dim >= 0")
    return dim


def validate_axes(cluster: Any, *, pins: dict[str, dict[str, Any]] | None, forbid_axes: Any, dp_axis: Any) -> None:
    """The checks of `validate_plan_args` that need no model: `forbid_axes`, `dp_axis` and every pin's axes
    against the axes of `cluster` (one ClusterSpec or a list). `treadle plan` runs them before it measures
    the host or builds the model."""
    axes = _axes(cluster)
    if isinstance(forbid_axes, str):
        raise PlanError(f"plan_model: forbid_axes must be a tuple of mesh axis names, not the string "
                        f"{forbid_axes!r}; write forbid_axes=({forbid_axes!r},)")
    unknown = [a for a in (forbid_axes or ()) if a not in axes]
    if unknown:
        raise PlanError(f"plan_model: forbid_axes names {unknown}, which no mesh has; mesh axes: {axes}")
    dp_axes = () if dp_axis in ("auto", None) else (dp_axis,) if isinstance(dp_axis, str) else tuple(dp_axis)
    for a in dp_axes:
        if a not in axes:
            raise PlanError(f"plan_model: dp_axis {a!r} is not a mesh axis; use 'auto', None, one of {axes} "
                            f"or a tuple of them")
    for pattern, per_axis in (pins or {}).items():
        if not isinstance(per_axis, dict):
            raise PlanError(f"pin {pattern!r}: expected {{axis: dim or 'R'}}, got {per_axis!r}")
        for axis in per_axis:
            if axis not in axes:
                raise PlanError(f"pin {pattern!r} names mesh axis {axis!r}, which no mesh has; mesh axes: {axes}")


def validate_plan_args(model: nn.Module, *, cluster: Any, memory_budget_bytes: float | None,
                       pins: dict[str, dict[str, Any]] | None, forbid_axes: Any, dp_axis: Any) -> None:
    """Raise PlanError for: a cluster that is not a ClusterSpec; a budget that is not a positive number of
    bytes; `forbid_axes` given as one string or naming an axis no mesh has; a `dp_axis` no mesh has; a pin
    whose axis no mesh has, whose glob matches no parameter of `model`, whose dim is out of range for a
    matched parameter, or that shards on an axis it also forbids or gives to data parallelism."""
    if memory_budget_bytes is not None:
        ok = isinstance(memory_budget_bytes, (int, float)) and not isinstance(memory_budget_bytes, bool)
        if not ok or math.isnan(memory_budget_bytes) or memory_budget_bytes <= 0:
            raise PlanError(f"plan_model: memory_budget_bytes must be a positive number of bytes (or None for no "
                            f"limit); got {memory_budget_bytes!r}")
    validate_axes(cluster, pins=pins, forbid_axes=forbid_axes, dp_axis=dp_axis)
    dp_axes = () if dp_axis in ("auto", None) else (dp_axis,) if isinstance(dp_axis, str) else tuple(dp_axis)
    params = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}  # tied: every name
    for pattern, per_axis in (pins or {}).items():
        matched = [n for n in params if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise PlanError(f"pin {pattern!r} matches no parameter; parameters look like {sorted(params)[:4]}")
        for axis, value in per_axis.items():
            dim = _pin_dim(pattern, axis, value)
            if dim is None:
                continue
            for n in matched:
                if dim >= len(params[n]) or (dim == ANY_SHARD and not params[n]):
                    raise PlanError(f"pin {pattern!r} axis {axis!r}: dim {'S' if dim == ANY_SHARD else dim} is out of "
                                    f"range for {n!r} of shape {params[n]}")
            if axis in (forbid_axes or ()):
                raise PlanError(f"pin {pattern!r} shards {_dim_text(dim)} over axis {axis!r}, but forbid_axes keeps every op "
                                f"replicated on {axis!r}; drop one of them")
            if axis in dp_axes:
                raise PlanError(f"pin {pattern!r} shards {_dim_text(dim)} over axis {axis!r}, but dp_axis={dp_axis!r} gives "
                                f"it to data parallelism; pin on another axis or set dp_axis")


# NOTE [execution and float8 in the plan]: `plan_model(execution=...)` says how the plan will run: "eager", or
# "compiled" (every block under torch.compile, as `treadle.run --compile` runs it). The solver's terms are eager's;
# the candidates priced as built (NOTE [final choice by price]) are priced as the plan will run, and the plan states
# its execution (`Plan.execution`, its `estimate()`). A compiled plan has no pipeline (`treadle.run` refuses
# --compile with one, and the price a compiled pipeline). `float8=recipe` lets the plan train the repeated blocks'
# linears in float8: each role assignment is solved with and without float8 (`Roles.float8`: those linears then
# compute replicated over every tensor axis, since float8 does not compose with tensor parallelism), and the best of
# each is priced as built — the price, not the solver, weighs float8's faster products against its casts (eager
# casts cost more than they save; compiled ones less). A partial schedule's float8 record makes every plan use it.
def execution_and_float8(given: dict, role: dict) -> tuple[str, tuple[str, bool] | None]:
    """`plan_model`'s execution and float8 request, checked: (execution, (recipe, forced) or None). Raises
    PlanError naming the argument (NOTE [execution and float8 in the plan])."""
    from ..pricing.compiled import EXECUTIONS
    from ..schedule.float8_primitive import FLOAT8_RECIPES

    execution = given.get("execution", "eager")
    if execution not in EXECUTIONS:
        raise PlanError(f"plan_model: execution must be one of {list(EXECUTIONS)}, got {execution!r:.40}")
    if execution == "compiled" and (role.get("pp_axis") or given.get("pp_axis") not in ("auto", None)):
        raise PlanError("plan_model: a compiled plan cannot pipeline (treadle.run refuses --compile with a "
                        "pipeline); plan eager, or drop the pipeline")
    recipe, forced = role.get("float8"), "float8" in role
    if recipe is None:
        recipe = given.get("float8")
    if recipe is None:
        return execution, None
    if recipe not in FLOAT8_RECIPES:
        raise PlanError(f"plan_model: float8 must be a recipe in {sorted(FLOAT8_RECIPES)} or None, got {recipe!r:.40}")
    return execution, (recipe, forced)


def expert_load_of(given: dict) -> float:
    """`plan_model`'s `expert_load_imbalance`, checked (NOTE [expert load in a rehearsal]: the busiest expert rank's
    routed rows over the mean, charged to an expert-parallel plan and stated in its `expert_parallel` decisions).
    Raises PlanError for anything but a finite number >= 1."""
    from ..errors import ScheduleError
    from ..schedule.expert_primitive import check_load_imbalance

    try:
        return check_load_imbalance(given.get("expert_load_imbalance", 1.0), where="plan_model")
    except ScheduleError as exc:
        raise PlanError(str(exc)) from None
