"""Which modules of a model are experts modules (NOTE [experts by structure]), read by the recipe step and the
planner."""

from __future__ import annotations

from torch import nn

from ...errors import ScheduleError
from ...schedule.expert_primitive import experts_shape

# NOTE [experts by structure]: an experts module holds every expert's weights itself, stacked on dim 0 (each
# direct parameter (E, ...), at least one a stack of matrices (E, out, in)), has no child with parameters, and
# its forward takes the rows, their expert indices and their routing weights. That is what `expert_parallel`
# requires (`treadle.schedule.expert_primitive.experts_shape`), so the recipe proposes exactly what the
# primitive accepts; no class name is consulted.


def expert_modules(model: nn.Module) -> dict[str, int]:
    """Path -> number of experts, for every experts module of `model` (NOTE [experts by structure])."""
    out: dict[str, int] = {}
    for path, m in model.named_modules():
        own = list(m.parameters(recurse=False))
        if not path or not own or not any(p.dim() == 3 for p in own):
            continue
        try:
            out[path] = experts_shape(path, m)
        except ScheduleError:
            continue
    return out
