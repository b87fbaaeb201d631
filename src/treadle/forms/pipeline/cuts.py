"""The stages of a cost graph (NOTE [pipeline in the plan] in `plan.py`): the schedules the planner proposes, a
pipeline plan's stages as data (`PipelineChoice`), the real blocks in order with the units before and after them,
the contiguous cuts proposed, and the micro-batches in flight at each moment of the schedule class's own order."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import PlanError
from .facts import action_order

SCHEDULES = {"1f1b": 1, "interleaved_1f1b": 2}  # what the planner proposes: schedule -> stages per rank


@dataclass(frozen=True, slots=True)
class PipelineChoice:
    """A pipeline plan's stages (`Solution.stages`): the pp `axis`, the `schedule` and `n_microbatches`, the real
    block paths of each stage (`blocks`, in order) and of those checkpointed (`checkpointed`); the solver's figures:
    each stage's seconds per micro-batch (`stage_s`), each pp rank's peak bytes (`rank_peak_bytes`) and the fill's
    seconds (`bubble_s`)."""

    axis: str
    schedule: str
    n_microbatches: int
    blocks: tuple[tuple[str, ...], ...]
    checkpointed: tuple[tuple[str, ...], ...]
    stage_s: tuple[float, ...] = ()
    rank_peak_bytes: tuple[float, ...] = ()
    bubble_s: float = 0.0

    @property
    def n_stages(self) -> int:
        return len(self.blocks)


@dataclass(slots=True)
class _Layout:
    """What a cut needs of a cost graph: the real blocks in order with their templates, which units run before
    the blocks (head: stage 0) and after them (tail: last stage), each template's units."""

    blocks: list[tuple[str, int]]  # (real path, template), container order
    head: list[int]
    tail: list[int]
    p: int
    v: int
    m: int

    @property
    def n_stages(self) -> int:
        return self.p * self.v


def _layout(cg, schedule: str) -> _Layout:
    g = cg.graph
    blocks = sorted(((mb, t) for t, info in cg.templates.items() for mb in info.members),
                    key=lambda x: int(x[0].rpartition(".")[2]))
    first = min(i for blk in g.blocks for i in blk.nodes)
    in_template = {u for info in cg.templates.values() for u in info.units}
    head = [u for u, unit in enumerate(cg.units) if u not in in_template and unit.leader < first]
    tail = [u for u, unit in enumerate(cg.units) if u not in in_template and unit.leader >= first]
    roles = cg.roles
    p = cg.cluster.mesh.size(roles.pp)
    return _Layout(blocks, head, tail, p, SCHEDULES[schedule], roles.pp_microbatches)


def _step_time(c) -> float:
    """One execution's (micro-batch's) forward and backward seconds of a strategy: all but the optimizer step."""
    return c.compute_s - c.opt_s + c.comm_s


def _tail_time(c) -> float:
    """What a strategy costs once a step after the pipelined part: the optimizer step and the replicas' sync."""
    return c.opt_s + c.dp_comm_s


def _weights(cg, lay: _Layout) -> tuple[dict[int, float], float, float]:
    """Per template a block's seconds under each unit's cheapest strategy, and the head's and tail's (the cut's
    weights)."""
    def cheapest(units) -> float:
        return sum(min(_step_time(c) for c, ok in zip(cg.units[u].costs, cg.units[u].allowed) if ok)
                   for u in units)
    return ({t: cheapest(info.units) for t, info in cg.templates.items()}, cheapest(lay.head), cheapest(lay.tail))


def partitions(cg, lay: _Layout) -> list[tuple[tuple[int, ...], ...]]:
    """Cuts of the real blocks into S contiguous stages (each a tuple of block positions) that keep every pinned
    boundary (`Roles.pp_cuts`: a stage ends after each): the one that minimises the largest stage's weight (head
    on stage 0, tail on the last; exact by dynamic programming over the prefix sums) and the even one. Raises
    PlanError for a pinned boundary that is not one of the blocks, or pins no cut into S stages keeps."""
    per, head, tail = _weights(cg, lay)
    w = [per[t] for _, t in lay.blocks]
    n, S = len(w), lay.n_stages
    where = {path: i for i, (path, _) in enumerate(lay.blocks)}
    bad = [c for c in cg.roles.pp_cuts if c not in where or where[c] == n - 1]
    if bad:
        raise PlanError(f"pipeline: pinned stage boundary {bad[0]!r} is not a block of the container that can end a "
                        f"stage (blocks {lay.blocks[0][0]} .. {lay.blocks[-1][0]}, the last excepted)")
    pinned = {where[c] for c in cg.roles.pp_cuts}  # a stage ends after each of these blocks
    prefix = [0.0]
    for x in w:
        prefix.append(prefix[-1] + x)

    def cost(i: int, j: int, s: int) -> float:  # blocks i..j-1 as stage s
        if any(i <= k < j - 1 for k in pinned):
            return math.inf  # the stage would run across a pinned boundary
        return prefix[j] - prefix[i] + (head if s == 0 else 0.0) + (tail if s == S - 1 else 0.0)

    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(S + 1)]
    arg = [[0] * (n + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for s in range(1, S + 1):
        for j in range(s, n - (S - s) + 1):
            for i in range(s - 1, j):
                x = max(best[s - 1][i], cost(i, j, s - 1))
                if x < best[s][j] - 1e-15:
                    best[s][j], arg[s][j] = x, i
    if math.isinf(best[S][n]):
        raise PlanError(f"pipeline: no cut of {n} blocks into {S} stages keeps the pinned boundaries "
                        f"{list(cg.roles.pp_cuts)}")
    cuts, j = [], n
    for s in range(S, 0, -1):
        i = arg[s][j]
        cuts.append(tuple(range(i, j)))
        j = i
    minmax = tuple(reversed(cuts))
    base, extra = divmod(n, S)
    sizes = [base + (1 if s < extra else 0) for s in range(S)]
    even = tuple(tuple(range(sum(sizes[:s]), sum(sizes[:s + 1]))) for s in range(S))
    keeps = all(any(st and st[-1] == k for st in even) for k in pinned)
    return list(dict.fromkeys((minmax, even) if keeps else (minmax,)))


def inflight(lay: _Layout) -> dict[int, list[dict[int, int]]]:
    """Rank -> the micro-batches in flight on each of its stages (forward done, backward not yet) at every moment
    of its action order that no other moment dominates (NOTE [pipeline in the plan])."""
    order = action_order(_schedule_of(lay), lay.n_stages, lay.p, lay.m)
    out: dict[int, list[dict[int, int]]] = {}
    for r, acts in order.items():
        cur: dict[int, int] = {}
        seen: list[dict[int, int]] = []
        for a in acts:
            if a.kind == "F":
                cur[a.stage] = cur.get(a.stage, 0) + 1
                seen.append(dict(cur))
            elif a.kind in ("B", "W"):
                cur[a.stage] = cur.get(a.stage, 0) - 1
        keep = []
        for x in seen:
            if not any(y != x and all(y.get(s, 0) >= k for s, k in x.items()) for y in seen) and x not in keep:
                keep.append(x)
        out[r] = keep
    return out


def _schedule_of(lay: _Layout) -> str:
    return next(k for k, v in SCHEDULES.items() if v == lay.v)


# ----------------------------------------------------------------------------- the MILP of one cut
@dataclass(slots=True)
class _Cut:
    """A cut of the blocks: per stage, how many blocks of each template (`n[s][t]`), and each unit's stages with
    their multiplicity (`mult[u]`: [(stage, n)])."""

    stages: tuple[tuple[int, ...], ...]
    n: list[dict[int, int]]
    mult: dict[int, list[tuple[int, int]]]


def _cut(cg, lay: _Layout, stages) -> _Cut:
    S = lay.n_stages
    n = [dict() for _ in range(S)]
    for s, positions in enumerate(stages):
        for i in positions:
            t = lay.blocks[i][1]
            n[s][t] = n[s].get(t, 0) + 1
    mult: dict[int, list[tuple[int, int]]] = {}
    for t, info in cg.templates.items():
        for u in info.units:
            mult[u] = [(s, n[s][t]) for s in range(S) if n[s].get(t)]
    for u in lay.head:
        mult[u] = [(0, 1)]
    for u in lay.tail:
        mult[u] = [(S - 1, 1)]
    return _Cut(tuple(stages), n, mult)


