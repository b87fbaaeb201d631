"""The price of a pipelined schedule: its stages timed from one rehearsed micro-batch and laid out as the
schedule orders them (NOTE [pipeline price]).

NOTE [pipeline price]: the schedule is rehearsed once without its pipeline primitives, on one micro-batch (the
batch / n_microbatches), on rank 0 of the same mesh (tensor-parallel shards, their collectives, checkpoints and
everything else the log says apply as built). Each record of that step belongs to a stage
(`facts.stage_of_records`). Per stage and micro-batch:
- F, the forward's compute (`treadle.pricing.step.segments`: roofline, per-op overhead) plus its blocking
  tensor-parallel collectives; B the backward's and recomputation's, the loss's on the last stage; for a
  zero-bubble schedule W, the weight gradients, is half the backward's matrix products and I = B - W plus
  the split's host cost (`split_backward_op_s` per backward op: torch's walk over the stage's autograd graph,
  its second autograd pass and hooks; measured by `calibrate_cpu`, 0 on the GPU presets); W also runs the
  stage's checkpointed blocks' forwards again (their recompute is freed by I's pass: counted, a checkpointed
  module's forward runs three times under `stage_backward_input` then `stage_backward_weight`, twice under
  `stage_backward`; NOTE [zero-bubble schedules in the plan] in `kinds.py`);
- the point-to-point send across boundary b: every tensor the cut module returns (`send_recv_time_s` on the
  pp axis's link), for the activation and for its gradient;
- memory: A_s the bytes autograd saves in the stage's forward; its static bytes are the parameters of the
  modules it holds (local shards, a tied parameter on each rank that reads it), their optimizer state, the
  buffers, and the inputs on the first stage's rank; its transient the largest live excess of its records over
  what the earlier stages saved and the later stages' gradients.
The timeline is `timeline.simulate` (NOTE [pipeline timeline]) over `facts.action_order`. A rank's step is its
last action's end plus the optimizer step over its parameters, plus the all-reduce of tied gradients over pp,
plus, under data parallelism (shard=False; each replica rehearsed on its part of the micro-batch), the replicas'
gradient all-reduce after the step, in the runtime's buckets (`runtime.replica_buckets`) (blocking, nothing to hide behind);
the price's step is the slowest rank's. Under FSDP2 / HSDP, NOTE [pipeline FSDP2 price]. A rank's peak is its static bytes, the largest sum over its stages of
micro-batches in flight (forward done, backward not yet) times A_s as its actions run — a zero-bubble schedule
keeps them from I to W, with the gradients of the stage's matrix-product outputs that W reads (their forward
output bytes), and W frees them all (NOTE [a split backward's memory]) — with, at each action, the gradients its
stages hold by then and a backward's working set (NOTE [a stage's gradients at its peak]).

NOTE [a stage's gradients at its peak]: a stage's gradients accumulate over its micro-batches, so from its first
backward (B, or a split backward's W) to the step's end they are held beside whatever activations are in flight.
A rank's peak is the most, over its actions, of: the activations in flight (before or after the action), the
gradients of its stages that have run a backward, FSDP2's gathered stages, and, while a B or I runs, the stage's
transient: the largest live excess of its rehearsed records over what the earlier stages saved and the later stages'
gradients (the loss's working set on the last stage: NOTE [a backward's working set] in `treadle.planner.grad_live`),
that excess net of the stage's own gradients rehearsed so far (its modules' parameters from their first backward
record) once they are counted as held. And at the step's end: every gradient and a replica's flattened bucket.
The earlier price added one transient, with every local stage's gradients but the stage's own, at the activations'
worst moment: so from a stage's second micro-batch on its own gradients were missing (tiny LLaMA PP2 1F1B, 8
micro-batches: rank 0 2.36 MB priced, 2.62 MB with them; the planner's MILP counted them, in static).

NOTE [a split backward's memory]: a split backward runs I with ``retain_graph=True``; the stage's graph then lives
while W's parameter groups hold its nodes, and dies at W (every saved tensor with it), unless something else holds
the graph. torch's schedules did, on the last stage: ``step(return_outputs=True)`` (the default) keeps each
micro-batch's stage output for a merged return, and an output that is a view (logits are) is not detached after its
backward, so the last stage's graph lived to the step's end; the runtime steps with ``return_outputs=False`` (NOTE
[the last stage's outputs] in `runtime.py`). Traced (rank 0 of ZBV, stages 0 and 3, 8 micro-batches, tiny LLaMA;
saved storages live after each action, each freed when its storage dies): stage 3's W frees all 0.73 MiB of a
micro-batch (0.27 with the outputs kept), and nothing stays to the step's end but the stages' received inputs.
An earlier measurement (pack hooks that held the saved tensor) kept any node that saves its own output alive
through a cycle no collector breaks, and reported middle stages keeping a quarter of their bytes: not so.

NOTE [pipeline FSDP2 price]: with FSDP2 / HSDP beside the pipeline, each stage's units (`_stage_units`: the
model's FSDP2 units inside it, the rest in its root, and the units on axes of their own nested in them — the local
experts, NOTE [experts under FSDP2] — each collective of those over its own group and link, and their parameters
and optimizer state 1/m of the local experts, m that group's size) are gathered, held and reduced as NOTE [pipeline
FSDP2] in
`fsdp.py` states for the schedule's order, and priced per action (`fsdp.fsdp_terms`), inside the timeline:
- an action that gathers its stage waits for the exposed part of gathering it one unit ahead over that pass's
  segments (`treadle.forms.data.price.prefetched_gathers`, NOTE [overlap model]), plus FSDP2's copies;
- an UNSHARD's prefetch is issued before an action and waited on by the stage's next compute action: blocking
  where the device does not overlap, else exposed by what the actions between do not hide;
- every F, B, I (and the first stage's W) runs the stage's FSDP2 hooks: half of `fsdp_host_s` per unit, except
  that a stage kept gathered (no reshard after forward) pays it only where the action gathers it (an UNSHARD's
  prefetch: at the action it is issued before) and half of `fsdp_kept_host_s` elsewhere (its hooks only);
- after a stage's last backward its REDUCE_GRAD reduce-scatters every unit (HSDP: then all-reduces the shard)
  and waits for them.
Memory: parameters and optimizer state are 1/n of the rank's (n the shard group), gradients full-size (they
accumulate unsharded until the reduce-scatter), and while an action runs the rank holds every gathered stage in
full (a forward that reshards about two units of its own): the largest sum of activations in flight and gathered
bytes over the rank's actions, its excess over the activations' own peak counted as transient
(`gathered_bytes` per rank).
"""

from __future__ import annotations

import math

import torch

from ...cost.collective_cost import collective_time_s, send_recv_time_s
from ...errors import PlanError
from ...profile.flops import MATMUL_WEIGHT_GRAD_SHARE
from ...profile.memory import buffer_bytes
from ...profile.profiler import model_flops
from ...profile.recorder import _tensors
from ...profile.roofline import mfu as mfu_of
from ...pricing.rehearsal import rehearse, split_batch
from ...pricing.result import Price, PriceRow
from ...pricing.step import group_collective_s, segments
from ...runtime.optimizer import adamw_fixed_s, adamw_tensor_s
from ..data.facts import foreign_params, fsdp_units, shard_units, within
from .facts import action_order, block_stage, overlap_pairs, stage_of_records, stage_ranks
from .fsdp import fsdp_states, fsdp_terms
from .conflicts import fsdp_split_conflict, split_backward_conflict
from .runtime import replica_buckets
from .timeline import simulate

def price_pipeline(sch, example_inputs: dict, cluster, options: dict) -> Price | None:
    """The price of `sch` when it is a pipeline (NOTE [pipeline price]); None when it is not. Raises PlanError for
    cuts without `pipeline(...)`, or what `build` refuses (an order the schedule class refuses, a split backward
    under FSDP2 resharding after forward, a parameter two stages of a rank share under a split backward)."""
    v = sch.view()
    cfg = v.extras.get("pipeline")
    cuts = list(v.extras.get("pipeline_cuts", []))
    if cfg is None:
        if cuts:
            raise PlanError(f"price: cut_pipeline_stage at {cuts} without sch.pipeline(...): the model is not "
                            f"pipelined; call pipeline(axis=..., schedule=..., n_microbatches=...)")
        return None
    if options.get("execution", "eager") != "eager":
        raise PlanError("price: a pipeline schedule runs eager (treadle.run refuses --compile for it: its stages "
                        "are graphs of the captured model); price it with execution='eager'")
    dp = v.data_parallel
    axis, kind, m = cfg["axis"], cfg["schedule"], cfg["n_microbatches"]
    sharded = dp is not None and dp.shard and dp.shard_size(sch.mesh) > 1
    if (why := fsdp_split_conflict(kind, dp)) is not None:  # build refuses it
        raise PlanError(f"price: {why}")
    mesh = sch.mesh
    pp, n_stages = mesh.size(axis), len(cuts) + 1
    order = action_order(kind, n_stages, pp, m)
    ranks_of = stage_ranks(order)
    hw = cluster.rank_hardware()
    loss_fn = options.get("loss_fn")
    useful = options.get("useful_flops")
    useful = float(model_flops(v.reference, dict(example_inputs), loss_fn=loss_fn) if useful is None else useful)
    mb = split_batch(dict(example_inputs), m, by=f"n_microbatches={m}")
    reh = rehearse(sch, mb, hw, loss_fn, gpu=not cluster.is_cpu(), unpipelined=True, watch=tuple(cuts))
    recs = reh.records
    stage_of = stage_of_records(recs, cuts)
    segs, seg_of = segments(recs, hw, reh.checkpoints, selective=reh.selective)
    seg_stage = [0] * len(segs)
    for i, s in zip(seg_of, stage_of):
        seg_stage[i] = s
    # per stage and micro-batch: compute and blocking tensor-parallel collectives by phase
    fwd = [0.0] * n_stages
    bwd = [0.0] * n_stages
    rec = [0.0] * n_stages
    tp = [0.0] * n_stages
    for sg, s in zip(segs, seg_stage):
        if sg.phase == "fwd":
            fwd[s] += sg.compute_s
        elif sg.phase == "recompute":
            rec[s] += sg.compute_s
        else:
            bwd[s] += sg.compute_s
    coll_rows = []
    for n_before, module, phase, ckind, cax, nbytes in reh.collectives:
        s = stage_of[n_before - 1] if n_before > 0 else 0
        t = group_collective_s(ckind, nbytes, reh.mesh, cluster, cax)[0]
        tp[s] += t
        (fwd if phase == "forward" else bwd)[s] += t
        coll_rows.append((s, module, phase, ckind, cax, nbytes, t))
    weight = [0.0] * n_stages
    n_bwd = [0] * n_stages
    for r, s in zip(recs, stage_of):
        if r.phase == "backward":
            n_bwd[s] += 1
            if r.kind == "matmul":  # the planner's rule too (`StrategyCost.w_s`, `w_held_bytes`)
                weight[s] += MATMUL_WEIGHT_GRAD_SHARE * (r.time_s + hw.op_overhead_s)
    split_host = [n * hw.split_backward_op_s for n in n_bwd]  # the split's own host cost (NOTE [framework overheads])
    duration: dict[tuple[int, str], float] = {}
    for s in range(n_stages):
        back = bwd[s] + rec[s]
        w = min(weight[s], back)
        if s == 0:  # the first stage's I is empty and its W runs the whole backward (no input needs a gradient)
            duration.update({(0, "F"): fwd[0], (0, "B"): back, (0, "I"): 0.0, (0, "W"): back})
            split_host[0] = 0.0  # a whole backward: no split of its graph
            continue
        duration.update({(s, "F"): fwd[s], (s, "B"): back, (s, "I"): back - w + split_host[s],
                         (s, "W"): w + rec[s]})  # W recomputes the checkpointed blocks again
    link = cluster.link(axis)
    p2p = {}
    for b, c in enumerate(cuts):
        nbytes = reh.output_bytes.get(c, 0)
        p2p[b] = send_recv_time_s(nbytes, link) if nbytes and pp > 1 else 0.0
    # ---- per stage: parameters, activations, transients
    module_stage = _module_stages(recs, stage_of)  # a module outside the blocks: where its forward first ran

    def param_stage(name: str) -> int:
        mod = name.rpartition(".")[0]
        s = block_stage(mod, cuts)
        if s is not None:
            return s
        while mod and mod not in module_stage:
            mod = mod.rpartition(".")[0]
        return module_stage.get(mod, n_stages - 1)

    holders: dict[int, set[int]] = {}  # parameter -> the stages that read it (a tied one: several)
    objs: dict[int, torch.nn.Parameter] = {}
    names: dict[int, str] = {}
    for name, p in reh.model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), set()).add(param_stage(name))
        objs[id(p)] = p
        names.setdefault(id(p), name)
    conflict = split_backward_conflict(kind, pp, [(names[i], st) for i, st in holders.items()])
    if conflict:  # what build refuses is not priced
        raise PlanError(f"price: {conflict}")
    # reduced by another form (the local experts): not averaged, not in an FSDP2 unit, not sharded by it
    foreign_names = foreign_params(reh.model, reh.view)
    foreign = {id(p) for n, p in reh.model.named_parameters(remove_duplicate=False) if n in foreign_names}
    # FSDP2 units on axes of their own (the local experts: NOTE [experts under FSDP2]), inside their stage's units
    own = {u.path: u for u in shard_units(reh.model, reh.view)} if sharded else {}
    groups = {path: (",".join(u.shard_axes), math.prod(mesh.size(a) for a in u.shard_axes),
                     cluster.group_link(u.shard_axes), math.prod(mesh.size(a) for a in u.replicate_axes),
                     cluster.group_link(u.replicate_axes) if u.replicate_axes else None) for path, u in own.items()}
    own_div = {id(p): groups[path][1] for path in own
               for p in reh.model.get_submodule(path).parameters()}  # split over their unit's ranks
    fs = None
    if sharded:  # NOTE [pipeline FSDP2 price]
        fs = fsdp_terms(fsdp_states(kind, order, dp.reshard_after_forward), order,
                        _stage_units(reh.model, param_stage, foreign_names, tuple(own)),
                        _unit_passes(segs, seg_stage, reh.model, tuple(own)), duration,
                        dp=dp, mesh=mesh, cluster=cluster, hw=hw, groups=groups)
    tl = simulate(order, duration, stage_rank=ranks_of, p2p_s=p2p, extra_s=fs.extra_s if fs else None,
                  sent_after=overlap_pairs(kind, n_stages, pp, m))
    opt_b = options.get("optimizer_bytes_per_elem", 8)
    master = options.get("master_copy", True)
    saved = [0.0] * n_stages
    held = [0.0] * n_stages  # what a split backward keeps from I to W: the gradients of the weight ops' outputs
    for r, s in zip(recs, stage_of):
        if r.phase == "forward":
            saved[s] += r.saved_bytes
            if r.kind == "matmul":
                held[s] += r.output_bytes
    grads = [0.0] * n_stages
    for i, stages in holders.items():
        p = objs[i]
        if p.requires_grad:
            for s in stages:
                grads[s] += p.numel() * p.element_size()
    trans = [0.0] * n_stages  # NOTE [a stage's gradients at its peak]: with its own gradients so far, and without
    trans_ex = [0.0] * n_stages
    own_grads = [0.0] * n_stages
    module_grads: dict[str, float] = {}
    for i, p in objs.items():
        if p.requires_grad:
            mod = names[i].rpartition(".")[0]
            module_grads[mod] = module_grads.get(mod, 0.0) + p.numel() * p.element_size()
    reached: set[str] = set()
    for r, s in zip(recs, stage_of):
        if r.phase != "forward" and r.module not in reached:  # its parameters' gradients exist from here
            reached.add(r.module)
            own_grads[s] += module_grads.get(r.module, 0.0)
        before = sum(saved[:s]) + (sum(grads[s + 1:]) if r.phase != "forward" else 0.0)
        trans[s] = max(trans[s], r.live_after_bytes - before - saved[s])
        trans_ex[s] = max(trans_ex[s], r.live_after_bytes - before - saved[s] - own_grads[s])
    buffers = buffer_bytes(reh.model)
    input_b = sum(t.numel() * t.element_size() for t in _tensors(dict(example_inputs)))
    tied = [i for i, stages in holders.items() if len({ranks_of[s] for s in stages}) > 1]
    tied_b = sum(objs[i].numel() * objs[i].element_size() for i in tied if objs[i].requires_grad)
    zero_n = fs.n if fs else 1  # the ranks parameters, optimizer state and (after the step) gradients split over
    tied_s = collective_time_s("all_reduce", tied_b / zero_n, pp, link) if tied_b and pp > 1 else 0.0
    replicas = dp.size(mesh) if dp is not None and not sharded else 1
    dp_link = cluster.group_link(dp.axes) if replicas > 1 else None
    split = any(a.kind == "W" for acts in order.values() for a in acts)
    subclass = fs is not None or any(hasattr(p, "to_local") for p in objs.values())
    ranks = {}
    for rank in range(pp):
        mine = [s for s in range(n_stages) if ranks_of[s] == rank]
        params = [objs[i] for i, st in holders.items() if any(s in mine for s in st)]
        trainable = [p for p in params if p.requires_grad]
        def div(p) -> int:
            return 1 if id(p) in foreign else own_div.get(id(p), zero_n)

        static = sum(p.numel() * p.element_size() / div(p) for p in params) + buffers + (input_b if 0 in mine else 0)
        static += sum(p.numel() * (opt_b + (4 if master and p.dtype != torch.float32 else 0)) / div(p)
                      for p in trainable)
        opt_s = (math.fsum(adamw_tensor_s(p.numel() / div(p), p.dtype, opt_b, hw, subclass=subclass)
                           for p in trainable) + adamw_fixed_s(hw, subclass=subclass))
        act = peak_act = peak_held = level = grads_done = 0.0
        done: set[int] = set()  # stages whose gradients exist (accumulated from their first backward on)
        gathered = fs.gathered[rank] if fs else [0.0] * len(tl.slots[rank])
        for slot, held_b in zip(tl.slots[rank], gathered):
            a = slot.action
            before = act
            if a.kind == "F":
                act += saved[a.stage]
            elif a.kind == "I":  # the graph is kept for W, with the output gradients W reads
                act += held[a.stage]
            elif a.kind == "W":  # NOTE [a split backward's memory]: the stage's graph dies with W
                act -= held[a.stage] + saved[a.stage]
            elif a.kind == "B":
                act -= saved[a.stage]
            peak_act = max(peak_act, act)
            peak_held = max(peak_held, max(before, act) + held_b)  # with what FSDP2 holds gathered meanwhile
            # NOTE [a stage's gradients at its peak]: the gradients done so far, and a backward's working set
            extra = 0.0
            if a.kind in ("B", "I"):
                extra = max(0.0, trans_ex[a.stage]) if a.stage in done else max(0.0, trans[a.stage])
            level = max(level, max(before, act) + grads_done + extra + held_b)  # (and FSDP2's gathered stages)
            if a.kind in ("B", "W") and a.stage not in done:
                done.add(a.stage)
                grads_done += grads[a.stage]
        end = max((sl.end_s for sl in tl.slots[rank]), default=0.0)
        dp_s, bucket_b = _replica_allreduce([p for p in trainable if id(p) not in foreign], replicas, dp_link)
        level = max(level, act + grads_done + bucket_b)  # the step's end: every gradient, the flattened bucket
        transient = level - peak_act
        if fs:
            dp_s = fs.gather_s[rank] + fs.reduce_s[rank]  # inside the actions' time (the timeline has them)
        ranks[rank] = {"stages": mine, "step_s": end + opt_s + tied_s + (0.0 if fs else dp_s), "optimizer_s": opt_s,
                       "dp_s": dp_s, "fsdp_gather_s": fs.gather_s[rank] if fs else 0.0,
                       "fsdp_reduce_s": fs.reduce_s[rank] if fs else 0.0,
                       "busy_s": tl.busy_s[rank], "bubble_s": end - tl.busy_s[rank],
                       "static_bytes": static, "activation_bytes": peak_act, "transient_bytes": max(0.0, transient),
                       "gathered_bytes": peak_held - peak_act,
                       "peak_bytes": static + peak_act + max(0.0, transient)}
    slow = max(ranks, key=lambda r: ranks[r]["step_s"])
    big = max(ranks, key=lambda r: ranks[r]["peak_bytes"])
    rs = ranks[slow]
    mine = rs["stages"]
    compute = m * sum(fwd[s] + bwd[s] - tp[s] for s in mine) + rs["optimizer_s"]
    recompute = m * sum(rec[s] for s in mine)
    step = rs["step_s"]
    comm_total = m * sum(tp[s] for s in mine) + tied_s + rs["dp_s"] + sum(2 * m * p2p[b] for b in p2p
                                                             if ranks_of[b] == slow or ranks_of[b + 1] == slow)
    exposed = max(0.0, step - compute - recompute)
    dtype = next((p.dtype for p in reh.model.parameters()), torch.float32)
    mfu = mfu_of(int(useful / mesh.world_size), step, hw, dtype) if step > 0 else 0.0
    executed = m * float(sum(r.flops for r, s in zip(recs, stage_of) if s in mine
                             and r.phase in ("forward", "backward")))
    rows = _rows(segs, seg_stage, coll_rows, mine, m)
    stages = [{"stage": s, "rank": ranks_of[s], "forward_s": fwd[s], "backward_s": bwd[s] + rec[s],
               "weight_s": duration[(s, "W")] if split else 0.0, "tp_comm_s": tp[s], "saved_bytes": saved[s],
               "split_host_s": split_host[s] if split else 0.0,
               "grad_bytes": grads[s], "transient_bytes": max(0.0, trans[s]),
               "send_bytes": reh.output_bytes.get(cuts[s], 0) if s < len(cuts) else 0,
               "send_s": p2p.get(s, 0.0)} for s in range(n_stages)]
    slots = [{"rank": sl.rank, "stage": sl.action.stage, "kind": sl.action.kind, "mb": sl.action.mb,
              "start_s": sl.start_s, "end_s": sl.end_s} for v_ in tl.slots.values() for sl in v_]
    seg_dicts = [{"module": f"stage {sl.action.stage}", "phase": {"F": "fwd", "W": "bwd"}.get(sl.action.kind, "bwd"),
                  "start_s": sl.start_s, "compute_s": sl.end_s - sl.start_s, "flops": None, "bytes": None,
                  "ops": None} for sl in tl.slots[slow]]
    info = {"schedule": kind, "axis": axis, "n_microbatches": m, "n_stages": n_stages, "slowest_rank": slow,
            "largest_rank": big, "bubble_fraction": tl.bubble_fraction, "bubble_s": rs["bubble_s"],
            "makespan_s": tl.makespan_s, "tied_grad_allreduce_s": tied_s, "data_parallel": str(dp) if dp else None,
            "dp_grad_allreduce_s": 0.0 if fs else rs["dp_s"], "fsdp_gather_s": rs["fsdp_gather_s"],
            "fsdp_reduce_s": rs["fsdp_reduce_s"],
            "critical_path": [str(a) for a in tl.critical_path], "stages": stages,
            "ranks": {str(r): d for r, d in ranks.items()}, "slots": slots}
    rb = ranks[big]
    grad_b = sum(grads[s] for s in rb["stages"])
    return Price(step, compute, recompute, comm_total, exposed, max(0.0, comm_total - exposed), rb["peak_bytes"],
                 rb["static_bytes"], rb["activation_bytes"], rb["transient_bytes"], grad_b, mfu, useful, executed,
                 cluster.rank_device(), f"pipeline {kind} over {axis}" + (f" x {dp}" if dp else ""), rows, seg_dicts, [], info)


def _replica_allreduce(trainable: list[torch.nn.Parameter], replicas: int, link) -> tuple[float, float]:
    """(seconds, largest bucket's bytes) of averaging a rank's gradients over `replicas` data-parallel replicas
    after the step, as the pipeline's runtime does: one blocking all-reduce per `runtime.replica_buckets`
    bucket. (0, 0) without replicas."""
    if replicas <= 1 or not trainable:
        return 0.0, 0.0
    nbytes = [sum(p.numel() * p.element_size() for p in b) for b in replica_buckets(trainable)]
    return math.fsum(collective_time_s("all_reduce", b, replicas, link) for b in nbytes), float(max(nbytes))


def _stage_units(model: torch.nn.Module, param_stage, foreign: set[str] = frozenset(),
                 own: tuple[str, ...] = ()) -> dict[int, dict[str, tuple[float, float, int]]]:
    """Stage -> FSDP2 unit -> (parameter bytes, trainable bytes, parameter count), as `build` wraps each stage: the
    units on axes of their own (`own`: the local experts under FSDP2), the model's units inside it (NOTE [FSDP2
    units]), the rest of its parameters in its root ""; the `foreign` parameters (FSDP2's `ignored_params`: the
    local experts under DDP or ZeRO-3 over the expert axes alone) in none."""
    units = list(own) + fsdp_units(model)
    out: dict[int, dict[str, list]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in foreign:
            continue
        u = next(x for x in units if within(name.rpartition(".")[0], x))
        row = out.setdefault(param_stage(name), {}).setdefault(u, [0.0, 0.0, 0])
        nbytes = p.numel() * p.element_size()
        row[0] += nbytes
        row[1] += nbytes if p.requires_grad else 0.0
        row[2] += 1
    return {s: {u: tuple(r) for u, r in us.items()} for s, us in out.items()}


def _unit_passes(segs, seg_stage: list[int], model: torch.nn.Module,
                 own: tuple[str, ...] = ()) -> dict[tuple[int, str], list]:
    """(stage, "fwd" / "bwd") -> the stage's segments of that pass in order, each with its FSDP2 unit (`own`: the
    units nested in the blocks, on axes of their own)."""
    units = list(own) + fsdp_units(model)
    out: dict[tuple[int, str], list] = {}
    for sg, s in zip(segs, seg_stage):
        phase = "fwd" if sg.phase == "fwd" else "bwd"
        out.setdefault((s, phase), []).append((sg, next(x for x in units if within(sg.module, x))))
    return out


def _module_stages(records, stage_of: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r, s in zip(records, stage_of):
        if r.phase == "forward":
            out.setdefault(r.module, s)
    return out


def _rows(segs, seg_stage, coll_rows, mine: list[int], m: int) -> list[PriceRow]:
    """Per module and phase of the slowest rank's stages, over the step's `m` micro-batches."""
    rows: dict[tuple[str, str], PriceRow] = {}
    for sg, s in zip(segs, seg_stage):
        if s in mine:
            r = rows.setdefault((sg.module, sg.phase), PriceRow(sg.module, sg.phase))
            r.compute_s += m * sg.compute_s
    for s, module, phase, ckind, cax, _, t in coll_rows:
        if s in mine:
            ph = {"forward": "fwd", "backward": "bwd"}.get(phase, phase)
            r = rows.setdefault((module, ph), PriceRow(module, ph))
            r.comm_s.setdefault(cax, {})
            r.comm_s[cax][ckind] = r.comm_s[cax].get(ckind, 0.0) + m * t
            r.exposed_comm_s += m * t
    return list(rows.values())
