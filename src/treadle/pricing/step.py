"""`price(sch, example_inputs, cluster)`: the step of a rehearsed schedule priced — compute segments, every
collective on its axis's channel, each parallel form's part, the optimizer, the timeline and the memory."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..cost.cluster import ClusterSpec
from ..cost.collective_cost import collective_time_s
from ..cost.overlap import Collective, Segment, Timeline, simulate
from ..errors import PlanError
from ..form import forms
from ..profile.memory import buffer_bytes
from ..profile.recorder import _tensors
from ..profile.profiler import model_flops
from ..profile.roofline import mfu as mfu_of
from ..runtime.optimizer import adamw_fixed_s, adamw_tensor_s, trainable_params
from ..runtime.recompute import recompute_host_s, selective_host_s
from ..schedule.expert_primitive import axes_label, expert_paths
from ..schedule.tree import within
from .compiled import EXECUTIONS, compiled_times, compiled_units
from .rehearsal import Rehearsal, rehearse
from .result import Price, PriceRow

logger = logging.getLogger(__name__)

_PHASE = {"forward": "fwd", "backward": "bwd", "recompute": "recompute"}


@dataclass(slots=True)
class StepContext:
    """What a form's `price_step` sees: the rehearsal (`reh`: the rank's model, mesh, the replayed schedule's
    view), the step's compute `segments` in order (a form may add host work to one; its index is where a
    collective is issued or needed), the cluster and the rank's device spec `hw`."""

    reh: Rehearsal
    segments: list[Segment]
    cluster: ClusterSpec
    hw: object



def group_collective_s(kind: str, nbytes: float, mesh, cluster: ClusterSpec, label: str) -> tuple[float, Any]:
    """(seconds, link) of a rehearsed collective on the group named `label`: one mesh axis, or the flattened
    axes of an expert group joined by "," (`axes_label`), on their `ClusterSpec.group_link`."""
    axes = tuple(label.split(","))
    link = cluster.group_link(axes)  # one axis: its own link
    return collective_time_s(kind, nbytes, math.prod(mesh.size(a) for a in axes), link), link

def segments(records, hw, regions: tuple[str, ...] = (), times: list[float] | None = None,
             selective: tuple[str, ...] = ()) -> tuple[list[Segment], list[int]]:
    """Consecutive records of one (module, phase) merged, each op its roofline time plus the device's per-op
    overhead (`hw.op_overhead_s`), or its `times` entry where given (a compiled step: `treadle.pricing.compiled`);
    a recomputed op also pays checkpointing's host cost, and each checkpointed
    region of `regions` (module paths) once, at its first recomputed op (`treadle.runtime.recompute
    .recompute_host_s`: NOTE [framework overheads]); an op in a region of `selective` (eager: `times` is None), forward
    or recomputed, pays selective checkpointing's dispatch modes, and each such region once, at its first op
    (`selective_host_s`). Returns segments and, per record, its segment."""
    segs: list[Segment] = []
    seg_of: list[int] = []
    acc = 0.0
    key = None
    seen: set[str] = set()
    sel_seen: set[str] = set()
    for i, r in enumerate(records):
        k = (r.module, _PHASE.get(r.phase, r.phase))
        if k != key:
            if key is not None:
                segs.append(Segment(key[0], key[1], acc))
            key, acc = k, 0.0
        acc += (r.time_s + hw.op_overhead_s) if times is None else times[i]
        if r.phase == "recompute":
            acc += recompute_host_s(hw, ops=1, regions=0)
            region = next((p for p in regions if within(r.module, p)), None)
            if region is not None and region not in seen:
                seen.add(region)
                acc += recompute_host_s(hw, ops=0, regions=1)
        if selective and times is None and r.phase in ("forward", "recompute"):
            region = next((p for p in selective if within(r.module, p)), None)
            if region is not None:
                acc += selective_host_s(hw, ops=1, regions=region not in sel_seen)
                sel_seen.add(region)
        seg_of.append(len(segs))
    if key is not None:
        segs.append(Segment(key[0], key[1], acc))
    return segs, seg_of


def price(sch, example_inputs: dict, cluster: ClusterSpec, *, optimizer_bytes_per_elem: int = 8,
          master_copy: bool = True, loss_fn=None, execution: str = "eager",
          useful_flops: float | None = None) -> Price:
    """Price one training step of `sch` (an unbuilt Schedule) on `cluster` (see `treadle.pricing`).

    `example_inputs`: keyword arguments of forward, global batch (the data-parallel axis splits dim 0).
    `optimizer_bytes_per_elem` (AdamW: 8) and `master_copy` (fp32 copy of lower-precision parameters)
    as in the planner's `TrainSpec`. `loss_fn(output)` defaults to `treadle.loss.default_loss`.
    `cluster` is seen through the schedule's mesh (`ClusterSpec.for_mesh`: same world size).
    `execution`: "eager", or "compiled" (the blocks under `torch.compile` as `treadle.run --compile` runs them:
    NOTE [compiled step] in `treadle.pricing.compiled`); the price says which (`Price.execution`).
    `useful_flops`: the model's useful FLOPs of the whole step (MFU's numerator), where the caller has them for
    this model and these inputs (the planner prices several schedules of one model); else counted here.
    Raises PlanError for a schedule that cannot be rehearsed (pipeline, already built, a batch the
    data-parallel axis does not divide, a mesh mismatch, inside a running process group).
    """
    if not isinstance(example_inputs, dict):
        raise PlanError("price: example_inputs must be a dict of keyword arguments of forward")
    if cluster.world_size != sch.mesh.world_size:
        raise PlanError(f"price: the schedule is written for {sch.mesh} ({sch.mesh.world_size} ranks) but the "
                        f"cluster has {cluster.world_size} ranks ({cluster.mesh}); give a cluster of that size")
    if execution not in EXECUTIONS:
        raise PlanError(f"price: execution must be one of {list(EXECUTIONS)}, got {execution!r:.40}")
    cluster = cluster.for_mesh(sch.mesh)
    options = {"optimizer_bytes_per_elem": optimizer_bytes_per_elem, "master_copy": master_copy, "loss_fn": loss_fn,
               "execution": execution, "useful_flops": useful_flops}
    for f in forms():  # a form that owns the step's timeline prices it whole (the pipeline)
        if (whole := f.price_schedule(sch, example_inputs, cluster, options)) is not None:
            return whole
    device = cluster.rank_device()
    hw = cluster.rank_hardware()
    # the model's useful FLOPs of the whole step (MFU's numerator, the same rules as `treadle.run`'s)
    useful = float(model_flops(sch.view().reference, dict(example_inputs), loss_fn=loss_fn)
                   if useful_flops is None else useful_flops)
    reh = rehearse(sch, example_inputs, hw, loss_fn, gpu=not cluster.is_cpu(), flows=execution == "compiled")
    times = (compiled_times(reh.records, reh.flows, compiled_units(reh.model), hw) if execution == "compiled"
             else None)
    segs, seg_of = segments(reh.records, hw, reh.checkpoints, times, reh.selective)
    colls: list[Collective] = []
    experts = expert_paths(reh.view.extras)
    for n_before, module, phase, kind, axis, nbytes in reh.collectives:
        after = seg_of[n_before - 1] if n_before > 0 else -1
        t, link = group_collective_s(kind, nbytes, reh.mesh, cluster, axis)
        # what the built model issues itself: tensor parallelism's collectives (an experts module's sum over the
        # tensor axis splitting each expert included), or an experts module's exchanges on its expert axes
        owner = next((p for p in experts if module == p or module.startswith(p + ".")), None)
        source = "ep" if owner is not None and axis == axes_label(experts[owner]) else "tp"
        colls.append(Collective(kind, axis, nbytes, t, module, _PHASE.get(phase, phase), after, source=source,
                                link=link))
    # each parallel form's part of the step (data parallelism: DDP's buckets, FSDP2's gathers and copies)
    ctx = StepContext(reh, segs, cluster, hw)
    terms = [t for f in forms() if (t := f.price_step(ctx)) is not None]
    for t in terms:
        colls += t.collectives
    gathered = math.fsum(t.gathered_bytes for t in terms)
    zero_n = math.prod(t.param_divisor for t in terms)  # ranks parameters, gradients and optimizer state split over
    subclass = any(t.subclass_params for t in terms)
    dp_kind = next((t.label for t in terms if t.label), "none")
    # the optimizer step: elementwise over the local parameters, one pass fused or eight (NOTE [AdamW traffic])
    n_opt = len(segs)
    local = trainable_params(reh.model)
    foreign = frozenset().union(*(t.foreign for t in terms))  # another form's parameters: not split, not copied

    divisors = {n: d for t in terms for n, d in t.divisors.items()}  # a unit on axes of its own

    def divisor(name: str) -> int:
        return 1 if name in foreign else divisors.get(name, zero_n)

    opt_s = math.fsum(adamw_tensor_s(p.numel() / divisor(n), p.dtype, optimizer_bytes_per_elem, hw,
                                     subclass=subclass) for n, p in local) + adamw_fixed_s(hw, subclass=subclass)
    segs.append(Segment("", "optim", opt_s))
    for c in colls:
        if not c.blocking and c.needed_before is None:
            c.needed_before = n_opt  # gradients are reduced before the optimizer steps
    tl: Timeline = simulate(segs, colls, overlap=device.overlap)
    # ---- memory
    param_b = grad_b = opt_b = 0.0
    for n, p in local:
        elems = p.numel() / divisor(n)
        param_b += elems * p.element_size()
        grad_b += elems * p.element_size()
        opt_b += elems * (optimizer_bytes_per_elem + (4 if master_copy and p.dtype != torch.float32 else 0))
    frozen_b = sum(p.numel() * p.element_size() for p in reh.model.parameters() if not p.requires_grad)
    buffer_b = buffer_bytes(reh.model)
    input_b = sum(t.numel() * t.element_size() for t in _tensors(reh.inputs))
    # DDP's flat bucket buffers hold a copy of the grads (of those it reduces)
    copies_b = sum(t.grad_copies for t in terms) * math.fsum(p.numel() * p.element_size() / divisor(n)
                                                             for n, p in local if n not in foreign)
    static = param_b + frozen_b + opt_b + buffer_b + input_b + copies_b
    saved = float(sum(r.saved_bytes for r in reh.records if r.phase == "forward"))
    peak_live = max((r.live_after_bytes for r in reh.records), default=0)
    if zero_n > 1:  # the recorded full gradients are reduce-scattered to 1/zero_n (1/their unit's divisor)
        peak_live -= math.fsum(p.numel() * p.element_size() * (1 - 1 / divisor(n)) for n, p in local)
    transient = max(0.0, peak_live - saved) + gathered
    # ---- time split
    compute = math.fsum(s.compute_s for s in segs if s.phase != "recompute")  # forward, backward, optimizer
    recompute = math.fsum(s.compute_s for s in segs if s.phase == "recompute")
    executed = float(sum(r.flops for r in reh.records if r.phase in ("forward", "backward")))
    dtype = next((p.dtype for p in reh.model.parameters()), torch.float32)
    mfu = mfu_of(int(useful / cluster.world_size), tl.step_s, hw, dtype) if tl.step_s > 0 else 0.0
    rows = _rows(segs, reh.records, tl)
    seg_flops = [0.0] * len(segs)
    seg_bytes = [0.0] * len(segs)
    seg_ops = [0] * len(segs)
    for r, i in zip(reh.records, seg_of):
        seg_flops[i] += r.flops
        seg_bytes[i] += r.read_bytes + r.write_bytes
        seg_ops[i] += 1
    seg_dicts = [{"module": s.module, "phase": s.phase, "start_s": st, "compute_s": s.compute_s,
                  "flops": seg_flops[i] if i < n_opt else None, "bytes": seg_bytes[i] if i < n_opt else None,
                  "ops": seg_ops[i] if i < n_opt else None}
                 for i, (s, st) in enumerate(zip(segs, tl.segment_start_s))]
    coll_dicts = [{"kind": c.kind, "axis": c.axis, "nbytes": c.nbytes, "time_s": c.time_s, "module": c.module,
                   "phase": c.phase, "source": c.source, "blocking": c.blocking, "start_s": c.start_s,
                   "end_s": c.end_s, "exposed_s": c.exposed_s} for c in tl.collectives]
    out = Price(tl.step_s, compute, recompute, tl.comm_s, tl.exposed_comm_s, tl.overlapped_comm_s,
                static + saved + transient, static, saved, transient, grad_b, mfu, useful, executed, device,
                dp_kind, rows, seg_dicts, coll_dicts, execution=execution)
    logger.info("price %s: %s", sch.mesh, out)
    return out


def _rows(segs: list[Segment], records, tl: Timeline) -> list[PriceRow]:
    rows: dict[tuple[str, str], PriceRow] = {}
    for s in segs:
        r = rows.setdefault((s.module, s.phase), PriceRow(s.module, s.phase))
        r.compute_s += s.compute_s
    for rec in records:
        if rec.phase == "forward" and rec.saved_bytes:
            rows.setdefault((rec.module, "fwd"), PriceRow(rec.module, "fwd")).saved_bytes += rec.saved_bytes
    for c in tl.collectives:
        r = rows.setdefault((c.module, c.phase), PriceRow(c.module, c.phase))
        per = r.comm_s.setdefault(c.axis, {})
        per[c.kind] = per.get(c.kind, 0.0) + c.time_s
        r.exposed_comm_s += c.exposed_s
    return list(rows.values())


