"""Sequence parallelism's decisions: a pending sum that enters the blocks sharded is reduced at its module's exit and
sliced at the first block's input (``sync("fwd_pre", to=Shard(d))`` on that block), and a gather with a
reduce-scatter backward is stated at the consumer module's input (``sync("fwd_pre", to=R, from_=S(d))`` and
``sync("bwd_post", to=S(d), from_=P)``: NOTE [gather with a reduce-scatter backward] in `gather.py`)."""

from __future__ import annotations

from ...placement import P, R, placement_str
from ...planner.cost_graph import exit_module
from ...planner.to_schedule import DECISION_RANKS, Decision, DecisionContext, _members
from .gather import active
from .layouts import entry_block


def decide_node(ctx: DecisionContext, i: int, n, combo: tuple, raw: tuple, pub: tuple) -> set[str]:
    """State node `i`'s change of layout where it is sequence parallelism's; returns the axes stated."""
    if raw == pub:
        return set()
    cg, axes = ctx.cg, ctx.axes
    g = cg.graph
    blk = entry_block(g, n)
    if blk is not None and all(r in (R, P) for r in raw) and any(p >= 0 for p in pub):
        # NOTE [sequence parallel] in layouts.py: a pending sum is reduced at its module's exit, then the value is
        # sliced at the input of the block it enters
        syncs = ctx.bucket("syncs")
        entries = ctx.bucket("sp_entries", DECISION_RANKS["sp_entries"], _emit_entries)
        q = exit_module(g, n)
        for a, r, p in zip(axes, raw, pub):
            if r == P:
                for m in _members(cg, q, i):
                    syncs[(m, a)] = {"to": "R", "from_": "P", "node": n.name, "layout": None}
            if p >= 0:
                entries[(blk, a)] = {"to": placement_str(p, token=True), "node": n.name}
        return set(axes)
    if "sp_in" not in ctx.memo:  # the gathers the choice realises, by (gathered node, axis)
        ctx.memo["sp_in"] = {(sg.j, axes[sg.k]): sg for sg in active(cg, ctx.choice)}
    sp_in = ctx.memo["sp_in"]
    stated = set()
    for a, r, p in zip(axes, raw, pub):
        if r != p and (i, a) in sp_in:
            inputs = ctx.bucket("sp_inputs", DECISION_RANKS["sp_inputs"], _emit_inputs)
            for m in _members(cg, sp_in[(i, a)].module, i):
                inputs[(m, a)] = {"dim": placement_str(r, token=True), "node": n.name}
            stated.add(a)
    return stated


def _emit_inputs(inputs: dict) -> list[Decision]:
    out = []
    for (m, a), d in sorted(inputs.items()):
        why = f"{d['node']} gathered here; its gradient reduce-scattered"
        out.append(Decision("sync", m, {"mode": "fwd_pre", "to": "R", "from_": d["dim"], "axis": a}, why))
        out.append(Decision("sync", m, {"mode": "bwd_post", "to": d["dim"], "from_": "P", "axis": a}, why))
    return out


def _emit_entries(entries: dict) -> list[Decision]:
    return [Decision("sync", m, {"mode": "fwd_pre", "to": d["to"], "from_": "R", "axis": a},
                     f"{d['node']} enters the blocks") for (m, a), d in sorted(entries.items())]
