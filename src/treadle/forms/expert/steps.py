"""Expert parallelism as a recipe step: every experts module of a model split over one mesh axis or a group of them."""

from __future__ import annotations

from collections.abc import Sequence

from ...errors import ScheduleError
from ...schedule.core import Schedule
from .facts import expert_modules


def expert_parallel_moe(sch: Schedule, *, axis: str | Sequence[str] = "dp", tensor: str | None = None,
                        load_imbalance: float = 1.0) -> list[str]:
    """`expert_parallel(axis=axis, tensor=tensor, load_imbalance=load_imbalance)` on every experts module of the
    model (NOTE [experts by structure] in `facts.py`; `axis`: one mesh axis, or several whose flattened group the
    experts split over; `tensor`: a tensor axis that also splits each expert's
    weights, NOTE [experts split by tensor]; `load_imbalance`: what the price charges the busiest rank, NOTE
    [expert load in a rehearsal]); returns their paths. Raises ScheduleError when the model has none."""
    found = expert_modules(sch.model)
    if not found:
        raise ScheduleError("expert_parallel_moe: the model has no experts module (a module whose parameters "
                            "stack the experts on dim 0 and whose forward takes rows, expert indices and weights)")
    for path in found:
        sch[path].expert_parallel(axis=axis, tensor=tensor, load_imbalance=load_imbalance)
    return list(found)
