"""Assembling the cost graph's pieces once every node has its strategies: which strategy of a unit a member node
runs (`_strategy_of`), the followers merged into their leader (NOTE [followers]), the layout-equality edges and
the repeated-block templates (a mixin of `cost_graph._Builder`, which provides the attributes read here)."""

from __future__ import annotations

from dataclasses import dataclass

from .capture import Node, TensorMeta
from .node_costs import _tensor_axes_divisor


@dataclass(frozen=True, slots=True)
class Edge:
    """Equality of a placement between unit `u` (value per strategy) and unit `v` (value per strategy)."""

    u: int
    v: int
    u_vals: tuple
    v_vals: tuple
    what: str


@dataclass(slots=True)
class TemplateInfo:
    """A repeated block template: `count` real blocks, its units, and the unit/bytes of its input."""

    template: int
    path: str
    members: list[str]
    count: int
    units: list[int]
    input_unit: int | None
    input_bytes: list[float]  # per strategy of input_unit: bytes kept by a checkpointed block


class Assembly:
    """Methods of `cost_graph._Builder` that put units, edges and templates together."""

    def _template(self, i: int) -> int | None:
        b = self.nodes[i].block
        return None if b is None else self.g.blocks[b].template

    def _strategy_of(self, i: int, unit_of, node_strats) -> tuple[int, list]:
        """(unit index, per unit strategy k: (combo, pub) of node i)."""
        uidx, mapping = unit_of[i]
        strat = node_strats[i]
        if mapping is None:
            return uidx, list(strat)
        return uidx, [strat[mapping[k]] for k in sorted(mapping)]

    def _follow(self, n: Node, u: int, node_strats, unit_of, units) -> dict[int, int] | None:
        if u not in unit_of:
            return None
        if self._template(n.index) != self._template(u):
            return None
        uidx, u_strats = self._strategy_of(u, unit_of, node_strats)
        positions = [pos for pos, j in enumerate(n.inputs) if self.canonical(j) == u]
        # n's strategies by the placements they read at those positions (each one's own, in order)
        by_input: dict[tuple, list[int]] = {}
        for l, (combo, _) in enumerate(node_strats[n.index]):
            by_input.setdefault(tuple(tuple(o.ins[pos] for o in combo) for pos in positions), []).append(l)
        mapping: dict[int, int] = {}
        for k, (combo_u, pub_u) in enumerate(u_strats):
            match = by_input.get((pub_u,) * len(positions), [])  # those that read u's published layout at each
            if len(match) != 1:
                return None
            mapping[k] = match[0]
        return mapping

    def _edges(self, units, unit_of, node_strats) -> list[Edge]:
        seen = set()
        edges: list[Edge] = []
        for n in self.nodes:
            if n.kind != "op":
                continue
            v = self.canonical(n.index)
            vu, v_strats = self._strategy_of(v, unit_of, node_strats)
            for pos, j in enumerate(self.nodes[v].inputs):
                pass
            for pos, j0 in enumerate(n.inputs):
                src = self.nodes[j0]
                if src.kind != "op":
                    continue
                u = self.canonical(j0)
                uu, u_strats = self._strategy_of(u, unit_of, node_strats)
                if uu == vu:
                    continue
                key = (uu, u, vu, v, pos)
                if key in seen:
                    continue
                seen.add(key)
                u_vals = tuple(pub for _, pub in u_strats)
                v_vals = tuple(tuple(o.ins[pos] for o in combo) for combo, _ in v_strats)
                if len(set(u_vals)) == 1 and set(v_vals) == set(u_vals):
                    continue
                edges.append(Edge(uu, vu, u_vals, v_vals, f"{src.name}->{n.name}"))
        # tied parameters: every consumer reads one layout
        consumers: dict[str, list[tuple[int, int]]] = {}
        for n in self.nodes:
            if n.kind == "op" and self.canonical(n.index) == n.index:
                for pos, j in enumerate(n.inputs):
                    if self.nodes[j].kind == "param":
                        consumers.setdefault(self.nodes[j].param, []).append((n.index, pos))
        for p, cons in consumers.items():
            for (a, pa), (b, pb) in zip(cons, cons[1:]):
                ua, sa = self._strategy_of(a, unit_of, node_strats)
                ub, sb = self._strategy_of(b, unit_of, node_strats)
                va = tuple(tuple(o.ins[pa] for o in combo) for combo, _ in sa)
                vb = tuple(tuple(o.ins[pb] for o in combo) for combo, _ in sb)
                if ua == ub and va == vb:
                    continue
                edges.append(Edge(ua, ub, va, vb, f"tied parameter {p}"))
        return edges

    def _templates(self, units, unit_of, node_strats) -> dict[int, TemplateInfo]:
        out: dict[int, TemplateInfo] = {}
        for t in sorted({b.template for b in self.g.blocks}):
            blk = self.g.blocks[t]
            members = [m for b in self.g.blocks if b.template == t for m in b.members]
            tunits = sorted({unit_of[i][0] for i in blk.nodes if i in unit_of})
            # the block's input: the largest activation entering from outside the block
            best, best_bytes = None, -1
            inside = set(blk.nodes)
            for i in blk.nodes:
                for j in self.nodes[i].inputs:
                    if j not in inside and self.nodes[j].kind == "op" and isinstance(self.nodes[j].out, TensorMeta):
                        if self.nodes[j].out.nbytes > best_bytes:
                            best, best_bytes = j, self.nodes[j].out.nbytes
            input_unit, input_bytes = None, []
            if best is not None:
                cj = self.canonical(best)
                input_unit, s = self._strategy_of(cj, unit_of, node_strats)
                meta = self.nodes[best].out
                input_bytes = [meta.nbytes / _tensor_axes_divisor(pub, self.tp_sizes) / self.dp_div(best)
                               for _, pub in s]
            out[t] = TemplateInfo(t, blk.path, members, len(members), tunits, input_unit, input_bytes)
        return out
