"""Expert parallelism as a recipe step: every experts module of a model split over one mesh axis."""

from __future__ import annotations

from ...errors import ScheduleError
from ...schedule.core import Schedule
from .facts import expert_modules


def expert_parallel_moe(sch: Schedule, *, axis: str = "dp", tensor: str | None = None) -> list[str]:
    """`expert_parallel(axis=axis, tensor=tensor)` on every experts module of the model (NOTE [experts by
    structure] in `facts.py`; `tensor`: a tensor axis that also splits each expert's weights, NOTE [experts split
    by tensor]); returns their paths. Raises ScheduleError when the model has none."""
    found = expert_modules(sch.model)
    if not found:
        raise ScheduleError("expert_parallel_moe: the model has no experts module (a module whose parameters "
                            "stack the experts on dim 0 and whose forward takes rows, expert indices and weights)")
    for path in found:
        sch[path].expert_parallel(axis=axis, tensor=tensor)
    return list(found)
