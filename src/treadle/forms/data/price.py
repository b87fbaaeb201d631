"""Data parallelism in a priced step: DDP's bucketed all-reduces and buffer broadcast, FSDP2's prefetched gathers,
reduce-scatters, host costs and copies, HSDP's all-reduce of the shards (the module doc of `treadle.pricing`),
each by the facts of `facts.py`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ...cost.cluster import ClusterSpec
from ...cost.collective_cost import collective_time_s
from ...cost.overlap import Collective, Segment
from ...form import PriceTerms
from ...pricing import Rehearsal, StepContext
from ...profile.memory import buffer_bytes
from ...runtime.optimizer import trainable_params
from .facts import (backward_prefetch, buffer_broadcast_s, ddp_buckets, foreign_params, fsdp_copy_s, fsdp_host_s,
                    fsdp_param_units, fsdp_units, gather_itemsizes, shard_units, within)


def price_step(ctx: StepContext) -> PriceTerms | None:
    """The data-parallel part of a rehearsed step (None without data parallelism over more than one rank)."""
    reh = ctx.reh
    dp = reh.view.data_parallel
    if dp is None or dp.size(reh.mesh) <= 1:
        return None
    foreign = foreign_params(reh.model, reh.view)  # another form reduces them (the local experts)
    if dp.shard:
        colls, gathered, divisors = _fsdp(reh, ctx.segments, ctx.cluster, foreign)
        return PriceTerms(colls, gathered_bytes=gathered, param_divisor=dp.shard_size(reh.mesh),
                          subclass_params=dp.shard_size(reh.mesh) > 1, label=str(dp), foreign=frozenset(foreign),
                          divisors=divisors)
    return PriceTerms(_ddp(reh, ctx.segments, ctx.cluster, foreign), grad_copies=1, label=str(dp),
                      foreign=frozenset(foreign))


def _ddp(reh: Rehearsal, segs: list[Segment], cluster: ClusterSpec, foreign: set[str]) -> list[Collective]:
    """DDP's bucketed all-reduces over the flattened group of every data-parallel axis (prod of their sizes
    ranks, `ClusterSpec.group_link`), each issued when the bucket's last gradient is ready; the `foreign`
    parameters (another form's) are in no bucket."""
    dp = reh.view.data_parallel
    axis, n, link = dp.label(), dp.size(reh.mesh), cluster.group_link(dp.axes)
    bwd_last: dict[str, int] = {}
    for i, s in enumerate(segs):
        if s.phase == "bwd":
            bwd_last[s.module] = i
    last_bwd = max(bwd_last.values(), default=len(segs) - 1)
    grads = []
    for order, (name, p) in enumerate(reversed(trainable_params(reh.model))):
        if name in foreign:
            continue
        owner = name.rpartition(".")[0]
        ready = bwd_last.get(owner, last_bwd)
        grads.append((ready, order, name, p.numel() * p.element_size(), str(p.dtype)))
    grads.sort()
    ready_of = {g[2]: g[0] for g in grads}
    size_of = {g[2]: g[3] for g in grads}
    out = []
    for bucket in ddp_buckets([(g[2], g[3], g[4]) for g in grads]):
        nbytes = sum(size_of[x] for x in bucket)
        after = max(ready_of[x] for x in bucket)
        out.append(Collective("all_reduce", axis, nbytes, collective_time_s("all_reduce", nbytes, n, link),
                              segs[after].module, "bwd", after, blocking=False, needed_before=None, source="ddp",
                              link=link))
    cast = buffer_bytes(reh.model)  # NOTE [DDP buffers]: every buffer, before the forward's first op, waited on
    if cast:
        first = next((i for i, s in enumerate(segs) if s.phase == "fwd"), 0)
        out.append(Collective("broadcast", axis, cast, buffer_broadcast_s(cast, n, link),
                              segs[first].module if segs else "", "fwd", first - 1, blocking=True, source="ddp",
                              link=link))
    return out


def prefetched_gathers(order: list[str], first_use: dict[str, int], unit_bytes: dict[str, float], phase: str,
                       start: int, axis: str, n: int, link, groups: dict | None = None,
                       issued_by: dict[str, str] | None = None) -> list[Collective]:
    """FSDP2's all-gathers of the units `order` in one pass (forward or backward) of a segment list: unit u is
    needed before segment ``first_use[u]`` and gathered one unit ahead, issued when the unit before it starts (the
    first at the pass's `start`), or when unit ``issued_by[u]`` starts (NOTE [nested prefetch]); over (`axis`, `n`,
    `link`), or ``groups[u]``'s for a unit on axes of its own."""
    out = []
    prev_start = start
    for u in order:
        need = first_use[u]
        ax, size, ln = (groups or {}).get(u, (axis, n, link))[:3]
        issuer = (issued_by or {}).get(u)
        at = first_use[issuer] if issuer in first_use else prev_start
        out.append(Collective("all_gather", ax, unit_bytes[u], collective_time_s("all_gather", unit_bytes[u], size, ln),
                              u, phase, min(at, need) - 1, blocking=False, needed_before=need, source="fsdp",
                              link=ln))
        prev_start = need
    return out


def _fsdp(reh: Rehearsal, segs: list[Segment], cluster: ClusterSpec,
          foreign: set[str]) -> tuple[list[Collective], float, dict[str, int]]:
    """FSDP2's gathers and reduce-scatters (module doc); returns them, the gathered-buffer bytes at peak and the
    shard divisor of each parameter in a unit on axes of its own. The `foreign` parameters (another form's:
    `ignored_params`) are in no unit.

    Gathers and reduce-scatters run over the flattened group of the shard axes (n = prod of their sizes,
    `ClusterSpec.group_link`). HSDP adds, per unit, an all-reduce of the reduced shard (unit bytes / n) over the
    replicate axes, after its reduce-scatter. ``reshard_after_forward=False``: no backward gathers, and every
    unit stays gathered from its forward to its backward (gathered bytes at peak: all units). Another form's
    units (`shard_units`: the local experts, NOTE [experts under FSDP2]) come first, each over its own axes;
    a block's gathered bytes include the units nested in it."""
    dp = reh.view.data_parallel
    axis, n, link = ",".join(dp.shard_axes), dp.shard_size(reh.mesh), cluster.group_link(dp.shard_axes)
    own = shard_units(reh.model, reh.view)
    groups = {u.path: (",".join(u.shard_axes), math.prod(reh.mesh.size(a) for a in u.shard_axes),
                       cluster.group_link(u.shard_axes), u.replicate_axes) for u in own}
    units = [u.path for u in own] + fsdp_units(reh.model)
    unit_bytes: dict[str, float] = {u: 0.0 for u in units}  # what a unit reduces (its gradients' dtype)
    gather_bytes: dict[str, float] = {u: 0.0 for u in units}  # what it gathers (a form may gather narrower)
    unit_params: dict[str, int] = {u: 0 for u in units}
    divisors: dict[str, int] = {}
    itemsize = gather_itemsizes(reh.view)
    for (name, p), unit in zip(trainable_params(reh.model), fsdp_param_units(reh.model, units)):
        if name in foreign:
            continue
        unit_bytes[unit] += p.numel() * p.element_size()
        gather_bytes[unit] += p.numel() * itemsize.get(name, p.element_size())
        unit_params[unit] += 1
        if unit in groups:
            divisors[name] = groups[unit][1]

    def group(u: str) -> tuple[str, int, Any, tuple[str, ...]]:
        return groups.get(u, (axis, n, link, dp.replicate_axes))

    def unit_of(module: str) -> str:
        return next(u for u in units if within(module, u))

    first_fwd: dict[str, int] = {}
    first_bwd: dict[str, int] = {}
    last_bwd: dict[str, int] = {}
    for i, s in enumerate(segs):
        u = unit_of(s.module)
        if s.phase == "fwd":
            first_fwd.setdefault(u, i)
        elif s.phase in ("bwd", "recompute"):
            first_bwd.setdefault(u, i)
            last_bwd[u] = i
    end_fwd = max((i for i, s in enumerate(segs) if s.phase == "fwd"), default=-1)
    out: list[Collective] = []
    fwd_order = sorted((u for u in first_fwd if u and unit_bytes[u]), key=first_fwd.get)
    if unit_bytes[""]:
        out.append(Collective("all_gather", axis, gather_bytes[""],
                              collective_time_s("all_gather", gather_bytes[""], n, link),
                              "", "fwd", -1, blocking=False, needed_before=0, source="fsdp", link=link))
    out += prefetched_gathers(fwd_order, first_fwd, gather_bytes, "fwd", 0, axis, n, link, groups)
    bwd_order = sorted((u for u in first_bwd if u and unit_bytes[u] and dp.reshard_after_forward),
                       key=first_bwd.get)
    explicit = backward_prefetch(reh.model, fsdp_units(reh.model)[:-1], list(groups))
    issued_by = {t: u for u, targets in explicit.items() for t in targets}  # NOTE [nested prefetch]
    out += prefetched_gathers(bwd_order, first_bwd, gather_bytes, "bwd", end_fwd + 1, axis, n, link, groups,
                              issued_by)
    for u in units:
        if not unit_bytes[u]:
            continue
        after = last_bwd.get(u, len(segs) - 1)
        ax, un, ulink, rep_axes = group(u)
        rs = Collective("reduce_scatter", ax, unit_bytes[u], collective_time_s("reduce_scatter", unit_bytes[u], un, ulink),
                        u or "", "bwd", after, blocking=False, needed_before=None, source="fsdp", link=ulink)
        out.append(rs)
        if rep_axes:
            shard_bytes = unit_bytes[u] / un
            rep_n, rep_link = math.prod(reh.mesh.size(a) for a in rep_axes), cluster.group_link(rep_axes)
            out.append(Collective("all_reduce", ",".join(rep_axes), shard_bytes,
                                  collective_time_s("all_reduce", shard_bytes, rep_n, rep_link), u or "", "bwd", after,
                                  blocking=False, needed_before=None, source="fsdp", follows=rs, link=rep_link))
    if dp.reshard_after_forward:  # a block gathered with the units nested in it
        tops = [u for u in fsdp_units(reh.model) if u]
        nested = {t: gather_bytes[t] + sum(gather_bytes[g] for g in groups if within(g, t)) for t in tops}
        gathered = gather_bytes[""] + 2 * max(nested.values(), default=0.0)
    else:
        gathered = sum(gather_bytes.values())
    # FSDP2's hooks per unit per step (NOTE [FSDP2 units]): half where its forward starts, half where its
    # backward starts
    hw = cluster.rank_hardware()
    for u in units:
        if not unit_bytes[u]:
            continue
        host_s = fsdp_host_s(1, unit_params[u], hw)
        for where in (first_fwd.get(u), first_bwd.get(u)):
            if where is not None:
                segs[where] = dataclasses.replace(segs[where], compute_s=segs[where].compute_s + host_s / 2)
    # FSDP2's copies around each collective (copy-in of the shard / gradient, copy-out of the gathered
    # parameter / reduced shard): 2 (full + shard) bytes moved, on the compute stream where it runs
    for c in out:
        if c.kind == "all_reduce":  # HSDP's all-reduce works on the reduce-scatter's output in place
            continue
        where = c.needed_before if c.kind == "all_gather" else c.issue_after
        if where is not None and 0 <= where < len(segs):
            cp = fsdp_copy_s(c.nbytes, group(c.module)[1], hw)
            segs[where] = dataclasses.replace(segs[where], compute_s=segs[where].compute_s + cp)
    return out, gathered, divisors


