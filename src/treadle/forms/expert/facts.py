"""Which modules of a model are experts modules (NOTE [experts by structure]), read by the recipe step and the
planner, and how FSDP2 shards them (NOTE [experts under FSDP2])."""

from __future__ import annotations

import math

from torch import nn

from ...errors import ScheduleError
from ...schedule.expert_primitive import experts_shape

# NOTE [experts by structure]: an experts module holds every expert's weights itself, stacked on dim 0 (each
# direct parameter (E, ...), at least one a stack of matrices (E, out, in)), has no child with parameters, and
# its forward takes the rows, their expert indices and their routing weights, or E groups of rows that it runs
# expert by expert (NOTE [dense experts], found by probing its forward: Llama 4). That is what `expert_parallel`
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


# NOTE [experts under FSDP2]: under a data parallelism with ZeRO-3 (FSDP2 or HSDP) the expert axes take some of
# the data-parallel axes for the experts; the other shard axes still shard them. So each experts module is an
# FSDP2 unit of its own (`fully_shard` on it before the blocks, as torchtitan shards its experts over
# "dp_shard mod ep"), over the flattened shard axes other than the expert axes, replicated (HSDP) over the other
# replicate axes; its gradient's average over those ranks is FSDP2's, so the experts' local forward only scales
# by 1/|expert group| (NOTE [expert gradients]). When no shard axis is left (ZeRO-3 over the expert axes alone)
# or under DDP, the experts stay whole on each rank of the expert group and reduce their gradients themselves.
# Build, the price, the planner and treadle.run's checkpoint layout all read `expert_fsdp`.
def expert_fsdp(view, axes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(shard axes, replicate axes) FSDP2 splits the experts of an experts module expert-parallel over `axes` by
    (NOTE [experts under FSDP2]); ((), ()) when FSDP2 leaves them alone."""
    dp = view.data_parallel
    if dp is None or not dp.shard:
        return (), ()
    shard = tuple(a for a in dp.shard_axes if a not in axes)
    if math.prod(view.mesh.size(a) for a in shard) <= 1:
        return (), ()
    return shard, tuple(a for a in dp.replicate_axes if a not in axes)
