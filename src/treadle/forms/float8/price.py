"""Float8's part of a priced step: the all-reduce of the gathered weights' amaxes after the optimizer step
(`runtime.precompute_scales`), and, for weights split over tensor axes, the scales set again before the forward
(`tensor_parallel.split_gather_scales`). The products, casts and FSDP2's float8 gathers are priced where they run: the
rehearsal records the float8 linears (NOTE [float8 in the price]) and the data form gathers at one byte an element
(`Float8Form.gather_itemsize`)."""

from __future__ import annotations

import math

from ...cost.collective_cost import collective_time_s
from ...cost.overlap import Collective
from ...form import PriceTerms
from ...schedule.float8_primitive import float8_linears

AMAX_BYTES = 4  # one float32 amax a weight


def price_step(ctx) -> PriceTerms | None:
    """One all-reduce (max) of one float32 per float8-gathered weight over FSDP2's shard axes, issued after the
    optimizer's segment (the next one `treadle.pricing.step` appends: index ``len(segments)``), blocking: the next
    forward's gathers need its scales. Where such weights are split over tensor axes, their scales are set again
    before the forward (NOTE [float8 under tensor parallelism]): the same all-reduce, then one (min) over each set of
    split axes of its weights' scales, blocking, after the step's first segment (before the blocks gather)."""
    reh = ctx.reh
    dp = reh.view.data_parallel
    if dp is None or not dp.shard or dp.shard_size(reh.mesh) <= 1:
        return None
    gathered = [lin for lin, spec in float8_linears(reh.view.extras).items() if spec.all_gather]
    if not gathered:
        return None

    def all_reduce(axes: tuple[str, ...], n: int, phase: str, after: int) -> Collective:
        link = ctx.cluster.group_link(axes)
        size = math.prod(reh.mesh.size(a) for a in axes)
        nbytes = n * AMAX_BYTES
        return Collective("all_reduce", ",".join(axes), nbytes, collective_time_s("all_reduce", nbytes, size, link),
                          "", phase, after, blocking=True, source="fsdp", link=link)

    colls = [all_reduce(tuple(dp.shard_axes), len(gathered), "bwd", len(ctx.segments))]
    shards = reh.view.shards_by_name()
    split: dict[tuple[str, ...], int] = {}
    for lin in gathered:
        axes = tuple(s.axis for s in shards.get(f"{lin}.weight", ()))
        if axes:
            split[axes] = split.get(axes, 0) + 1
    if split:
        colls.append(all_reduce(tuple(dp.shard_axes), len(gathered), "fwd", 0))
        colls += [all_reduce(axes, n, "fwd", 0) for axes, n in sorted(split.items())]
    return PriceTerms(colls)
