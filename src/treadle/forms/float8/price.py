"""Float8's part of a priced step: the all-reduce of the gathered weights' amaxes after the optimizer step
(`runtime.precompute_scales`). The products, casts and FSDP2's float8 gathers are priced where they run: the
rehearsal records the float8 linears (NOTE [float8 in the price]) and the data form gathers at one byte an element
(`Float8Form.gather_itemsize`)."""

from __future__ import annotations

from ...cost.collective_cost import collective_time_s
from ...cost.overlap import Collective
from ...form import PriceTerms
from ...schedule.float8_primitive import float8_linears

AMAX_BYTES = 4  # one float32 amax a weight


def price_step(ctx) -> PriceTerms | None:
    """One all-reduce (max) of one float32 per float8-gathered weight over FSDP2's shard axes, issued after the
    optimizer's segment (the next one `treadle.pricing.step` appends: index ``len(segments)``), blocking: the next
    forward's gathers need its scales."""
    reh = ctx.reh
    dp = reh.view.data_parallel
    if dp is None or not dp.shard or dp.shard_size(reh.mesh) <= 1:
        return None
    n = sum(1 for spec in float8_linears(reh.view.extras).values() if spec.all_gather)
    if not n:
        return None
    link = ctx.cluster.group_link(dp.shard_axes)
    size = dp.shard_size(reh.mesh)
    nbytes = n * AMAX_BYTES
    coll = Collective("all_reduce", ",".join(dp.shard_axes), nbytes, collective_time_s("all_reduce", nbytes, size, link),
                      "", "bwd", len(ctx.segments), blocking=True, source="fsdp", link=link)
    return PriceTerms([coll])
