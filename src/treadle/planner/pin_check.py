"""Why a pin cannot hold: name the pin (pattern, axis, placement) and the op that blocks it.

`plan_model` calls `pin_conflict` when no role assignment has a plan even without the memory row (the
solver's "smallest budget" would be infinite). Two ways a pin fails, per role assignment:

* *at one op* (the cost graph cannot be built): the op reading the pinned parameter has no strategy
  with that layout. `_node_reason` says which filter removed the last candidate, in the order the cost
  graph applies them: the op's dimension rule (an op without a sharding rule runs replicated), the
  runtime's sharded-compute rules (`treadle.runtime.leaf_rules`: only leaf modules it knows can hold a
  sharded parameter), a size that does not divide, a user input / buffer / constant read sharded (they
  stay replicated on tensor axes), a reshape whose size is a module attribute (NOTE [fixed view sizes]).
* *between ops* (the cost graph builds, the ILP without the memory row is infeasible): the layouts the
  pin forces cannot be matched along an edge. `_blocking_edge` propagates the strategy sets along the
  layout-equality edges (arc consistency) until one set empties: the other end of that edge is the op
  that blocks (e.g. a LayerNorm that never publishes its normalised dim sharded to a row-parallel linear).

With several pin patterns, each is tried alone (`rebuild`) so the message names the one that fails.
Pure functions of the captured graph and cost graph; nothing is solved here but the probes.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

from ..cost.cluster import ClusterSpec
from .capture import CapturedGraph, Node, TensorMeta
from .cost_graph import CostGraph, Roles
from ..placement import ANY_SHARD, R, pin_holds, placement_str
from .dims import dim_spec, strategies, unknown_ops
from .pins import pin_code

_RESHAPES = ("view", "reshape", "_unsafe_view", "expand")
# (cluster, roles, cost graph or None, index of the op without a strategy or None, the builder's message)
Attempt = tuple[ClusterSpec, Roles, "CostGraph | None", "int | None", str]


def _pl(p: int) -> str:
    if p == ANY_SHARD:
        return "Shard(any dim)"
    return "Replicate" if p == R else placement_str(p).replace("S(", "Shard(")


def _layout(pl: tuple[int, ...], axes: tuple[str, ...]) -> str:
    """(2,) on ("tp",) -> "tp:S(2)"; (R, 2) on ("dp", "tp") -> "dp:R,tp:S(2)"; a pin's ANY_SHARD -> "tp:S(any)"."""
    return ",".join(f"{a}:{'S(any)' if p == ANY_SHARD else placement_str(p)}" for a, p in zip(axes, pl)) or "replicated"


def _where(n: Node) -> str:
    return f"{n.module or '<root>'} ({n.op_name}, node {n.name})"


def describe_pin(pattern: str, per_axis: dict) -> str:
    """"pin 'blocks.*.fc.weight' (axis 'tp': Shard(1))"."""
    parts = []
    for axis, v in per_axis.items():
        code = pin_code(v)
        parts.append(f"axis {axis!r}: {_pl(code)}")
    return f"pin {pattern!r} ({', '.join(parts)})"


def _node_reason(graph: CapturedGraph, n: Node, roles: Roles, cluster: ClusterSpec,
                 rpins: dict[str, tuple[int, ...]], is_leaf_param: Callable[[str], bool],
                 module_type: Callable[[str], str]) -> str:
    """Why op `n` has no strategy under `rpins` (first filter of the cost graph that leaves none)."""
    nodes = graph.nodes
    sizes = tuple(cluster.mesh.size(a) for a in roles.tp)
    pinned = [(pos, nodes[j].param) for pos, j in enumerate(n.inputs)
              if nodes[j].kind == "param" and nodes[j].param in rpins]
    for pos, p in pinned:
        meta = graph.params[p]
        for d, a, s in zip(rpins[p], roles.tp, sizes):
            if 0 <= d < len(meta.shape) and meta.shape[d] % s:
                return (f"{p!r} has size {meta.shape[d]} on dim {d}, which does not divide over axis {a!r} of size "
                        f"{s} (read by {_where(n)})")
            if d == ANY_SHARD and all(x % s for x in meta.shape):
                return (f"{p!r} has shape {tuple(meta.shape)}, no dim of which divides over axis {a!r} of size {s} "
                        f"(read by {_where(n)})")
    combos = strategies(n, nodes, dim_spec(n, nodes), sizes)
    for pos, p in pinned:
        combos = [c for c in combos if pin_holds(tuple(o.ins[pos] for o in c), rpins[p])]
        if not combos:
            why = ("it has no sharding rule (it runs replicated)" if n.op_name in unknown_ops([n])
                   else "its dimension rule has no option")
            return f"{_where(n)} reads {p!r}, and {why} with {p!r} as {_layout(rpins[p], roles.tp)}"
    for pos, p in pinned:
        pl = rpins[p]
        if any(x != R for x in pl) and not (is_leaf_param(p) and graph.param_modules.get(p) == n.module):
            owner = graph.param_modules.get(p, "")
            return (f"{_where(n)} reads {p!r}, and the runtime has no sharded-compute rule for module "
                    f"{owner or '<root>'!r} ({module_type(owner)}) (treadle.runtime.leaf_rules): its parameters "
                    f"stay replicated on tensor axes")
    for pos, j in enumerate(n.inputs):
        src = nodes[j]
        if src.kind in ("input", "buffer", "const") and combos and \
                all(any(o.ins[pos] != R for o in c) for c in combos):
            need = sorted({_layout(tuple(o.ins[pos] for o in c), roles.tp) for c in combos})
            return (f"{_where(n)} would read {src.kind} {src.name!r} as {' | '.join(need)}, and user inputs, buffers "
                    f"and constants stay replicated on tensor axes (no op before it can take the layout)")
        if combos and isinstance(src.out, TensorMeta):
            bad = [c for c in combos if not _divides(src.out.shape, tuple(o.ins[pos] for o in c), sizes)]
            if len(bad) == len(combos):  # global shapes: a data-parallel split of the batch is not shown
                return (f"{_where(n)} would read {src.name!r} of shape {tuple(src.out.shape)} as "
                        f"{_layout(tuple(o.ins[pos] for o in combos[0]), roles.tp)}, which does not divide over "
                        f"{dict(zip(roles.tp, sizes))}")
    return f"{_where(n)} has no strategy that meets the pins and the runtime's sharding rules"


def _divides(shape: tuple[int, ...], pl: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    local = list(shape)
    for p, s in zip(pl, sizes):
        if p >= 0:
            if p >= len(local) or local[p] % s:
                return False
            local[p] //= s
    return True


def _blocking_edge(cg: CostGraph) -> str | None:
    """Arc consistency over the layout-equality edges: the first edge whose propagation empties a unit's
    strategy set, described as the producer/consumer pair that blocks and, when one of them was limited
    by propagation, the op the limit comes from; None when propagation finds no empty set."""
    full = [{k for k, ok in enumerate(u.allowed) if ok} for u in cg.units]
    dom = [set(d) for d in full]
    cause: dict[int, Any] = {}  # unit -> the edge that first shrank its strategy set
    by_unit: dict[int, list] = {}
    for e in cg.edges:
        by_unit.setdefault(e.u, []).append(e)
        by_unit.setdefault(e.v, []).append(e)
    queue = deque(cg.edges)
    while queue:
        e = queue.popleft()
        for mine, other, mv, ov in ((e.u, e.v, e.u_vals, e.v_vals), (e.v, e.u, e.v_vals, e.u_vals)):
            offered = {ov[k] for k in dom[other]}
            keep = {k for k in dom[mine] if mv[k] in offered}
            if keep == dom[mine]:
                continue
            if not keep:
                return _edge_text(cg, e, dom, full) + _origin_text(cg, mine, cause, full) + \
                    _origin_text(cg, other, cause, full)
            dom[mine] = keep
            cause.setdefault(mine, e)
            queue.extend(by_unit.get(mine, []))
    return None


def _lay(vals, ks, axes) -> str:
    got = sorted({_layout(vals[k], axes) for k in ks})
    return " | ".join(got[:6]) + (f" | ... {len(got) - 6} more" if len(got) > 6 else "") if got else "nothing"


def _ends(cg: CostGraph, e) -> tuple[Node | None, Node | None]:
    names = {n.name: n for n in cg.graph.nodes}
    src_name, _, dst_name = e.what.partition("->")
    return names.get(src_name), names.get(dst_name)


def _origin_text(cg: CostGraph, unit: int, cause: dict, full: list[set[int]]) -> str:
    """Follow the edges that limited `unit` back to the edge where the limit starts: its two ops with the
    layouts their own strategies allow there."""
    x, hops, seen = unit, 0, {unit}
    last = None
    while x in cause:
        nxt = cause[x].u if cause[x].v == x else cause[x].v
        if nxt in seen:
            break
        last, x = cause[x], nxt
        hops += 1
        seen.add(x)
    if last is None:
        return ""
    a, b = _ends(cg, last)
    if a is None or b is None:
        return f"; the limit comes from {last.what}, {hops} edge(s) away"
    hint = next((f"; {_where(n)} reshapes to sizes {list(n.args[1])} that module attributes or the config fix, "
                 f"so it cannot shard them (NOTE [fixed view sizes] in planner/views.py)" for n in (a, b)
                 if _fixed_view(cg, n)), "")
    axes = cg.roles.tp
    return (f"; the limit comes from {_where(a)} -> {_where(b)}, {hops} edge(s) away, where the first can publish "
            f"{_lay(last.u_vals, full[last.u], axes)} and the second can read {_lay(last.v_vals, full[last.v], axes)}"
            f"{hint}")


def _fixed_view(cg: CostGraph, n: Node) -> bool:
    """Whether reshape `n` has a size that the attribute resolver forbids sharding (NOTE [fixed view sizes])."""
    sizes = n.args[1] if n.op_name in _RESHAPES and len(n.args) > 1 else None
    if cg.attr_resolver is None or not isinstance(sizes, (list, tuple)):
        return False
    return any(isinstance(v, int) and v >= 0 and cg.attr_resolver(n.module, v) == "forbid" for v in sizes)


def _edge_text(cg: CostGraph, e, dom: list[set[int]], full: list[set[int]]) -> str:
    g = cg.graph
    a, b = _ends(cg, e)
    axes = cg.roles.tp
    if a is None or b is None:  # a tied parameter
        return (f"{_where(g.nodes[cg.units[e.u].leader])} and {_where(g.nodes[cg.units[e.v].leader])} share "
                f"{e.what.removeprefix('tied parameter ')!r} but read it in different layouts "
                f"({_lay(e.u_vals, dom[e.u], axes)} vs {_lay(e.v_vals, dom[e.v], axes)})")
    never = not ({e.u_vals[k] for k in full[e.u]} & {e.v_vals[k] for k in full[e.v]})
    if never:
        hint = (f" (it reshapes to sizes {list(a.args[1])} that module attributes or the config fix: NOTE [fixed "
                f"view sizes] in planner/views.py)" if _fixed_view(cg, a) else "")
        return (f"{_where(b)} reads {a.name!r} only as {_lay(e.v_vals, full[e.v], axes)}, which its producer "
                f"{_where(a)}{hint} never publishes (it can publish {_lay(e.u_vals, full[e.u], axes)})")
    return (f"{_where(b)} reads {a.name!r} only as {_lay(e.v_vals, dom[e.v], axes)}, and its producer {_where(a)} "
            f"can publish only {_lay(e.u_vals, dom[e.u], axes)} given the layouts the pins force elsewhere")


def attempt_reason(graph: CapturedGraph, attempt: Attempt, rpins: dict[str, tuple[int, ...]],
                   is_leaf_param: Callable[[str], bool], module_type: Callable[[str], str]) -> str:
    cl, roles, cg, node, msg = attempt
    if cg is None:
        if node is None:
            return msg
        return _node_reason(graph, graph.nodes[node], roles, cl, rpins, is_leaf_param, module_type)
    return _blocking_edge(cg) or ("no choice of layouts meets every pinned layout and the layout-equality edges "
                                  "(the solver without the memory row is infeasible)")


def pin_conflict(graph: CapturedGraph, pins: dict[str, dict], attempts: list[Attempt], *,
                 pins_for: Callable[[dict, Roles], dict | None],
                 probe: Callable[[dict, ClusterSpec, Roles], Attempt | None],
                 is_leaf_param: Callable[[str], bool], module_type: Callable[[str], str]) -> str:
    """The PlanError message for pins no role assignment can hold. `attempts`: every role assignment that
    failed with all pins; `pins_for(pins, roles)` maps pin patterns to captured parameters (None when a pin
    names a data-parallel axis); `probe(pins, cluster, roles)` re-tries one role assignment with some of the
    pins and returns the failed attempt, or None when a plan exists without the memory row."""
    culprits = list(pins)
    if len(pins) > 1 and attempts:
        cl, roles = attempts[0][0], attempts[0][1]
        alone = []
        for pattern in pins:
            sub = {pattern: pins[pattern]}
            if pins_for(sub, roles) is not None and probe(sub, cl, roles) is not None:
                alone.append(pattern)
        culprits = alone or culprits
    head = " and ".join(describe_pin(p, pins[p]) for p in culprits)
    together = "" if len(culprits) == 1 or len(culprits) < len(pins) else " (together)"
    reasons: list[str] = []
    for att in attempts:
        sub = {p: pins[p] for p in culprits}
        rp = pins_for(sub, att[1]) or {}
        if len(culprits) < len(pins):
            retry = probe(sub, att[0], att[1])
            att = retry if retry is not None else att
        r = f"under {att[1]} on {att[0].mesh}: " + attempt_reason(graph, att, rp, is_leaf_param, module_type)
        if r not in reasons:
            reasons.append(r)
    if not reasons:
        axes = sorted({a for p in culprits for a in pins[p]})
        reasons.append(f"every role assignment tried gives axis {', '.join(map(repr, axes))} to data parallelism, "
                       f"where parameters are replicated (or ZeRO-3-sharded by the runtime)")
    more = f"; ... {len(reasons) - 2} more role assignments" if len(reasons) > 2 else ""
    return (f"{head} cannot hold{together}: " + "; ".join(reasons[:2]) + more +
            " — drop or change the pin, or pin the blocking op's parameters too")


__all__ = ["pin_conflict", "describe_pin", "attempt_reason"]
