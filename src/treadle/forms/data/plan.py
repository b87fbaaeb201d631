"""Data parallelism in the planner: the role options (which axes, DDP / ZeRO-3 / HSDP, reshard), the cost of each
parameter's gradient sync and FSDP2's copies, the role's constant terms, the exposure rows of the MILP, the memory
at the backward's end under DDP, the `data_parallel` decision and the role's label.

NOTE [bucketed data parallel]: the runtime reduces data-parallel gradients in buckets (DDP: 1 MiB first,
then 25 MiB) or per unit (FSDP2: every block and the root: a forward gather, a backward gather — none for
the root — and a reduce-scatter), overlapped with compute (`treadle.cost.overlap`). Per parameter the
cost graph keeps the bandwidth part of its sync (`StrategyCost.dp_comm_s`); the latency part is a
constant per role assignment, `DataTerms.latency_s` — ZeRO-3: every unit's collectives; DDP: the first
bucket's (and half the last's), each full bucket's latency being charged to the parameters in proportion to
their local gradient bytes (a tensor-parallel shard fills fewer buckets). What is exposed is

    E = max(0, latency_s + sum dp_comm_s - W)

with W what the reductions can hide behind — for DDP the backward: its compute and the tensor-parallel
communication it waits for (the input-gradient sums included); for ZeRO-3 all compute and all that
tensor-parallel communication (another axis's channel: `dp_window_s`, as `treadle.cost.overlap` runs it) —
when the rank's device overlaps communication (`ClusterSpec.rank_device().overlap`), else W = 0. The ILP
states E with two linear rows (`ilp_rows`); `evaluate` computes it directly.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ...cost.collective_cost import all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s
from ...errors import PlanError
from ...planner.capture import TensorMeta
from ...planner.ilp import _BYTES, _SECONDS, _block_exprs, _mccormick, first_template, head_units
from ...planner.policies import any_checkpointed
from ...planner.node_costs import _tensor_axes_divisor
from ...planner.to_schedule import DECISION_RANKS, Decision
from ...planner.variants import variants_of
from .facts import (DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, batch_statistics_modules, buffer_broadcast_s,
                    fsdp_copy_s, fsdp_host_s, fsdp_param_units)

DECISION_RANK = DECISION_RANKS["data_parallel"]


@dataclass(slots=True)
class DataTerms:
    """The role assignment's constants (NOTE [bucketed data parallel]): `latency_s` of the gradient
    reductions, `buffer_s` DDP's broadcast of the buffers every forward (never hidden: NOTE [DDP buffers]),
    `overlap` whether reductions hide behind compute, `window` "bwd" (DDP) or "all" (ZeRO-3): what they hide
    behind."""

    latency_s: float = 0.0
    buffer_s: float = 0.0
    overlap: bool = False
    window: str = "bwd"


def terms(cg) -> DataTerms | None:
    """The data-parallel terms of a cost graph (None without data parallelism over more than one rank)."""
    return cg.form_terms.get("data")


# ----------------------------------------------------------------------------- capture and roles
def capture_facts(model) -> dict:
    """The FSDP2 units other than the root that own trainable parameters, counted before capture shortens the
    model's lists (NOTE [FSDP2 units]: a unit without parameters costs nothing), and the training-mode batch
    norms (NOTE [batch statistics])."""
    return {"block_units": len(set(fsdp_param_units(model)) - {""}),
            "batch_statistics": tuple(batch_statistics_modules(model))}


def block_units(b) -> int:
    """FSDP2 units as `build` wraps them: every entry of every ModuleList (counted at capture; the repeated
    blocks when the graph does not say) and the root."""
    return 1 + ((b.g.facts.get("data") or {}).get("block_units") or sum(blk.weight for blk in b.g.blocks))


def role_options(mesh, live: tuple[str, ...], *, batch: int | None, request) -> list[dict]:
    """Data parallelism on any subset of the `live` axes (`request.dp_axis` "auto"; None: on none; an axis or
    a tuple: on exactly those) whose sizes' product divides the batch, as DDP, ZeRO-3 over all of them or HSDP
    (ZeRO-3 over some, replicated over the others; `request.replicate` fixes which, None searches).
    `request.zero`: None (DDP and ZeRO-3 / HSDP), False (DDP only), True (ZeRO-3 / HSDP only);
    `request.reshard_after_forward`: the FSDP2 flag (None: both). Raises PlanError for a data-parallel axis that
    is not live; none over a model with training-mode batch norms (the capture's facts: NOTE [batch
    statistics]), where an explicit data-parallel axis raises PlanError."""
    dp_axis, zero = request.dp_axis, request.zero
    norms = ((request.facts or {}).get("data") or {}).get("batch_statistics")
    if norms and dp_axis not in ("auto", None):
        raise PlanError(f"data-parallel axis {dp_axis!r}: {norms[0]!r} normalises over the batch in training mode, "
                        f"which data parallelism splits (NOTE [batch statistics]); plan with dp_axis='auto' or "
                        f"None, or convert the norms to SyncBatchNorm")
    if norms:
        return [{"dp": ()}]
    if dp_axis == "auto":
        dps = [c for k in range(len(live) + 1) for c in itertools.combinations(live, k)]
    elif dp_axis is None:
        dps = [()]
    else:
        want = (dp_axis,) if isinstance(dp_axis, str) else tuple(dp_axis)
        for a in want:
            if a not in live:
                raise PlanError(f"data-parallel axis {a!r} is not a live mesh axis of {mesh}; live axes: "
                                f"{list(live)}")
        dps = [tuple(a for a in mesh.names if a in want)]
    keep_flag = request.reshard_after_forward
    reshards = [True, False] if keep_flag is None else [bool(keep_flag)]
    out: list[dict] = []
    for dp in dps:
        if dp and batch is not None and batch % math.prod(mesh.size(a) for a in dp):
            continue
        if not dp:
            out.append({"dp": ()})
            continue
        if zero is not True:
            out.append({"dp": dp, "zero": False})
        if zero is False:
            continue
        reps = ([tuple(a for a, bit in zip(dp, bits) if bit) for bits in itertools.product((0, 1), repeat=len(dp))
                 if not all(bits)] if request.replicate is None else [tuple(a for a in dp if a in request.replicate)])
        for rep in sorted(reps, key=len):
            for keep in reshards:
                out.append({"dp": dp, "zero": True, "replicate": rep, "reshard_after_forward": keep})
    return out


def role_label(roles) -> str | None:
    """"data-parallel dp,tp (HSDP: shard tp, replicate dp), no reshard after forward" (None: no dp axes)."""
    if not roles.dp:
        return None
    how = (f" (HSDP: shard {','.join(roles.shard_axes)}, replicate {','.join(roles.replicate)})" if roles.replicate
           else " (ZeRO-3)" if roles.zero else "")
    keep = "" if roles.reshard_after_forward or not roles.zero else ", no reshard after forward"
    return f"data-parallel {','.join(roles.dp)}{how}{keep}"


# ----------------------------------------------------------------------------- cost graph
def prepare(b) -> None:
    """How parameters live under the role (read by the core's memory and optimizer terms): split over the ZeRO-3
    shard group (`param_divisor`), tensor subclasses in the optimizer step (`param_subclass`), and kept gathered
    from forward to backward without reshard (`gathered_kept`)."""
    roles = b.roles
    b.zero_size = math.prod(b.cluster.mesh.size(a) for a in roles.shard_axes)  # ranks one ZeRO-3 shard spans
    b.param_divisor = b.zero_size if roles.zero else 1
    b.param_subclass = roles.zero and b.zero_size > 1
    b.gathered_kept = roles.zero and not roles.reshard_after_forward


def param_cost(b, meta: TensorMeta, pl: tuple[int, ...], cost) -> None:
    """A parameter's gradient sync (bandwidth part: `param_sync_s`) and FSDP2's copies and host cost
    (`zero_copies_s`)."""
    cost.dp_comm_s += param_sync_s(b, meta, pl)
    z = zero_copies_s(b, meta, pl)
    cost.compute_s += z
    cost.fsdp_s += z


def zero_copies_s(b, meta: TensorMeta, pl: tuple[int, ...]) -> float:
    """FSDP2's local copies around its collectives (ZeRO-3 only): two gathers (one without reshard after
    forward) and one reduce-scatter of the parameter, each `fsdp_copy_s`, plus its per-parameter host cost
    (`fsdp_host_s`; NOTE [FSDP2 units])."""
    if not b.roles.zero or b.zero_size == 1:
        return 0.0
    full = meta.numel * meta.dtype.itemsize / _tensor_axes_divisor(pl, b.tp_sizes)
    n_coll = 3 if b.roles.reshard_after_forward else 2
    return n_coll * fsdp_copy_s(full, b.zero_size, b.hw, meta.dtype) + fsdp_host_s(0, 1, b.hw)


def param_sync_s(b, meta: TensorMeta, pl: tuple[int, ...]) -> float:
    """This parameter's part of the data-parallel sync: DDP's all-reduce (bandwidth, plus the per-bucket
    latency in proportion to its local gradient bytes: a tensor-parallel shard fills fewer buckets), or
    ZeRO-3's two all-gathers and one reduce-scatter, bandwidth only (NOTE [bucketed data parallel] in
    this module: the runtime moves gradients in buckets / units; ZeRO-3's per-unit latency is a constant).
    Several dp axes: one flattened group (`dp_link`). ZeRO-3 gathers and reduce-scatters over the shard
    axes; HSDP adds an all-reduce of the 1/zero_size shard over the replicate axes; without reshard after
    forward there is one gather, not two."""
    if not b.roles.dp or b.dp_size == 1:
        return 0.0
    nbytes = meta.numel * meta.dtype.itemsize / _tensor_axes_divisor(pl, b.tp_sizes)

    def bw(fn, b: float, n: int, link, ref: float) -> float:
        # NOTE [bandwidth per byte]: the runtime moves a parameter's gradient inside a bucket or a unit of
        # `ref` bytes, so a byte costs the slope of that collective, not of one the size of this parameter
        # alone: an all-reduce takes the cheaper of tree and ring *for the bucket* (a tree's slope is
        # 2 log2(n) bytes per byte against the ring's 2 (n-1)/n; summing per-parameter costs charged GPT-2
        # tiny's one DDP bucket on 4 ranks 2.1x its bandwidth). `ref` from the replicated model's gradients.
        ref = max(ref, b, 1.0)
        return (fn(ref, n, link) - fn(0.0, n, link)) * b / ref

    total = b.replicated_grad_bytes()
    if b.roles.zero:
        zn, zlink = b.zero_size, b.cluster.group_link(b.roles.shard_axes)
        gathers = 2 if b.roles.reshard_after_forward else 1
        unit = total / max(1, block_units(b))  # a unit's gathered bytes, on average
        out = (gathers * bw(all_gather_time_s, nbytes, zn, zlink, unit)
               + bw(reduce_scatter_time_s, nbytes, zn, zlink, unit))
        if b.roles.replicate:
            out += bw(all_reduce_time_s, nbytes / zn, b.dp_size // zn, b.cluster.group_link(b.roles.replicate),
                      unit / zn)
        return out
    # DDP: each full bucket pays one all-reduce latency, so a parameter pays it per bucket's worth of its
    # local gradient bytes (the first bucket's latency is the constant `DataTerms.latency_s`)
    link = b.cluster.group_link(b.roles.dp)
    per_bucket = all_reduce_time_s(0.0, b.dp_size, link)
    return (bw(all_reduce_time_s, nbytes, b.dp_size, link, min(total, DDP_BUCKET_BYTES))
            + per_bucket * nbytes / DDP_BUCKET_BYTES)



def graph_terms(b, cg) -> None:
    """NOTE [bucketed data parallel]: the latency constant, the overlap flag and window, DDP's buffer broadcast
    and FSDP2's per-unit host cost (NOTE [FSDP2 units])."""
    if not b.roles.dp or b.dp_size == 1:
        return
    roles = b.roles
    link = b.cluster.group_link(roles.dp)
    n = b.dp_size
    t = cg.form_terms["data"] = DataTerms(overlap=b.cluster.rank_device().overlap)
    if roles.zero:
        units = block_units(b) - 1  # the blocks; the root is the last term
        zn, zlink = b.zero_size, b.cluster.group_link(roles.shard_axes)
        gathers = 2 if roles.reshard_after_forward else 1  # a block's backward gather (not the root's)
        per_unit = reduce_scatter_time_s(0.0, zn, zlink)
        if roles.replicate:  # HSDP: the shard's all-reduce over the replicate axes
            per_unit += all_reduce_time_s(0.0, b.dp_size // zn, b.cluster.group_link(roles.replicate))
        t.latency_s = (units * (gathers * all_gather_time_s(0.0, zn, zlink) + per_unit)
                       + all_gather_time_s(0.0, zn, zlink) + per_unit)
        t.window = "all"
        if b.zero_size > 1:
            cg.host_s += fsdp_host_s(block_units(b), 0, b.hw)
    else:
        # buckets = 1 + ceil((G - first) / full) for G gradient bytes; `param_sync_s` charges G / full of
        # them per byte, and this constant the rest: the first bucket's, and on average half of the last
        # (partial) one's — with G from the replicated parameters, exact (two buckets) below two buckets
        grad_bytes = b.replicated_grad_bytes()
        if grad_bytes <= DDP_FIRST_BUCKET_BYTES:
            buckets = 1.0
        elif grad_bytes <= DDP_FIRST_BUCKET_BYTES + DDP_BUCKET_BYTES:
            buckets = max(1.0, 2.0 - grad_bytes / DDP_BUCKET_BYTES)
        else:
            buckets = 1.5
        t.latency_s = buckets * all_reduce_time_s(0.0, n, link)
        t.window = "bwd"
        t.buffer_s = buffer_broadcast_s(b.g.buffer_bytes, n, link)  # NOTE [DDP buffers]


# ----------------------------------------------------------------------------- MILP
def dp_window_s(cg, c) -> float:
    """What one strategy adds to the window data-parallel syncs hide behind (NOTE [bucketed data parallel]):
    for DDP its backward compute and backward tensor-parallel communication; for ZeRO-3 its compute and all
    its tensor-parallel communication. The data-parallel collectives run on the data-parallel axes' own
    channel, so they go on while compute waits for a blocking collective on a tensor axis
    (`treadle.cost.overlap`: one channel per axis). The input-gradient sums (backward tensor-parallel
    communication too) widen either window: `ilp_rows`, `evaluate`."""
    return c.bwd_s + c.bwd_comm_s if terms(cg).window == "bwd" else c.compute_s + c.comm_s


def ilp_rows(m, cg, s, shared: dict) -> None:
    """E >= latency + sum dp_comm - W, E >= 0, E in the objective (NOTE [bucketed data parallel]; family
    dp_exposure), and for DDP the head's own bound (NOTE [the last bucket]; dp_exposure_head). The
    input-gradient sums (``shared["grad_sums"]``: {variable: seconds}, set by the tensor-parallel rows) widen the
    window like the rest of the tensor-parallel communication."""
    t = terms(cg)
    if t is None or (not any(c.dp_comm_s for unit in cg.units for c in unit.costs) and not t.latency_s):
        return
    e = m.var(ub=math.inf, cost=_SECONDS)
    row: dict[int, float] = {e: _SECONDS}
    if t.overlap:
        for y, sec in shared.get("grad_sums", {}).items():
            row[y] = row.get(y, 0.0) + sec * _SECONDS
    for u, unit in enumerate(cg.units):
        for k, c in enumerate(unit.costs):
            w = dp_window_s(cg, c) if t.overlap else 0.0
            x = unit.count * (c.dp_comm_s - w) * _SECONDS
            if x:
                row[s[u, k]] = row.get(s[u, k], 0.0) - x
    for key, v in variants_of(cg).items():  # each variant block's own (NOTE [block variants])
        exposed = v.delta.dp_comm_s - (dp_window_s(cg, v.delta) if t.overlap else 0.0)
        row[shared["variants"][key]] = -exposed * _SECONDS
    m.row(row, t.latency_s * _SECONDS, math.inf, "dp_exposure")
    head = head_units(cg)
    if head and t.window == "bwd" and t.overlap:  # NOTE [the last bucket]
        row = {e: _SECONDS}
        for u in head:
            for k, c in enumerate(cg.units[u].costs):
                x = cg.units[u].count * (c.dp_comm_s - dp_window_s(cg, c)) * _SECONDS
                if x:
                    row[s[u, k]] = row.get(s[u, k], 0.0) - x
        m.row(row, 0.0, math.inf, "dp_exposure_head")


def evaluate(cg, choice: list[int], acc: dict) -> None:
    """The exposed part of the reductions of a choice (as `ilp_rows` states it) and DDP's buffer broadcast, added
    to ``acc["comm_s"]``; ``acc["grad_sums_s"]``: the input-gradient sums, in the window."""
    t = terms(cg)
    if t is None:
        return
    dp_comm = window = 0.0
    for u, unit in enumerate(cg.units):
        c = unit.costs[choice[u]]
        dp_comm += unit.count * c.dp_comm_s
        window += unit.count * dp_window_s(cg, c)
    for key, v in variants_of(cg).items():  # NOTE [block variants]
        dp_comm += acc["variants"].get(key, 0) * v.delta.dp_comm_s
        window += acc["variants"].get(key, 0) * dp_window_s(cg, v.delta)
    window += acc.get("grad_sums_s", 0.0)  # backward tensor-parallel communication: in both windows
    if dp_comm or t.latency_s:
        exposed = t.latency_s + dp_comm - (window if t.overlap else 0.0)
        if t.window == "bwd" and t.overlap:  # NOTE [the last bucket]
            exposed = max(exposed, sum(cg.units[u].count * (cg.units[u].costs[choice[u]].dp_comm_s
                                                            - dp_window_s(cg, cg.units[u].costs[choice[u]]))
                                       for u in head_units(cg)))
        acc["comm_s"] += max(0.0, exposed)
    acc["comm_s"] += t.buffer_s  # NOTE [DDP buffers]: a constant of the role


def adjust_rows(cg, choice: list[int], rows: dict, shared: dict) -> None:
    """The role's constants in the explanation (NOTE [the step row] in `treadle.planner.rows`): the reductions'
    latency part and DDP's buffer broadcast, before overlap, on ``shared["step_row"]``."""
    t = terms(cg)
    if t is not None and "step_row" in shared:
        shared["step_row"].comm_s += t.latency_s + t.buffer_s


# NOTE [the last bucket]: DDP reduces a bucket once the backward has produced its gradients, so a parameter's
# reduction hides only behind the backward still to run after it: nothing for the parameters of the ops that
# run before the repeated blocks (the embedding, whose gradient is the backward's last). The aggregate window
# of `ilp_rows` lets a replicated embedding's all-reduce (a GiB for a 128k vocabulary in bf16) hide
# behind the blocks' backward; `treadle.price` (and the runtime) expose it. A second lower bound on E states
# the head alone: E >= sum over the head's units (dp_comm - window). ZeRO-3 reduce-scatters its root unit
# (embedding, head, final norm) at the end too, but also gathers it at the start; its window stays aggregate.


# NOTE [the backward's end]: `memory_expression` is the peak at the start of the backward, every saved activation
# alive. Under DDP the local gradients are tensors of their own beside its flat buckets (static memory counts one
# copy: the buckets), made as the backward runs while the saved activations are freed; with the blocks
# checkpointed the peak moves to the last block the backward reaches (the first in forward), recomputed while
# the gradients of everything after it exist. `treadle.price` showed it on the demo's GPT-2 (dp x tp, 4 of 4
# blocks checkpointed): the solver's 11.25 MiB against 11.48 MiB priced after this row, 13.24 MiB before
# NOTE [checkpoint and the KV cache], the peak in block 0's backward. A second row states that point:
#     static + fixed + act_head + A_t0 + q_t0 In_t0 + sum_{u not head} count'_u grad_u  <=  budget
# with the head the units that run before the first block (their gradients come last: `head_units`), t0 the
# template of the first block (block 0 keeps its saved A, or its input In while it recomputes A; q_t0 = 1 when
# any block of t0 is checkpointed, and block 0 then is: `to_schedule._spread`) and count' = count - 1 on t0's
# units (block 0's own gradients are still being made). Without DDP the gradients are the static copy and
# this point is never above the first row; ZeRO-3 reduce-scatters each unit's gradients as its unit ends.


def separate_grads(cg) -> bool:
    """DDP over more than one rank: gradients exist beside the buckets (NOTE [the backward's end])."""
    return bool(cg.roles.dp) and not cg.roles.zero and math.prod(cg.cluster.mesh.size(a) for a in cg.roles.dp) > 1


def _end_unit_bytes(cg, u: int, c, head: set[int], first: set[int]) -> float:
    """One unit's bytes in the backward-end row (NOTE [the backward's end]): its static bytes, the gradients
    that exist by then, and its saved activations when it is a head unit or a unit of block 0."""
    unit = cg.units[u]
    grads_count = 0 if u in head else unit.count - (1 if u in first else 0)
    act = c.act_bytes if u in head or u in first else 0.0
    return unit.count * c.static_bytes + grads_count * c.grad_bytes + act


def memory_rows(m, cg, v) -> list[tuple[dict[int, float], float]]:
    """The memory at the backward's end (NOTE [the backward's end]) as one (terms, constant) row in GiB; none when
    it cannot exceed the core's `memory_expression` (no DDP, no blocks)."""
    t0 = first_template(cg)
    if t0 is None or not separate_grads(cg):
        return []
    row: dict[int, float] = {}
    head, first = set(head_units(cg)), set(cg.templates[t0].units)
    for u, unit in enumerate(cg.units):
        for k, c in enumerate(unit.costs):
            x = _end_unit_bytes(cg, u, c, head, first) * _BYTES
            if x:
                row[v.s[u, k]] = row.get(v.s[u, k], 0.0) + x
    for key, x in variants_of(cg).items():  # never block 0: its gradients exist (NOTE [block variants])
        row[v.variants[key]] = (x.delta.static_bytes + x.delta.grad_bytes) * _BYTES
    _, _, In = _block_exprs(cg, v.s, t0)
    if In:  # q_t0 In_t0: block 0's input, kept while it is recomputed
        ub = max(cg.templates[t0].input_bytes) * _BYTES
        z = m.var(ub=ub)
        _mccormick(m, z, any_checkpointed(m, t0, v.q[t0], v.policies), In, ub)  # either way (`policies.py`)
        row[z] = 1.0
    return [(row, cg.fixed_static_bytes * _BYTES)]


def peak_bytes(cg, choice: list[int], ckpt: dict[int, int], counts: dict | None = None) -> float:
    """`memory_rows` of one choice (`counts`: blocks per variant), in bytes (0 when it does not apply)."""
    t0 = first_template(cg)
    if t0 is None or not separate_grads(cg):
        return 0.0
    info = cg.templates[t0]
    head, first = set(head_units(cg)), set(info.units)
    total = cg.fixed_static_bytes + sum(_end_unit_bytes(cg, u, unit.costs[choice[u]], head, first)
                                        for u, unit in enumerate(cg.units))
    if ckpt.get(t0, 0) > 0 and info.input_unit is not None:
        total += info.input_bytes[choice[info.input_unit]]
    total += sum((counts or {}).get(key, 0) * (v.delta.static_bytes + v.delta.grad_bytes)
                 for key, v in variants_of(cg).items())
    return total


# ----------------------------------------------------------------------------- decision
def data_parallel_args(roles) -> dict:
    """`Schedule.data_parallel` keyword arguments for `roles` (a cost_graph.Roles with dp axes): one axis as
    a name, several as a list; ZeRO-3 names its shard axes, HSDP adds `replicate`, and
    ``reshard_after_forward=False`` only when set."""
    axes = list(roles.shard_axes if roles.zero else roles.dp)
    args: dict = {"axis": axes[0] if len(axes) == 1 else axes, "shard": roles.zero}
    if roles.replicate:
        args["replicate"] = roles.replicate[0] if len(roles.replicate) == 1 else list(roles.replicate)
    if roles.zero and not roles.reshard_after_forward:
        args["reshard_after_forward"] = False
    return args


def decisions(cg, choice, ckpt, ctx) -> list:
    if not cg.roles.dp:
        return []
    return [(DECISION_RANK, "", Decision("data_parallel", "", data_parallel_args(cg.roles), str(cg.roles)))]
