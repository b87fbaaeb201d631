"""Exact checkpoint choice on a chain of blocks, for the two-stage mode (sharding fixed first).

Each block, if checkpointed, keeps only its input (`input_bytes`) instead of its saved activations
(`act_bytes`) and costs its forward again (`fwd_s`) in backward; one recomputed block is alive at a time
in backward, so the peak adds the largest checkpointed block's activations (the transient). Minimise the
recomputation time subject to

    base_bytes + sum_kept act_bytes + sum_ckpt input_bytes + max_ckpt act_bytes <= budget_bytes.

Solved exactly: for every candidate transient (each distinct block size, or none), a dynamic program over
the chain keeps the Pareto front of (bytes saved, seconds spent); dominated states are dropped, so the
front stays small when blocks repeat. `solve_chain` is a pure function (bytes and seconds); `two_stage` is the
planner's two-stage mode around it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cost_graph import CostGraph
    from .ilp import Solution


@dataclass(frozen=True, slots=True)
class ChainBlock:
    """One block of the chain: `count` identical blocks with per-block bytes and seconds."""

    count: int
    act_bytes: float
    input_bytes: float
    fwd_s: float


@dataclass(frozen=True, slots=True)
class ChainResult:
    counts: tuple[int, ...]  # checkpointed blocks per ChainBlock
    recompute_s: float
    peak_bytes: float
    feasible: bool


def solve_chain(blocks: list[ChainBlock], *, base_bytes: float, budget_bytes: float) -> ChainResult:
    """Fewest recomputation seconds with the peak under `budget_bytes` (see module doc). When even
    checkpointing everything does not fit, returns the smallest-peak choice with ``feasible=False``."""
    full = base_bytes + sum(b.count * b.act_bytes for b in blocks)
    best: ChainResult | None = None
    taus = sorted({0.0} | {b.act_bytes for b in blocks if b.count and b.act_bytes > b.input_bytes})
    for tau in taus:
        need = full + tau - budget_bytes  # bytes that checkpointing must save
        # Pareto front over blocks: saved -> min seconds (per distinct counts vector)
        front: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
        for b in blocks:
            gain = b.act_bytes - b.input_bytes
            allowed = tau > 0 and b.act_bytes <= tau and gain > 0
            nxt = []
            for saved, cost, counts in front:
                for c in range(b.count + 1 if allowed else 1):
                    nxt.append((saved + c * gain, cost + c * b.fwd_s, counts + (c,)))
            nxt.sort(key=lambda x: (-x[0], x[1]))
            front = []
            best_cost = math.inf
            for st in nxt:  # keep states not dominated (more saved for less cost)
                if st[1] < best_cost - 1e-18:
                    front.append(st)
                    best_cost = st[1]
        for saved, cost, counts in front:
            used_tau = max((b.act_bytes for b, c in zip(blocks, counts) if c), default=0.0)
            peak = full - saved + used_tau
            ok = peak <= budget_bytes * (1 + 1e-12)
            cand = ChainResult(counts, cost, peak, ok)
            if best is None or _better(cand, best):
                best = cand
        del need
    if best is None:  # unreachable: taus always holds 0.0, whose front holds the empty choice
        return ChainResult(tuple(0 for _ in blocks), 0.0, full, full <= budget_bytes)
    return best


def _better(a: ChainResult, b: ChainResult) -> bool:
    if a.feasible != b.feasible:
        return a.feasible
    if a.feasible:
        return (a.recompute_s, a.peak_bytes) < (b.recompute_s, b.peak_bytes)
    return a.peak_bytes < b.peak_bytes


def two_stage(cg: CostGraph, budget: float | None, time_limit_s: float) -> Solution:
    """Stage one: the shardings under a budget on static memory only (no checkpoints); stage two: the exact chain DP
    (`solve_chain`) picks the checkpoint counts for those shardings. A pipeline's stages are solved whole."""
    from .ilp import Solution, evaluate, solve

    if cg.roles.pp is not None:  # a pipeline's stages are solved whole (NOTE [pipeline in the plan])
        return solve(cg, budget_bytes=budget, time_limit_s=time_limit_s)
    sol = solve(cg, budget_bytes=budget, checkpoint=False, time_limit_s=time_limit_s, memory="static")
    if sol.status == "infeasible":
        return sol
    step, peak, terms = evaluate(cg, sol.choice, {}, sol.variants)
    if budget is None or peak <= budget:
        return sol
    tids = list(cg.templates)
    blocks = []
    for t in tids:
        info = cg.templates[t]
        A = sum(cg.units[u].costs[sol.choice[u]].act_bytes for u in info.units)
        F = sum(cg.units[u].costs[sol.choice[u]].rec_s for u in info.units)
        In = info.input_bytes[sol.choice[info.input_unit]] if info.input_unit is not None else 0.0
        blocks.append(ChainBlock(info.count, A, In, F))
    base = peak - sum(b.count * b.act_bytes for b in blocks)  # everything but the blocks' activations
    res = solve_chain(blocks, base_bytes=base, budget_bytes=budget)
    ckpt = dict(zip(tids, res.counts))
    step, peak, terms = evaluate(cg, sol.choice, ckpt, sol.variants)
    status = sol.status if res.feasible else "infeasible"
    return Solution(sol.choice, ckpt, step, peak, status, sol.gap, sol.solve_s, sol.n_vars, sol.n_cons, terms,
                    variants=sol.variants)
