"""Exact checkpoint choice on a chain of blocks, for the two-stage mode (sharding fixed first).

Each block, if checkpointed, keeps only its input (`input_bytes`) instead of its saved activations
(`act_bytes`) and costs its forward again (`fwd_s`) in backward; one recomputed block is alive at a time
in backward, so the peak adds the largest checkpointed block's activations (the transient). Minimise the
recomputation time subject to

    base_bytes + sum_kept act_bytes + sum_ckpt input_bytes + max_ckpt act_bytes <= budget_bytes.

Solved exactly: for every candidate transient (each distinct block size, or none), a dynamic program over
the chain keeps the Pareto front of (bytes saved, seconds spent); dominated states are dropped, so the
front stays small when blocks repeat. Pure function; bytes and seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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
