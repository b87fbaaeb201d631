"""The checkpoint count's variables of the planner's MILP, shared by the core (`ilp.py`), the selective policies
(`policies.py`) and a pipeline's stages: a block's linear expressions (saved bytes, recompute seconds, kept input),
a count in binary with its McCormick products, and the MILP's units (NOTE [row scaling])."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cost_graph import CostGraph
    from .ilp import _Model

# NOTE [row scaling]: byte quantities enter the MILP in GiB. With raw bytes (1e9..1e11) next to 0/1
# variables, HiGHS's absolute tolerances let McCormick rows go slack and it reported "optimal" for a
# solution 2% worse than a feasible one (llama-2-7b, 16x4 H100, 40 GiB); in GiB the rows are well scaled.
_BYTES = 2.0**-30
_SECONDS = 1e3  # and seconds in ms: HiGHS drops matrix entries below 1e-9


def _block_exprs(cg: CostGraph, s, t: int):
    info = cg.templates[t]
    A: dict[int, float] = {}
    F: dict[int, float] = {}
    for u in info.units:
        unit = cg.units[u]
        for k, c in enumerate(unit.costs):
            if c.act_bytes:
                A[s[u, k]] = A.get(s[u, k], 0.0) + c.act_bytes * _BYTES
            if c.rec_s:  # what the recompute runs again (NOTE [recompute stops early] in saved.py)
                F[s[u, k]] = F.get(s[u, k], 0.0) + c.rec_s * _SECONDS
    In: dict[int, float] = {}
    if info.input_unit is not None:
        for k, b in enumerate(info.input_bytes):
            In[s[info.input_unit, k]] = In.get(s[info.input_unit, k], 0.0) + b * _BYTES
    return A, F, In


def _upper(cg: CostGraph, units: list[int], attr: str) -> float:
    return sum(max(getattr(c, attr) for c in cg.units[u].costs) for u in units)


@dataclass(slots=True)
class CheckpointVars:
    """One checkpoint count c of blocks like a template (`checkpoint_vars`): its bits `ys` (c = sum 2^b ys[b]),
    q (c > 0), and the McCormick products per bit zA = y A, zF = y F, zI = y In, and zT = q A."""

    ys: list[int]
    q: int
    zA: list[int]
    zF: list[int]
    zI: list[int]
    zT: int


def checkpoint_vars(m: _Model, count: int, A: dict, F: dict, In: dict, bounds: tuple[float, float, float], *,
                    host: float, enabled: bool, least: int = 0, transient: dict | None = None) -> CheckpointVars:
    """A checkpoint count in [least, count] of blocks whose saved bytes, recomputed seconds and kept input are the
    linear expressions `A`, `F`, `In` (scaled: NOTE [row scaling]; `bounds` their upper bounds), each
    checkpointed block costing `host` (scaled) in the objective, its recompute zF at cost 1 (ckpt_count,
    ckpt_linearise, ckpt_any). `transient`: what one such block holds again in backward, at most A (default A)."""
    Amax, Fmax, Imax = bounds
    nb = max(1, math.ceil(math.log2(count + 1)))
    ys = [m.var(ub=1.0 if enabled else 0.0, integer=True, cost=float(2 ** b) * host) for b in range(nb)]
    m.row({y: float(2 ** b) for b, y in enumerate(ys)}, float(least), float(count), "ckpt_count")
    zA, zF, zI = [], [], []
    for b, y in enumerate(ys):
        w = float(2 ** b)
        for expr, ub, store, cost in ((A, Amax, zA, 0.0), (F, Fmax, zF, w), (In, Imax, zI, 0.0)):
            z = m.var(ub=ub, cost=cost)
            store.append(z)
            _mccormick(m, z, y, expr, ub)
    q = m.var(integer=True)
    for y in ys:
        m.row({q: 1.0, y: -1.0}, 0.0, math.inf, "ckpt_any")
    zt = m.var(ub=Amax)
    _mccormick(m, zt, q, A if transient is None else transient, Amax)
    return CheckpointVars(ys, q, zA, zF, zI, zt)


def block_bounds(cg: CostGraph, t: int) -> tuple[float, float, float]:
    """Upper bounds (scaled) of a block of template t's saved bytes, recomputed seconds and kept input."""
    info = cg.templates[t]
    return (max(_upper(cg, info.units, "act_bytes") * _BYTES, 1e-9), max(_upper(cg, info.units, "rec_s") * _SECONDS, 1e-9),
            max(info.input_bytes, default=0.0) * _BYTES or 1e-9)


def _mccormick(m: _Model, z: int, y: int, expr: dict[int, float], ub: float) -> None:
    """z = y * expr for binary y and 0 <= expr <= ub (exact)."""
    m.row({z: 1.0, y: -ub}, -math.inf, 0.0, "ckpt_linearise")
    row = {z: 1.0}
    for j, v in expr.items():
        row[j] = row.get(j, 0.0) - v
    m.row(row, -math.inf, 0.0, "ckpt_linearise")
    row = {z: 1.0, y: -ub}
    for j, v in expr.items():
        row[j] = row.get(j, 0.0) - v
    m.row(row, -ub, math.inf, "ckpt_linearise")
