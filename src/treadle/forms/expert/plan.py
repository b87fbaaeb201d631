"""Expert parallelism in the planner: the role option (every experts module split over one data-parallel axis),
how the experts' weights live under it, the cost of the token exchanges, and the `expert_parallel` decisions.

NOTE [experts in the plan]: a role assignment with ``Roles.ep = a`` (a data-parallel axis of n ranks whose size
divides every experts module's E) splits every experts module's weights over `a`: their parameter, gradient and
optimizer bytes are 1/n (`own_split`; ZeRO-3 does not shard them further, DDP does not reduce them: NOTE [expert
gradients]), their gradient reduction leaves the data-parallel sync, and each experts module adds, on its first
node, the exchanges build issues (NOTE [expert dispatch]): forward one all-to-all of the E per-expert counts, two of
the rows (R = local tokens x k, each H wide, in the rows' dtype) and one of their routing weights, backward their
adjoints (two of the rows, one of the weights), all blocking on `a`, and the dispatch's own memory traffic on
compute (`dispatch_traffic`); a checkpointed block's recompute runs the forward ones again. The rows per rank assume
the balanced load the price assumes (NOTE [expert load in a rehearsal]). Under ZeRO-3 with shard axes besides `a`
(NOTE [experts under FSDP2]) the experts are split further over those (m ranks: 1/(n m) of their bytes) and each
experts module is an FSDP2 unit of its own: two gathers (one without reshard after forward) and a reduce-scatter of
its local experts over those axes (HSDP: an all-reduce of the shard over the other replicate axes), bandwidth on its
first node's `dp_comm_s` (hidden behind compute as the other units' are), FSDP2's copies on its compute, the unit's
latencies in the data form's constant; without reshard the gathered local experts are kept. The experts' nodes run
replicated on the tensor axes (no sharding rule runs an experts module on shards). The ILP weighs this assignment
against the others, jointly with checkpointing, through the same strategy costs and memory rows as every role.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...cost.collective_cost import all_gather_time_s, all_reduce_time_s, collective_time_s, reduce_scatter_time_s
from ...errors import PlanError
from ...planner.capture import TensorMeta
from ...planner.dims import R
from ...planner.to_schedule import DECISION_RANKS, Decision
from ...profile.roofline import memory_time_s
from ..data.facts import fsdp_copy_s, fsdp_host_s
from .dispatch import dispatch_traffic
from .facts import expert_modules

DECISION_RANK = DECISION_RANKS["expert_parallel"]


@dataclass(frozen=True, slots=True)
class Exchange:
    """One experts module's exchanges, per execution: forward and backward seconds; under ZeRO-3 its FSDP2 unit's
    bandwidth seconds (`fsdp_s`), copies (`copy_s`) and latency (`latency_s`) per step; the dispatch's own memory
    traffic, forward and backward seconds (`work_*_s`; NOTE [experts in the plan])."""

    fwd_s: float
    bwd_s: float
    fsdp_s: float = 0.0
    copy_s: float = 0.0
    latency_s: float = 0.0
    work_fwd_s: float = 0.0
    work_bwd_s: float = 0.0


def capture_facts(model) -> dict | None:
    """The experts modules of the whole model (path -> E), before capture shortens its lists; None without."""
    found = expert_modules(model)
    return {"experts": found} if found else None


def _experts(facts) -> dict[str, int]:
    return ((facts or {}).get("expert") or {}).get("experts") or {}


def role_options(mesh, live: tuple[str, ...], *, batch, request) -> list[dict] | None:
    """No expert axis, or any live axis whose size divides every experts module's E (`keep_roles` keeps those
    that are data-parallel in the merged assignment)."""
    experts = _experts(request.facts)
    if not experts:
        return None
    return [{}] + [{"ep": a} for a in live if all(e % mesh.size(a) == 0 for e in experts.values())]


def keep_roles(options: dict) -> bool:
    ep = options.get("ep")
    return ep is None or ep in options.get("dp", ())


def role_label(roles) -> str | None:
    return f"experts over {roles.ep}" if roles.ep else None


def _inside(module: str, paths) -> str | None:
    return next((p for p in paths if module == p or module.startswith(p + ".")), None)


def prepare(b) -> None:
    """Under an expert axis: the experts' parameters split over it (`own_split`), and each experts module's
    exchanges on its first canonical node (`b.expert_exchanges`)."""
    b.expert_exchanges = {}
    ep = b.roles.ep
    experts = _experts(b.g.facts)
    if ep is None or not experts:
        return
    mesh = b.cluster.mesh
    n = mesh.size(ep)
    link = b.cluster.link(ep)
    shard = tuple(a for a in b.roles.shard_axes if a != ep)  # NOTE [experts under FSDP2]
    m = math.prod(mesh.size(a) for a in shard)
    fsdp = m > 1
    for name, module in b.g.param_modules.items():
        if module in experts:
            b.own_split[name] = n * (m if fsdp else 1)
            if fsdp:
                b.own_gathered[name] = n
    local_bytes: dict[str, float] = {}  # the local experts' bytes of each (captured) experts module
    for x in b.nodes:
        if x.kind == "param" and isinstance(x.out, TensorMeta) and (mod := b.g.param_modules.get(x.param)) in experts:
            local_bytes[mod] = local_bytes.get(mod, 0.0) + x.out.numel * x.out.dtype.itemsize / n
    for path in sorted({m for node in b.nodes if node.kind == "op" and (m := _inside(node.module, experts))}):
        ops = [x for x in b.nodes if x.kind == "op" and _inside(x.module, (path,)) and b.canonical(x.index) == x.index]
        if not ops:
            continue
        rows, width, wbytes = _rows(b, ops, path)
        e = experts[path]
        row_bytes, weight_bytes = rows * width, rows * wbytes
        exchanges = 2 * collective_time_s("all_to_all", row_bytes, n, link) + \
            collective_time_s("all_to_all", weight_bytes, n, link)  # rows there and back, the weights there
        fwd = collective_time_s("all_to_all", e * 8, n, link) + exchanges
        bwd = exchanges  # the adjoints: the results' gradients there, the rows' and the weights' back
        moved = dispatch_traffic(rows, width)
        work = tuple(memory_time_s(int(x), b.hw) for x in moved)
        unit = _unit_costs(b, local_bytes.get(path, 0.0), shard, ep) if fsdp else (0.0, 0.0, 0.0)
        b.expert_exchanges[ops[0].index] = Exchange(fwd, bwd, *unit, *work)


def _unit_costs(b, nbytes: float, shard: tuple[str, ...], ep: str) -> tuple[float, float, float]:
    """(bandwidth s, copies s, latency s) per step of one experts unit of `nbytes` local expert bytes under
    ZeRO-3 over `shard` (NOTE [experts in the plan]), as the data form prices a unit."""
    mesh = b.cluster.mesh
    m = math.prod(mesh.size(a) for a in shard)
    zlink = b.cluster.group_link(shard)
    gathers = 2 if b.roles.reshard_after_forward else 1
    colls = [(all_gather_time_s, nbytes, m, zlink)] * gathers + [(reduce_scatter_time_s, nbytes, m, zlink)]
    rep = tuple(a for a in b.roles.replicate if a != ep)
    if rep:
        colls.append((all_reduce_time_s, nbytes / m, math.prod(mesh.size(a) for a in rep), b.cluster.group_link(rep)))
    bandwidth = sum(fn(x, k, ln) - fn(0.0, k, ln) for fn, x, k, ln in colls)
    latency = sum(fn(0.0, k, ln) for fn, _, k, ln in colls)
    copies = (gathers + 1) * fsdp_copy_s(nbytes, m, b.hw) + fsdp_host_s(1, 0, b.hw)
    return bandwidth, copies, latency


def _rows(b, ops, path: str) -> tuple[float, int, int]:
    """(routed pairs per rank, bytes of one row, bytes of one routing weight) of experts module `path`: read off
    the values its ops read from outside it, the routed rows (T, H), their expert indices (T, k) and routing
    weights (T, k; absent from the graph: the rows' dtype). Raises PlanError when the graph shows
    neither (the search then skips this role assignment, saying why, instead of pricing it without its
    exchanges)."""
    inside = {x.index for x in ops}
    outer = [j for x in ops for j in x.inputs if j not in inside and b.nodes[j].kind != "param"
             and not _inside(b.nodes[j].module, (path,))]
    metas = [(j, b.nodes[j].out) for j in dict.fromkeys(outer) if isinstance(b.nodes[j].out, TensorMeta)]
    index = next(((j, m) for j, m in metas if not m.dtype.is_floating_point and len(m.shape) == 2), None)
    hidden = index and next((mm for _, mm in metas if mm.dtype.is_floating_point and len(mm.shape) == 2
                             and mm.shape[0] == index[1].shape[0] and mm.shape[1] != index[1].shape[1]), None)
    if hidden is None:
        raise PlanError(f"expert role: cannot read the routed rows (T, H) and their expert indices (T, k) of "
                        f"{path!r} off the captured graph (its inputs: {[tuple(m.shape) for _, m in metas]})")
    weights = next((mm for _, mm in metas if mm.dtype.is_floating_point and mm.shape == index[1].shape), hidden)
    j, m = index
    tokens, k = b.local_dp_shape(j, m.shape)
    return float(tokens * k), hidden.shape[1] * hidden.dtype.itemsize, weights.dtype.itemsize


def keep_strategy(b, n, spec, combo: tuple) -> bool:
    """Under an expert axis the experts' nodes run replicated on the tensor axes (NOTE [experts in the plan])."""
    if b.roles.ep is None or not _inside(n.module, _experts(b.g.facts)):
        return True
    return all(p == R for o in combo for p in o.ins + o.outs)


def node_cost(b, n, combo: tuple, pub: tuple, c, rec: str) -> None:
    x = getattr(b, "expert_exchanges", {}).get(n.index)
    if x is None:
        return
    c.comm_s += x.fwd_s + x.bwd_s
    c.compute_s += x.work_fwd_s + x.work_bwd_s
    c.fwd_s += x.fwd_s + x.work_fwd_s
    c.bwd_s += x.work_bwd_s
    c.bwd_comm_s += x.bwd_s
    if rec != "none":  # a checkpointed block's recompute dispatches again
        c.rec_s += x.fwd_s + x.work_fwd_s
    c.dp_comm_s += x.fsdp_s  # its FSDP2 unit (NOTE [experts in the plan])
    c.compute_s += x.copy_s


def graph_terms(b, cg) -> None:
    """The experts modules' exchanges (`cg.form_terms["expert"]`: first node -> Exchange) and their FSDP2 units'
    latencies, in the data form's constant (NOTE [bucketed data parallel])."""
    exchanges = getattr(b, "expert_exchanges", {})
    if exchanges:
        cg.form_terms["expert"] = dict(exchanges)  # first node -> Exchange, for `explain` and the tests
    lat = sum(x.latency_s * b.count(i) for i, x in exchanges.items())
    terms = cg.form_terms.get("data")
    if lat and terms is not None:
        terms.latency_s += lat


def decisions(cg, choice, ckpt, ctx) -> list:
    """``expert_parallel(axis=ep)`` on every experts module of the model (the capture's facts: all blocks)."""
    ep = cg.roles.ep
    if ep is None:
        return []
    return [(DECISION_RANK, path, Decision("expert_parallel", path, {"axis": ep},
                                           f"{e} experts over {ep} (NOTE [experts in the plan])"))
            for path, e in sorted(_experts(cg.graph.facts).items())]
