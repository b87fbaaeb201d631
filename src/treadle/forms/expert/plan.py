"""Expert parallelism in the planner: the role option (every experts module split over one data-parallel axis, or
over the flattened group of several),
how the experts' weights live under it, the cost of the token exchanges, and the `expert_parallel` decisions.

NOTE [experts in the plan]: a role assignment with ``Roles.ep = a`` (data-parallel axes, one or several, whose
flattened group of n ranks divides every experts module's E; several on their `group_link`, as the price charges
them) splits every experts module's weights over `a`: their parameter, gradient and
optimizer bytes are 1/n (`own_split`; ZeRO-3 does not shard them further, DDP does not reduce them: NOTE [expert
gradients]), their gradient reduction leaves the data-parallel sync (under DDP with data-parallel axes outside
`a`, the local backward sums each module's local gradients over those replicas, blocking: `grad_sum_s` per weight,
its latency with the backward exchanges), and each experts module adds, on its first
node, the exchanges build issues (NOTE [expert dispatch]): forward one all-to-all of the E per-expert counts, two of
the rows (R = local tokens x k, each H wide, in the rows' dtype) and one of their routing weights, backward their
adjoints (two of the rows, one of the weights), all blocking on `a`, and the dispatch's own memory traffic on
compute (`dispatch_traffic`); a checkpointed block's recompute runs the forward ones again. The rows are the
busiest rank's, as the price's (NOTE [expert load in a rehearsal]): under ``Roles.ep_load = f`` (`plan_model`'s
`expert_load_imbalance`) the exchanges carry f times the rows a rank routes, and the experts modules' own nodes
compute and save f times their balanced work (`node_cost`); the dispatch's traffic stays on the rows a rank routes.
The plan states f as ``expert_parallel(load_imbalance=f)``, so its price charges the same. Under ZeRO-3 with shard
axes besides `a` (NOTE [experts under FSDP2]) the experts are split further over those (m ranks: 1/(n m) of their
bytes) and each experts module is an FSDP2 unit of its own: two gathers (one without reshard after forward) and a
reduce-scatter of its local experts over those axes (HSDP: an all-reduce of the shard over the other replicate
axes), bandwidth on its first node's `dp_comm_s` (hidden behind compute as the other units' are), FSDP2's copies on
its compute, the unit's latencies in the data form's constant; without reshard the gathered local experts are kept.
The experts' nodes run replicated on the tensor axes (no sharding rule runs an experts module on shards). The ILP
weighs this assignment against the others, jointly with checkpointing, through the same strategy costs and memory
rows as every role.

Each expert's weights may also split over a tensor axis (expert tensor parallelism, NOTE [experts split by tensor]):
the split build would make (`find_split`, probed once per experts module at capture: `capture_facts`) is offered as
the weights' placements on any one tensor axis (`param_placements`), and the dimension algebra prices it as it
prices a column- then row-parallel MLP: the grouped products' rules (`dim_rules._grouped_mm`; the fused gate|up in
two blocks, NOTE [blocked split]), the inner width's compute and saved activations divided by t, the routed rows'
input-gradient sum over the axis in backward, and the pending sum leaving the experts module reduced at its exit —
the all-reduce of T x H the local forward issues. So whether and on which axis to split the experts' weights is a
choice per node of each block template, made in the MILP jointly with checkpointing and the memory budget; it
needs an expert axis (build splits each expert only inside expert parallelism), and the plan states it as
``expert_parallel(axis=, tensor=)`` (`decide_node` takes those layouts out of the core's shards and exit syncs). Under
ZeRO-3 each experts unit's gathers and reduce-scatter are charged per parameter on its local slice
(`node_cost`), so a split over t ranks moves 1/t of the bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

from ...cost.collective_cost import all_gather_time_s, all_reduce_time_s, collective_time_s, reduce_scatter_time_s
from ...errors import PlanError, ScheduleError
from ...planner.capture import TensorMeta
from ...planner.dims import R
from ...form import forms
from ...planner.node_costs import StrategyCost
from ...planner.to_schedule import DECISION_RANKS, Decision, _members, _spread
from ...planner.variants import Variant, pick
from ...profile.roofline import memory_time_s
from ...schedule.expert_primitive import experts_layout
from ...schedule.expert_split import find_split
from ..data.facts import fsdp_copy_s, fsdp_host_s
from .dispatch import dense_traffic, dispatch_traffic
from .facts import expert_modules

DECISION_RANK = DECISION_RANKS["expert_parallel"]


@dataclass(frozen=True, slots=True)
class Exchange:
    """One experts module's exchanges, per execution: forward and backward seconds; under ZeRO-3 its FSDP2 unit's
    host cost (`host_s`) and collectives' latency (`latency_s`) per step (their bandwidth and copies are charged
    per parameter: `UnitLinks`); the dispatch's own memory traffic, forward and backward seconds (`work_*_s`; NOTE
    [experts in the plan])."""

    fwd_s: float
    bwd_s: float
    host_s: float = 0.0
    latency_s: float = 0.0
    work_fwd_s: float = 0.0
    work_bwd_s: float = 0.0


@dataclass(frozen=True, slots=True)
class UnitLinks:
    """An experts module's FSDP2 unit under ZeRO-3 (NOTE [experts under FSDP2]): sharded over `m` ranks on
    `link`, gathered `gathers` times a step, its shard all-reduced over `rep` ranks on `rep_link` under HSDP."""

    m: int
    link: object
    gathers: int
    rep: int = 1
    rep_link: object = None

    def collectives(self, nbytes: float) -> list:
        colls = [(all_gather_time_s, nbytes, self.m, self.link)] * self.gathers + \
            [(reduce_scatter_time_s, nbytes, self.m, self.link)]
        if self.rep > 1:
            colls.append((all_reduce_time_s, nbytes / self.m, self.rep, self.rep_link))
        return colls

    def bandwidth_s(self, nbytes: float) -> float:
        """Seconds per step beyond the latency of the unit's collectives on `nbytes` of its local experts."""
        return sum(fn(x, k, ln) - fn(0.0, k, ln) for fn, x, k, ln in self.collectives(nbytes))

    def latency_s(self) -> float:
        return sum(fn(0.0, k, ln) for fn, _, k, ln in self.collectives(0.0))

    def copy_s(self, nbytes: float, hw) -> float:
        """FSDP2's copies around the unit's collectives on `nbytes` of its local experts."""
        return (self.gathers + 1) * fsdp_copy_s(nbytes, self.m, hw)


def capture_facts(model) -> dict | None:
    """The experts modules of the whole model (path -> E), before capture shortens its lists, and the split of each
    one's weights over a tensor axis that build would make (path -> {parameter: (dim, blocks)}, probed for two
    ranks: NOTE [experts split by tensor]; absent where no split is exact); None without experts."""
    found = expert_modules(model)
    if not found:
        return None
    splits = {}
    dense = sorted(p for p in found if experts_layout(model.get_submodule(p)) == "dense")  # NOTE [dense experts]
    for path in found:
        if path in dense:
            continue
        try:
            split = find_split(model.get_submodule(path), 2, where=f"expert tensor split of {path!r}")
        except ScheduleError:
            continue
        splits[path] = {name: (sh.dim, sh.blocks) for name, sh in split.items()}
    return {"experts": found, "splits": splits, "dense": dense}


def param_placements(facts, param: str, module: str, n_tp: int) -> set[tuple[int, ...]]:
    """The placements of an expert weight build makes under ``expert_parallel(tensor=)``: its split dim on any one
    tensor axis (NOTE [experts in the plan]); nothing for other parameters."""
    splits = ((facts or {}).get("expert") or {}).get("splits") or {}
    owner, _, name = param.rpartition(".")
    split = splits.get(owner)
    if owner != module or not split or name not in split:
        return set()
    dim = split[name][0]
    return {tuple(dim if j == a else R for j in range(n_tp)) for a in range(n_tp)}


def _experts(facts) -> dict[str, int]:
    return ((facts or {}).get("expert") or {}).get("experts") or {}


def _dense_paths(facts) -> set[str]:
    """The experts modules that take E groups of rows (NOTE [dense experts])."""
    return set(((facts or {}).get("expert") or {}).get("dense") or ())


def role_options(mesh, live: tuple[str, ...], *, batch, request) -> list[dict] | None:
    """No expert axis, or any set of live axes (mesh order; one, or several flattened into one group) whose
    sizes' product divides every experts module's E (`keep_roles` keeps those that are data-parallel in the
    merged assignment). `request.ep_axis`: "auto" (those), None (no expert axis), an axis or a tuple (that group
    only). Raises PlanError for a stated group that is not live or does not divide the experts."""
    experts, want = _experts(request.facts), getattr(request, "ep_axis", "auto")
    if want is None or (not experts and want == "auto"):
        return None
    if want != "auto":
        want = stated_axes(want)
        if not experts:
            raise PlanError(f"ep_axis={list(want)}: the model has no experts module to split")
    load = {"ep_load": request.expert_load} if request.expert_load != 1.0 else {}
    if load and _dense_paths(request.facts):
        return [{}]  # dense experts run every expert on every row: no busiest rank to state (NOTE [dense experts])
    divides = lambda g: all(e % math.prod(mesh.size(a) for a in g) == 0 for e in experts.values())  # noqa: E731
    if want != "auto":
        group = tuple(a for a in mesh.names if a in want)
        if not set(want) <= set(live):
            raise PlanError(f"ep_axis={list(want)}: not live axes of {mesh} (live: {list(live)})")
        if not divides(group):
            raise PlanError(f"ep_axis={list(want)}: its {math.prod(mesh.size(a) for a in group)} ranks do not divide "
                            f"the experts ({sorted(set(experts.values()))} per module)")
        return [{"ep": group, "ep_part": False, **load}]  # every block's experts over it
    groups = [c for r in range(1, len(live) + 1) for c in combinations(live, r)]
    return [{}] + [{"ep": g, **load} for g in groups if divides(g)]


def stated_axes(want) -> tuple[str, ...]:
    """`plan_model`'s stated `ep_axis` (an axis name or a list of them) as a tuple. Raises PlanError otherwise."""
    axes = (want,) if isinstance(want, str) else tuple(want) if isinstance(want, (list, tuple)) else None
    if not axes or not all(isinstance(a, str) for a in axes) or len(set(axes)) != len(axes):
        raise PlanError(f"ep_axis={want!r}: use 'auto', None, an axis name or a list of distinct axis names")
    return axes


def keep_roles(options: dict) -> bool:
    return set(options.get("ep", ())) <= set(options.get("dp", ()))


def role_label(roles) -> str | None:
    if not roles.ep:
        return None
    return f"experts over {','.join(roles.ep)}" + (
        f" (busiest rank {roles.ep_load:g}x the mean)" if roles.ep_load != 1 else "")


def _inside(module: str, paths) -> str | None:
    return next((p for p in paths if module == p or module.startswith(p + ".")), None)


def prepare(b) -> None:
    """Under an expert axis: the experts' parameters split over it (`own_split`), each experts module's exchanges on
    its first canonical node (`b.expert_exchanges`) and, under ZeRO-3, its FSDP2 unit (`b.expert_units`)."""
    b.expert_exchanges = {}
    b.expert_units = {}
    ep = b.roles.ep
    experts = _experts(b.g.facts)
    if not ep or not experts:
        return
    mesh = b.cluster.mesh
    n = math.prod(mesh.size(a) for a in ep)
    link = b.cluster.group_link(ep)  # one axis: its own link
    shard = tuple(a for a in b.roles.shard_axes if a not in ep)  # NOTE [experts under FSDP2]
    m = math.prod(mesh.size(a) for a in shard)
    fsdp = m > 1
    b.replicated_exits |= set(experts)  # the local forward hands the combined result on whole (NOTE [experts in the plan])
    for name, module in b.g.param_modules.items():
        if module in experts:
            b.own_split[name] = n * (m if fsdp else 1)
            if fsdp:
                b.own_gathered[name] = n
    rest = () if fsdp else tuple(a for a in b.roles.dp if a not in ep)  # NOTE [expert gradients]
    r = math.prod(mesh.size(a) for a in rest)
    b.expert_grad_sum = (r, b.cluster.group_link(rest)) if r > 1 else None
    unit = None
    if fsdp:
        rep = tuple(a for a in b.roles.replicate if a not in ep)
        unit = UnitLinks(m, b.cluster.group_link(shard), 2 if b.roles.reshard_after_forward else 1,
                         math.prod(mesh.size(a) for a in rep), b.cluster.group_link(rep) if rep else None)
    for path in sorted({m for node in b.nodes if node.kind == "op" and (m := _inside(node.module, experts))}):
        ops = [x for x in b.nodes if x.kind == "op" and _inside(x.module, (path,)) and b.canonical(x.index) == x.index]
        if not ops:
            continue
        e = experts[path]
        if path in _dense_paths(b.g.facts):  # NOTE [dense experts]
            row_bytes = _dense_bytes(b, ops, path)  # its E groups, every one sent and received back
            exchanges = 2 * collective_time_s("all_to_all", row_bytes, n, link)
            moved = dense_traffic(row_bytes)
        else:
            rows, width, wbytes = _rows(b, ops, path)
            got = rows * b.roles.ep_load  # the busiest rank receives and sends back (NOTE [expert load in a rehearsal])
            row_bytes, weight_bytes = got * width, got * wbytes
            exchanges = 2 * collective_time_s("all_to_all", row_bytes, n, link) + \
                collective_time_s("all_to_all", weight_bytes, n, link)  # rows there and back, the weights there
            moved = dispatch_traffic(rows, width)  # on the rows a rank routes (its own tokens)
        fwd = collective_time_s("all_to_all", e * 8, n, link) + exchanges  # with the counts
        bwd = exchanges  # the adjoints: the results' gradients there, the rows' (and the weights') back
        if b.expert_grad_sum is not None:  # the local weights' gradients summed over the other replicas: its latency
            bwd += all_reduce_time_s(0.0, *b.expert_grad_sum)
        work = tuple(memory_time_s(int(x), b.hw) for x in moved)
        if unit is not None:
            b.expert_units[path] = unit
        host, lat = (fsdp_host_s(1, 0, b.hw), unit.latency_s()) if unit is not None else (0.0, 0.0)
        b.expert_exchanges[ops[0].index] = Exchange(fwd, bwd, host, lat, *work)


def _dense_bytes(b, ops, path: str) -> float:
    """Bytes of this rank's (E x T, H) rows of dense experts module `path` (NOTE [dense experts]): the one value it
    reads from outside. Raises PlanError when the graph does not show it."""
    metas = [(j, m) for j, m in _outer(b, ops, path) if m.dtype.is_floating_point]
    if len(metas) != 1:
        raise PlanError(f"expert role: cannot read the rows of dense experts {path!r} off the captured graph (its "
                        f"inputs: {[tuple(m.shape) for _, m in metas]})")
    j, m = metas[0]
    return float(math.prod(b.local_dp_shape(j, m.shape)) * m.dtype.itemsize)


def _rows(b, ops, path: str) -> tuple[float, int, int]:
    """(routed pairs per rank, bytes of one row, bytes of one routing weight) of experts module `path`: read off
    the values its ops read from outside it, the routed rows (T, H), their expert indices (T, k) and routing
    weights (T, k; absent from the graph: the rows' dtype). Raises PlanError when the graph shows
    neither (the search then skips this role assignment, saying why, instead of pricing it without its
    exchanges)."""
    metas = _outer(b, ops, path)
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


def _outer(b, ops, path: str) -> list[tuple[int, TensorMeta]]:
    """The tensors experts module `path`'s ops read from outside it (not parameters), once each, in order."""
    inside = {x.index for x in ops}
    outer = [j for x in ops for j in x.inputs if j not in inside and b.nodes[j].kind != "param"
             and not _inside(b.nodes[j].module, (path,))]
    return [(j, b.nodes[j].out) for j in dict.fromkeys(outer) if isinstance(b.nodes[j].out, TensorMeta)]


def keep_strategy(b, n, spec, combo: tuple) -> bool:
    """Inside an experts module: without an expert axis every tensor axis replicated (build splits each expert's
    weights only under expert parallelism); with one, sharded on one tensor axis at most (the split build makes is
    over one axis; which placements its weights may take is `param_placements`'s; NOTE [experts in the plan])."""
    path = _inside(n.module, _experts(b.g.facts))
    if not path:
        return True
    sharded = {a for a, o in enumerate(combo) if any(p != R for p in o.ins + o.outs)}
    dense = path in _dense_paths(b.g.facts)  # split over the expert axes only
    return not sharded if not b.roles.ep or dense else len(sharded) <= 1


def node_cost(b, n, combo: tuple, pub: tuple, c, rec: str) -> None:
    load = b.roles.ep_load
    if load != 1.0 and b.roles.ep and _inside(n.module, _experts(b.g.facts)):
        # the busiest rank's experts compute `load` times the mean rows, and keep what they save for backward
        fwd = c.compute_s - c.bwd_s  # the node's own work: its conversions are in comm_s
        c.compute_s *= load
        c.fwd_s += (load - 1) * fwd
        c.bwd_s *= load
        c.w_s *= load
        if rec != "none":
            c.rec_s += (load - 1) * fwd
        c.act_bytes += (load - 1) * b.saved_bytes(n, combo, pub)
    x = getattr(b, "expert_exchanges", {}).get(n.index)
    if x is not None:
        c.comm_s += x.fwd_s + x.bwd_s
        c.compute_s += x.work_fwd_s + x.work_bwd_s + x.host_s
        c.fwd_s += x.fwd_s + x.work_fwd_s
        c.bwd_s += x.work_bwd_s
        c.bwd_comm_s += x.bwd_s
        if rec != "none":  # a checkpointed block's recompute dispatches again
            c.rec_s += x.fwd_s + x.work_fwd_s
    units = getattr(b, "expert_units", None) or {}
    gsum = getattr(b, "expert_grad_sum", None)
    if not units and gsum is None:
        return
    ep_n = math.prod(b.cluster.mesh.size(a) for a in b.roles.ep)
    for pos, j in enumerate(n.inputs):  # on the local slice of each expert weight it owns
        src = b.nodes[j]
        if src.kind != "param" or src.param not in b.own_split or b.param_owner.get(src.param) != n.index:
            continue
        split = math.prod(size for o, size in zip(combo, b.tp_sizes) if o.ins[pos] >= 0)
        nbytes = src.out.numel * src.out.dtype.itemsize / split / ep_n
        unit = units.get(b.g.param_modules.get(src.param))
        if unit is not None:  # its FSDP2 unit
            c.dp_comm_s += unit.bandwidth_s(nbytes)  # hidden behind compute as the other units' are
            c.compute_s += unit.copy_s(nbytes, b.hw)
        if gsum is not None:  # summed over the other data-parallel replicas in the local backward, blocking
            bw = grad_sum_s(gsum, nbytes)
            c.comm_s += bw
            c.bwd_comm_s += bw


def grad_sum_s(gsum: tuple, nbytes: float) -> float:
    """Bandwidth seconds of summing `nbytes` of local expert gradients over (ranks, link) `gsum`, the data-parallel
    replicas outside the expert group under DDP (NOTE [expert gradients]; its latency is the module's backward
    exchange's)."""
    r, link = gsum
    return all_reduce_time_s(nbytes, r, link) - all_reduce_time_s(0.0, r, link)


def graph_terms(b, cg) -> None:
    """The experts modules' exchanges (`cg.form_terms["expert"]`: first node -> Exchange), their FSDP2 units'
    latencies, in the data form's constant (NOTE [bucketed data parallel]), and the variant of the blocks that
    keep their experts whole (`whole_variants`)."""
    exchanges = getattr(b, "expert_exchanges", {})
    if exchanges:
        cg.form_terms["expert"] = dict(exchanges)  # first node -> Exchange, for `explain` and the tests
    lat = sum(x.latency_s * b.count(i) for i, x in exchanges.items())
    terms = cg.form_terms.get("data")
    if lat and terms is not None:
        terms.latency_s += lat
    whole_variants(b, cg)


# NOTE [experts split in part of the blocks]: under an expert axis every MoE block splits its experts unless the
# MILP keeps some blocks' experts whole: a variant of the block template (NOTE [block variants] in
# `treadle.planner.variants`), w of its blocks, never the first. Such a block is built without `expert_parallel`:
# its experts replicated and all-reduced by DDP with the other parameters. Against a split block it saves the
# exchanges (forward and backward seconds, the dispatch's traffic on compute, a checkpointed block's recompute of
# the forward ones: `rec_credit_s`) and the local backward's sum of the experts' gradients over the replicas outside
# the group (`grad_sum_s`); it pays the experts' full parameter, gradient and optimizer bytes, their optimizer step
# and their all-reduce (the data form's own terms of each parameter, replicated on the tensor axes: `param_cost`).
# While any block keeps its experts whole, the template's experts run unsplit over the tensor axes (the strategies
# that split them are `excludes`: build splits each expert only inside expert parallelism). Every difference is a
# constant, so the count enters the MILP linearly and exactly, and a budget between DDP and every block split is met
# by splitting only as many blocks as it needs.
# Offered under DDP only. Under ZeRO-3 (and HSDP) each rank keeps 1/N of the experts' bytes split or whole, so no
# budget needs the mix; what remains is the exposed sync's kink, where the solver's aggregate window hides a whole
# block's gathers of all its experts, which the price does not: on Mixtral-8x7B, 8x8 H100, such a mix was solved at
# 3.44 s and priced at 4.20 s, against 3.51 s priced for every block split (bench/bench_expert_gpu.py). Not offered
# beside a pipeline (its own MILP), under an uneven load (a busiest rank's extra work would depend on which blocks
# are checkpointed), or where the user stated the expert group (`plan_model(ep_axis=)`: every block's). The
# decisions leave `expert_parallel` off the variant blocks (`variants.pick`).
WHOLE = "experts whole"


def whole_variants(b, cg) -> None:
    """Under DDP with an expert axis at the mean load, without a pipeline, per block template holding experts
    modules, the variant of its blocks that keep their experts whole (NOTE [experts split in part of the
    blocks])."""
    roles, exchanges = b.roles, getattr(b, "expert_exchanges", {})
    if not exchanges or roles.zero or roles.pp is not None or roles.ep_load != 1.0 or not roles.ep_part:
        return
    experts = _experts(b.g.facts)
    n = math.prod(b.cluster.mesh.size(a) for a in roles.ep)
    replicated = tuple(R for _ in b.tp_sizes)
    per_template: dict[int, list[tuple[str, int, Exchange]]] = {}
    for i, x in exchanges.items():
        t = cg.units[cg.unit_of[i][0]].template
        if t is not None and cg.templates[t].count > 1:
            per_template.setdefault(t, []).append((_inside(b.nodes[i].module, experts), i, x))
    for t, found in sorted(per_template.items()):
        d, credit, paths = StrategyCost(), 0.0, tuple(p for p, _, _ in found)
        for _, i, x in found:  # no exchanges
            d.comm_s -= x.fwd_s + x.bwd_s
            d.compute_s -= x.work_fwd_s + x.work_bwd_s + x.host_s
            d.fwd_s -= x.fwd_s + x.work_fwd_s
            d.bwd_s -= x.work_bwd_s
            d.bwd_comm_s -= x.bwd_s
            if b.recomputed(i) != "none":
                credit += x.fwd_s + x.work_fwd_s
        for src in b.nodes:  # the experts' weights whole, and reduced by the data form
            if src.kind != "param" or src.param not in b.own_split or b.canonical(src.index) != src.index \
                    or not _inside(b.g.param_modules.get(src.param, ""), paths):
                continue
            meta = src.out
            d.static_bytes += b.param_static_bytes(meta, replicated) - b.owned_static_bytes(src, replicated)
            d.static_grad_bytes += (b.param_grad_static_bytes(meta, replicated)
                                    - b.param_grad_static_bytes(meta, replicated, b.own_split[src.param]))
            d.grad_bytes += meta.numel * meta.dtype.itemsize * (1 - 1 / b.own_split[src.param])
            local = meta.numel * meta.dtype.itemsize / n
            if b.expert_grad_sum is not None:  # nor the local backward's sum over the other replicas
                d.comm_s -= grad_sum_s(b.expert_grad_sum, local)
                d.bwd_comm_s -= grad_sum_s(b.expert_grad_sum, local)
            opt = b.optimizer_s(meta, replicated) - b.optimizer_s(meta, replicated, b.own_split[src.param])
            d.compute_s += opt
            d.opt_s += opt
            for f in forms():
                f.param_cost(b, meta, replicated, d)
        excludes = tuple((u, k) for u in cg.templates[t].units for k, members in enumerate(cg.units[u].strategies)
                         if any(_inside(b.nodes[i].module, paths) and any(p != R for o in combo for p in o.ins + o.outs)
                                for i, (combo, _) in members.items()))
        cg.variants.setdefault(t, []).append(Variant("expert", WHOLE, cg.templates[t].count - 1, d, credit, excludes,
                                                     module=paths[0]))


def decide_node(ctx, i: int, n, combo: tuple, raw: tuple, pub: tuple) -> set[str]:
    """A node inside an experts module: the split of the experts' weights over a tensor axis is stated by
    ``expert_parallel(tensor=)`` (build finds the same split, NOTE [experts split by tensor]), not by shards, and
    the pending sum leaving the module is the sum the local forward issues, not a sync: the core's shards of its
    weights are taken back and every axis of its exit is stated here."""
    cg = ctx.cg
    experts = _experts(cg.graph.facts)
    path = _inside(n.module, experts) if cg.roles.ep else None
    if path is None:
        return set()
    shards = ctx.bucket("shards")
    tensor = ctx.memo.setdefault("expert_tensor", {})
    own = set(_members(cg, path, i))
    for key in [k for k in shards if k[0] in own]:
        del shards[key]
        for m in own:
            tensor[m] = key[3]
    return set(ctx.axes)


def _whole_blocks(cg, ckpt: dict[int, int], counts: dict) -> list[str]:
    """The real blocks that keep their experts whole in a solution (`variants.pick`)."""
    out = []
    for (t, name), w in sorted(counts.items()):
        if name == WHOLE and w:
            info = cg.templates[t]
            out += pick(info.members, w, _spread(info.members, ckpt.get(t, 0)))
    return out


def decisions(cg, choice, ckpt, ctx) -> list:
    """``expert_parallel(axis=ep)`` on every experts module of the model (the capture's facts: all blocks), with
    ``tensor=`` where the plan splits each expert's weights over a tensor axis (`decide_node`)."""
    ep = cg.roles.ep
    if not ep:
        return []
    tensor = ctx.memo.get("expert_tensor", {})
    whole = _whole_blocks(cg, ckpt, ctx.memo.get("variants", {}))
    out = []
    for path, e in sorted(_experts(cg.graph.facts).items()):
        if _inside(path, whole):
            continue  # its block keeps the experts whole (NOTE [experts split in part of the blocks])
        args = {"axis": ep[0] if len(ep) == 1 else list(ep), **({"tensor": tensor[path]} if path in tensor else {}),
                **({"load_imbalance": cg.roles.ep_load} if cg.roles.ep_load != 1.0 else {})}
        why = f"{e} experts over {','.join(ep)}" + (f", each split over {tensor[path]}" if path in tensor else "") + (
            f", priced for a busiest rank at {cg.roles.ep_load:g}x the mean rows" if cg.roles.ep_load != 1.0 else "")
        out.append((DECISION_RANK, path, Decision("expert_parallel", path, args,
                                                  why + " (NOTE [experts in the plan])")))
    return out
