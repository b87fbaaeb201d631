"""The stages of a cost graph (NOTE [pipeline in the plan] in `plan.py`): the schedules the planner proposes, a
pipeline plan's stages as data (`PipelineChoice`), the real blocks in order with the units before and after them,
the contiguous cuts proposed, and the micro-batches in flight at each moment of the schedule class's own order."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

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


def _cheapest(cg, units, attr) -> float:
    """The sum over `units` of each one's smallest `attr` over its allowed strategies (a lower bound)."""
    return sum(min(attr(c) for c, ok in zip(cg.units[u].costs, cg.units[u].allowed) if ok) for u in units)


def _weights(cg, lay: _Layout) -> tuple[dict[int, float], float, float]:
    """Per template a block's seconds under each unit's cheapest strategy, and the head's and tail's (the cut's
    time weights)."""
    return ({t: _cheapest(cg, info.units, _step_time) for t, info in cg.templates.items()},
            _cheapest(cg, lay.head, _step_time), _cheapest(cg, lay.tail, _step_time))


def _stage_in_flight(lay: _Layout) -> list[int]:
    """Per stage the most micro-batches it holds in flight at once (`inflight`; 1F1B: min(M, p - s))."""
    k = [1] * lay.n_stages
    for moments in inflight(lay).values():
        for kv in moments:
            for s_, n in kv.items():
                k[s_] = max(k[s_], n)
    return k


def partitions(cg, lay: _Layout, budget_bytes: float | None = None) -> list[tuple[tuple[int, ...], ...]]:
    """Cuts of the real blocks into S contiguous stages (each a tuple of block positions) that keep every pinned
    boundary (`Roles.pp_cuts`: a stage ends after each), each exact by dynamic programming over the blocks:
    the one that minimises the largest stage's time (head on stage 0, tail on the last; each unit at its cheapest
    strategy); under `budget_bytes`, the fastest whose every stage's memory lower bound (each unit's smallest
    static bytes, and its smallest saved bytes times the micro-batches the stage keeps in flight,
    `_stage_in_flight`: the first stages of 1F1B keep the most) fits, and the one that minimises the largest
    stage's memory (for budgets that need checkpoints); and the even one. Raises PlanError for a pinned boundary
    that is not one of the blocks, or pins no cut into S stages keeps."""
    per, head, tail = _weights(cg, lay)
    n, S = len(lay.blocks), lay.n_stages
    where = {path: i for i, (path, _) in enumerate(lay.blocks)}
    bad = [c for c in cg.roles.pp_cuts if c not in where or where[c] == n - 1]
    if bad:
        raise PlanError(f"pipeline: pinned stage boundary {bad[0]!r} is not a block of the container that can end a "
                        f"stage (blocks {lay.blocks[0][0]} .. {lay.blocks[-1][0]}, the last excepted)")
    pinned = {where[c] for c in cg.roles.pp_cuts}  # a stage ends after each of these blocks
    # each stage's cost of blocks i..j-1 as an (n+1) x (n+1) matrix [i, j] (prefix sums: j > i is what is read)
    time_w = _prefix([per[t] for _, t in lay.blocks])
    span_s = time_w[None, :] - time_w[:, None]

    def seconds(s_: int) -> np.ndarray:
        return span_s + ((head if s_ == 0 else 0.0) + (tail if s_ == S - 1 else 0.0))

    out = [_minmax(n, S, pinned, seconds)]
    if budget_bytes is not None:
        k = _stage_in_flight(lay)
        static = {t: _cheapest(cg, info.units, lambda c: c.static_bytes) for t, info in cg.templates.items()}
        act = {t: _cheapest(cg, info.units, lambda c: c.act_bytes) for t, info in cg.templates.items()}
        ends = {0: lay.head, S - 1: lay.tail}
        end_static = {s_: _cheapest(cg, us, lambda c: c.static_bytes) for s_, us in ends.items()}
        end_act = {s_: _cheapest(cg, us, lambda c: c.act_bytes) for s_, us in ends.items()}
        st_w = _prefix([static[t] for _, t in lay.blocks])
        ac_w = _prefix([act[t] for _, t in lay.blocks])
        span_st, span_ac = st_w[None, :] - st_w[:, None], ac_w[None, :] - ac_w[:, None]

        def memory(s_: int) -> np.ndarray:
            return (span_st + (end_static.get(s_, 0.0) + cg.fixed_static_bytes)
                    + k[s_] * (span_ac + end_act.get(s_, 0.0)))

        share = budget_bytes / lay.v  # a rank's stages share its memory
        fits = _minmax(n, S, pinned, lambda s_: np.where(memory(s_) <= share, seconds(s_), math.inf), must=False)
        out += [c for c in (fits, _minmax(n, S, pinned, memory)) if c is not None]
    base, extra = divmod(n, S)
    sizes = [base + (1 if s_ < extra else 0) for s_ in range(S)]
    even = tuple(tuple(range(sum(sizes[:s_]), sum(sizes[:s_ + 1]))) for s_ in range(S))
    if all(any(st and st[-1] == k_ for st in even) for k_ in pinned):
        out.append(even)
    return list(dict.fromkeys(out))


def _prefix(w: list[float]) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(w, dtype=np.float64))])


def _minmax(n: int, S: int, pinned: set[int], cost, *, must: bool = True) -> tuple[tuple[int, ...], ...] | None:
    """The cut of n blocks into S contiguous stages minimising the largest cost of a stage, keeping the `pinned`
    boundaries (a stage never runs across one); None when every cut costs inf (`must`: raise PlanError instead).
    `cost(s)` is stage s's cost of blocks i..j-1 as an (n+1) x (n+1) matrix indexed [i, j] (entries j <= i unread).
    Dynamic programming, a stage at a time over every (i, j) at once: best[s][j] = min over i of
    max(best[s-1][i], cost(s-1)[i, j]), the first smallest i kept."""
    inf = math.inf
    idx = np.arange(n + 1)
    # blocks i..j-1 run across a pinned boundary k when i <= k < j - 1: count the pinned below each position
    below = np.concatenate([[0], np.cumsum([1 if x in pinned else 0 for x in range(n)])])
    crosses = (below[np.maximum(idx[None, :] - 1, 0)] - below[idx[:, None]]) > 0
    invalid = (idx[:, None] >= idx[None, :]) | crosses
    best = np.full(n + 1, inf)
    best[0] = 0.0
    args = []
    for s_ in range(1, S + 1):
        c = np.where(invalid, inf, np.asarray(cost(s_ - 1), dtype=np.float64))
        cand = np.maximum(best[:, None], c)  # [i, j]
        # stage s_ ends at j in s_ .. n - (S - s_) and starts at i >= s_ - 1 (each stage keeps one block at least)
        cand[: s_ - 1, :] = inf
        arg = np.argmin(cand, axis=0)
        nxt = cand[arg, idx]
        nxt[:s_] = inf
        nxt[n - (S - s_) + 1:] = inf
        best = nxt
        args.append(arg)
    if math.isinf(best[n]):
        if must:
            raise PlanError(f"pipeline: no cut of {n} blocks into {S} stages keeps the pinned boundaries "
                            f"{sorted(pinned)}")
        return None
    cuts, j = [], n
    for s_ in range(S, 0, -1):
        i = int(args[s_ - 1][j])
        cuts.append(tuple(range(i, j)))
        j = i
    return tuple(reversed(cuts))


def inflight(lay: _Layout) -> dict[int, list[dict[int, int]]]:
    """Rank -> the micro-batches in flight on each of its stages (forward done, backward not yet) at every moment
    of its action order that no other moment dominates (NOTE [pipeline in the plan])."""
    got = _inflight(_schedule_of(lay), lay.n_stages, lay.p, lay.m)
    return {r: [dict(kv) for kv in moments] for r, moments in got.items()}


@functools.lru_cache(maxsize=256)
def _inflight(schedule: str, n_stages: int, p: int, m: int) -> dict[int, tuple[tuple[tuple[int, int], ...], ...]]:
    """`inflight` of a schedule's shape (a function of its integers and torch's order: remembered per process)."""
    order = action_order(schedule, n_stages, p, m)
    out: dict = {}
    for r, acts in order.items():
        cur: dict[int, int] = {}
        seen: list[dict[int, int]] = []
        for a in acts:
            if a.kind == "F":
                cur[a.stage] = cur.get(a.stage, 0) + 1
                seen.append(dict(cur))
            elif a.kind in ("B", "W"):
                cur[a.stage] = cur.get(a.stage, 0) - 1
        unique: dict[tuple, dict[int, int]] = {}  # each distinct moment once, in order of its first occurrence
        for x in seen:
            unique.setdefault(tuple(sorted(x.items())), x)
        keep = [x for x in unique.values()
                if not any(y != x and all(y.get(s, 0) >= k for s, k in x.items()) for y in unique.values())]
        out[r] = tuple(tuple(kv.items()) for kv in keep)
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


