"""Expert parallelism in the planner: the role option (every experts module split over one data-parallel axis),
how the experts' weights live under it, the cost of the token exchanges, and the `expert_parallel` decisions.

NOTE [experts in the plan]: a role assignment with ``Roles.ep = a`` (a data-parallel axis of n ranks whose size
divides every experts module's E) splits every experts module's weights over `a`: their parameter, gradient and
optimizer bytes are 1/n (`own_split`; ZeRO-3 does not shard them further, DDP does not reduce them: NOTE [expert
gradients]), their gradient reduction leaves the data-parallel sync, and each experts module adds, on its first
node, the exchanges build issues (NOTE [expert dispatch]): forward one all-to-all of the E per-expert counts and
two of the rows (R = local tokens x k, each H wide, in the rows' dtype), backward two of the rows, all blocking
on `a`; a checkpointed block's recompute runs the forward ones again. The rows per rank assume the balanced load
the price assumes (NOTE [expert load in a rehearsal]). The experts' nodes run replicated on the tensor axes (no
sharding rule runs an experts module on shards). The ILP weighs this assignment against the others, jointly with
checkpointing, through the same strategy costs and memory rows as every role.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...cost.collective_cost import collective_time_s
from ...errors import PlanError
from ...planner.capture import TensorMeta
from ...planner.dims import R
from ...planner.to_schedule import DECISION_RANKS, Decision
from .facts import expert_modules

DECISION_RANK = DECISION_RANKS["expert_parallel"]


@dataclass(frozen=True, slots=True)
class Exchange:
    """One experts module's exchanges, per execution: forward and backward seconds (NOTE [experts in the plan])."""

    fwd_s: float
    bwd_s: float


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
    n = b.cluster.mesh.size(ep)
    link = b.cluster.link(ep)
    for name, module in b.g.param_modules.items():
        if module in experts:
            b.own_split[name] = n
    for path in sorted({m for node in b.nodes if node.kind == "op" and (m := _inside(node.module, experts))}):
        ops = [x for x in b.nodes if x.kind == "op" and _inside(x.module, (path,)) and b.canonical(x.index) == x.index]
        if not ops:
            continue
        rows, width = _rows(b, ops, path)
        e = experts[path]
        row_bytes = rows * width
        fwd = collective_time_s("all_to_all", e * 8, n, link) + 2 * collective_time_s("all_to_all", row_bytes, n, link)
        bwd = 2 * collective_time_s("all_to_all", row_bytes, n, link)
        b.expert_exchanges[ops[0].index] = Exchange(fwd, bwd)


def _rows(b, ops, path: str) -> tuple[float, int]:
    """(routed pairs per rank, bytes of one row) of experts module `path`: read off the values its ops read from
    outside it, the routed rows (T, H) and their expert indices (T, k). Raises PlanError when the graph shows
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
    j, m = index
    tokens, k = b.local_dp_shape(j, m.shape)
    return float(tokens * k), hidden.shape[1] * hidden.dtype.itemsize


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
    c.fwd_s += x.fwd_s
    c.bwd_comm_s += x.bwd_s
    if rec != "none":  # a checkpointed block's recompute dispatches again
        c.rec_s += x.fwd_s


def decisions(cg, choice, ckpt, ctx) -> list:
    """``expert_parallel(axis=ep)`` on every experts module of the model (the capture's facts: all blocks)."""
    ep = cg.roles.ep
    if ep is None:
        return []
    return [(DECISION_RANK, path, Decision("expert_parallel", path, {"axis": ep},
                                           f"{e} experts over {ep} (NOTE [experts in the plan])"))
            for path, e in sorted(_experts(cg.graph.facts).items())]
