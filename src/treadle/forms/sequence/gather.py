"""Sequence-parallel gathers whose backward is a reduce-scatter (Megatron-LM's form), priced and emitted.

NOTE [gather with a reduce-scatter backward]. A row-sharded activation (NOTE [sequence parallel] in
`layouts.py`) is gathered back to Replicate before the column-parallel projections that read it (q, k,
v; gate, up). Gathered at the norm's exit, its backward is a local split of the complete gradient, and the
projections' partial input gradients are all-reduced first (NOTE [shared input-gradient sum] in
`treadle.planner.node_costs`): an all-reduce per gather. Megatron-LM instead gathers at the input of the module M that holds
the projections and reduce-scatters their summed partial gradients straight to the row shard: half the
traffic. Build runs that form from ``sch[M].sync("fwd_pre", to=Replicate(), from_=Shard(d))`` plus
``sch[M].sync("bwd_post", to=Shard(d), from_=Partial())`` (`treadle.runtime.sync_plan`: the gather's
backward reduce-scatters, and nothing else reduces those gradients).

That is exact only when the gradient reaching the gather is a pure pending sum, so a gather qualifies when
1. the gathered value `j` is a (B, T, E) exit inside the repeated blocks, and all its readers lie inside
   one module M that does not hold j's producer (`consumer_module`);
2. inside M, j is the only value that needs a gradient read from outside M (M's other inputs are masks,
   rotary tables: no gradient), so j is the input that M's ``fwd_pre`` sync converts; and
3. in the chosen plan every reader of j is sharded on that axis with a pending-sum input gradient, no other
   op under M is (build's reduce-scatter takes over every column-parallel leaf under M; the ILP states both
   per node, `ilp_rows`), and j's exit changes that axis only, from Shard(d) to Replicate.
The ILP credits each qualifying gather ``all_reduce - reduce_scatter`` of j's gradient (variable z <= the
gather strategy, z <= each reader's partial strategies, z <= the gradient sum it replaces); `evaluate`,
the decisions and the explanation's rows apply the same test to a choice (`active`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...cost.collective_cost import all_reduce_time_s, reduce_scatter_time_s
from ...cost.convert import grad_sum_ops, runtime_ops
from ...placement import R
from ...planner.capture import CapturedGraph, TensorMeta
from ...planner.ilp import _SECONDS
from ...planner.node_costs import _tensor_axes_divisor

_RESHAPES = {"view", "reshape", "_unsafe_view", "flatten"}


@dataclass(frozen=True, slots=True)
class SPGather:
    """One candidate: node `j` (canonical) gathered on tensor axis index `k` at the input of module `module`.
    `unit` and `gathers` are j's unit and its strategies that gather on axis k (Shard(dim) -> Replicate,
    other axes unchanged); `readers` lists per reader node (its unit, its strategies whose input gradient
    from j is a pending sum on axis k); `inner` per other op node under M, its strategies with a pending-sum
    input gradient on axis k (forbidden: build's reduce-scatter claims every column-parallel leaf under M);
    `count` executions; `saving_s` per execution."""

    j: int
    k: int
    module: str
    dim: int
    unit: int
    gathers: tuple[int, ...]
    readers: tuple[tuple[int, tuple[int, ...]], ...]
    inner: tuple[tuple[int, tuple[int, ...]], ...]
    count: int
    saving_s: float
    sums: tuple[tuple[int, int, int], ...] = ()  # the input-gradient sums it replaces (`grad_sum_keys`' keys)


def _under(path: str, ancestor: str) -> bool:
    return path == ancestor or path.startswith(ancestor + ".")


def consumer_module(graph: CapturedGraph, j: int, needs_grad) -> str | None:
    """Conditions 1 and 2 of NOTE [gather with a reduce-scatter backward]: the module M whose input `j` is, or
    None. `needs_grad(i)`: whether node i's value needs a gradient."""
    n = graph.nodes[j]
    meta = n.out
    if n.block is None or not n.users or not isinstance(meta, TensorMeta) or len(meta.shape) != 3:
        return None
    mods = [graph.nodes[u].module for u in n.users]
    parts = mods[0].split(".") if mods[0] else []
    common = []
    for i, p in enumerate(parts):
        if all(m.split(".")[i:i + 1] == [p] for m in mods):
            common.append(p)
        else:
            break
    q = ".".join(common)
    if not q or _under(n.module, q) or any(graph.nodes[u].kind != "op" for u in n.users):
        return None
    for x in graph.nodes:
        if x.kind != "op" or not _under(x.module, q):
            continue
        for i in x.inputs:
            src = graph.nodes[i]
            if i != j and src.kind != "param" and not _under(src.module, q) and needs_grad(i):
                return None  # M reads another value with a gradient from outside: j may not be its input
    return q


def terms(cg) -> list[SPGather]:
    """The candidates of a cost graph."""
    return cg.form_terms.get("sequence", [])


def _saving_s(b, nbytes: float, size: int, link, d: int) -> float:
    """Seconds one gather's backward saves as a reduce-scatter of the `nbytes` gradient on dim `d`: the gradient
    sum (all-reduce) and the exit gather's backward (a split), each with the runtime's local ops, against the
    reduce-scatter with its own (NOTE [copies] in `treadle.cost.convert`)."""
    plain = (all_reduce_time_s(nbytes, size, link) + b.local_ops_s(sum(grad_sum_ops(nbytes), ()))
             + b.local_ops_s(runtime_ops("all_gather", d, nbytes / size, size)[1]))
    return plain - reduce_scatter_time_s(nbytes, size, link) - b.local_ops_s(
        runtime_ops("reduce_scatter", d, nbytes, size)[0])


def find_sp_gathers(b, cg) -> list[SPGather]:
    """The candidates of a cost graph under construction (`b`: the `cost_graph._Builder`): those whose every
    input-gradient sum it replaces is one some strategy needs (a sum the MILP states, so it can bound the credit by
    it: `ilp_rows`)."""
    if not b.tp_axes:
        return []
    from ..tensor.plan import grad_sum_keys

    units, unit_of, keys = cg.units, cg.unit_of, grad_sum_keys(cg)
    out: list[SPGather] = []
    for j, q in b.exit_of.items():
        if q is None:
            continue
        M = consumer_module(b.g, j, lambda i: b.rg[i])
        if M is None or j not in unit_of:
            continue
        uj = unit_of[j][0]
        unit = units[uj]
        for k, size in enumerate(b.tp_sizes):
            by_dim: dict[int, list[int]] = {}
            nbytes = 0.0
            for s, members in enumerate(unit.strategies):
                combo, pub = members[j]
                raw = tuple(o.outs[0] for o in combo)
                if (raw[k] in (0, 1) and pub[k] == R
                        and all(raw[i] == pub[i] for i in range(len(raw)) if i != k)):
                    by_dim.setdefault(raw[k], []).append(s)
                    meta = b.nodes[j].out
                    nbytes = max(nbytes, meta.nbytes / _tensor_axes_divisor(pub, b.tp_sizes) / b.dp_div(j))
            if not by_dim:
                continue
            readers = _readers(b, j, k, units, unit_of)
            if not readers:
                continue
            inner = _inner(b, {v for _, _, v, _ in readers}, k, M, units, unit_of)
            # the sums it replaces, keyed as the tensor form keys them: the value each reader reads (j, or the
            # reshape of it: GPT-2's Conv1D reads a flattened view)
            sums = tuple(sorted({(b.canonical(src), k, units[u].count) for u, _, _, src in readers}))
            readers = tuple((u, ok) for u, ok, _, _ in readers)
            link = b.cluster.link(b.tp_axes[k])
            for d, gathers in sorted(by_dim.items()):
                saving = _saving_s(b, nbytes, size, link, d)
                if saving > 0 and all(key in keys for key in sums):
                    out.append(SPGather(j, k, M, d, uj, tuple(gathers), readers, inner, unit.count, saving, sums))
    return out


def _readers(b, j: int, k: int, units, unit_of) -> tuple | None:
    """Per reader of `j` (through reshapes): its unit, the strategies whose input gradient from j is a pending
    sum on axis k, the node and the value it reads (j or a reshape of it); None when some reader has none."""
    readers = []
    for v in b.nodes[j].users:
        if v not in unit_of:
            return None
        if b.nodes[v].op_name in _RESHAPES and len(b.nodes[v].inputs) == 1:  # Conv1D's flattening view
            more = _readers(b, v, k, units, unit_of)
            if not more:
                return None
            readers += more
            continue
        uv = unit_of[v][0]
        pos = [p for p, i in enumerate(b.nodes[v].inputs) if i == j]
        ok = tuple(s for s, members in enumerate(units[uv].strategies)
                   if v in members and members[v][0] and all(members[v][0][k].grad_partial[p] for p in pos))
        if not ok:
            return None
        readers.append((uv, ok, v, j))
    return tuple(readers)


def _inner(b, skip: set[int], k: int, module: str, units, unit_of) -> tuple:
    """Per other op node under `module`: its strategies with a pending-sum gradient on axis k for an input that
    needs one (what build's reduce-scatter would wrongly take over)."""
    inner = []
    for x in b.nodes:
        if x.kind != "op" or x.index in skip or not _under(x.module, module) or x.index not in unit_of:
            continue
        ux = unit_of[x.index][0]
        grads = [p for p, i in enumerate(x.inputs) if b.nodes[i].kind != "param" and b.rg[i]]
        bad = tuple(s for s, members in enumerate(units[ux].strategies)
                    if x.index in members and members[x.index][0]
                    and any(members[x.index][0][k].grad_partial[p] for p in grads))
        if bad:
            inner.append((ux, bad))
    return tuple(inner)


def active(cg, choice: list[int]) -> list[SPGather]:
    """The candidates a choice realises (condition 3)."""
    return [g for g in terms(cg) if choice[g.unit] in g.gathers
            and all(choice[u] in ok for u, ok in g.readers) and not any(choice[u] in bad for u, bad in g.inner)]


def ilp_rows(m, cg, s, shared: dict) -> None:
    """z <= the gradient sum it replaces (``shared["grad_sum_vars"]``, set by the tensor-parallel rows), z <= the
    gather strategies, z <= each reader's pending-sum strategies, z <= 1 - each other node's pending-sum
    strategies; z credits count x (all-reduce - reduce-scatter) seconds (family sp_gather). Each z, with its
    gathered value's unit and seconds a execution, in ``shared["sp_credit_vars"]``: a pipeline's MILP, which states
    its own objective, credits it on the stages that unit runs in (NOTE [pipeline in the plan])."""
    ys = shared.get("grad_sum_vars", {})
    for g in terms(cg):
        if not all(key in ys for key in g.sums):
            continue
        z = m.var(ub=1.0, cost=-g.count * g.saving_s * _SECONDS)
        shared.setdefault("sp_credit_vars", []).append((z, g.unit, g.saving_s))  # a pipeline's stages read it
        for key in g.sums:
            m.row({z: 1.0, ys[key]: -1.0}, -math.inf, 0.0, "sp_gather")
        m.row({z: 1.0, **{s[g.unit, k]: -1.0 for k in g.gathers}}, -math.inf, 0.0, "sp_gather")
        for u, ok in g.readers:
            m.row({z: 1.0, **{s[u, k]: -1.0 for k in ok}}, -math.inf, 0.0, "sp_gather")
        for u, bad in g.inner:
            m.row({z: 1.0, **{s[u, k]: 1.0 for k in bad}}, -math.inf, 1.0, "sp_gather")


def evaluate(cg, choice: list[int], acc: dict) -> None:
    """The credit of each gather the choice realises, off ``acc["comm_s"]``."""
    acc["comm_s"] -= sum(g.count * g.saving_s for g in active(cg, choice))


def adjust_rows(cg, choice: list[int], rows: dict, shared: dict) -> None:
    """A realised gather reduce-scatters the input-gradient sum its readers would all-reduce: the credit goes to
    the row that sum was billed to (``shared["billed"]``: (node, axis, count) -> row path, by the tensor form)."""
    billed = shared.get("billed", {})
    for g in active(cg, choice):
        path = billed.get(g.sums[0])  # (a candidate has a reader, so a sum)
        if path is not None:
            rows[path].comm_s -= g.count * g.saving_s
