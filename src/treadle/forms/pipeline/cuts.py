"""The stages of a cost graph (NOTE [pipeline in the plan] in `plan.py`): the schedules the planner proposes, a
pipeline plan's stages as data (`PipelineChoice`), the real blocks in order with the units before and after them,
the contiguous cuts proposed, and the micro-batches in flight at each moment of the schedule class's own order."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ...errors import PlanError
from .conflicts import SPLIT_BACKWARD, stage_rank
from .facts import SINGLE_STAGE, action_order, overlap_pairs
from .moments import Moment, _moments, _undominated
from .timeline import simulate

# what the planner proposes: schedule -> stages per rank (NOTE [the fill of a planned schedule]). DualPipeV is
# weighed as torch runs it: its overlapped (forward, backward) pairs of two micro-batches run one part after the
# other unless a custom overlap is registered with the schedule (build registers none), and a pair's forward is sent
# when the pair ends (NOTE [an overlapped pair's sends] in `timeline.py`), as the price's timeline runs them. Its
# fill is then about twice ZBV's (8 ranks, 16 micro-batches: 4.7 against 2.3 stage-seconds with equal forward,
# input- and weight-gradient parts); most of its backwards run whole (no split's host cost, nothing held from I to
# W: `split_shares`). Llama-3-8B over 2 x 8 H100, 16 micro-batches: priced 0.849 s against ZBV's 0.844. GPipe and
# looped BFS keep every micro-batch in flight for no shorter fill. Each builds and prices when a schedule states it.
SCHEDULES = {"1f1b": 1, "interleaved_1f1b": 2, "interleaved_zb": 2, "zbv": 2, "dualpipev": 2}


@dataclass(frozen=True, slots=True)
class PipelineChoice:
    """A pipeline plan's stages (`Solution.stages`): the pp `axis`, the `schedule` and `n_microbatches`, the real
    block paths of each stage (`blocks`, in order) and of those checkpointed (`checkpointed`); the solver's figures:
    each stage's seconds per micro-batch (`stage_s`), each pp rank's peak bytes (`rank_peak_bytes`) and the fill's
    seconds (`bubble_s`); the schedules the solve weighed (`weighed`: NOTE [each schedule priced on its own]); per
    stage the blocks under a selective checkpoint policy, as (path, policy) (`policies`, empty when none is: NOTE
    [checkpoint policies in a pipeline's stages] in `stage_policies.py`)."""

    axis: str
    schedule: str
    n_microbatches: int
    blocks: tuple[tuple[str, ...], ...]
    checkpointed: tuple[tuple[str, ...], ...]
    stage_s: tuple[float, ...] = ()
    rank_peak_bytes: tuple[float, ...] = ()
    bubble_s: float = 0.0
    weighed: tuple[str, ...] = ()
    policies: tuple[tuple[tuple[str, str], ...], ...] = ()

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
    m: int
    schedule: str = "1f1b"
    shares: tuple[float, float, float] = (1 / 3, 1 / 3, 1 / 3)  # a step's forward, input- and weight-gradient parts

    @property
    def v(self) -> int:
        """Stages per rank."""
        return SCHEDULES[self.schedule]

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def rank(self, stage: int) -> int:
        """The pp rank that holds `stage` (a loop, or a V for zbv / dualpipev: `conflicts.stage_rank`)."""
        return stage_rank(self.schedule, stage, self.p)

    def ranks(self) -> list[list[int]]:
        """Per pp rank its stages, in order."""
        return [[st for st in range(self.n_stages) if self.rank(st) == r] for r in range(self.p)]

    @property
    def alpha(self) -> float:
        """The fill's seconds per second of the stages' summed time (NOTE [the fill of a planned schedule])."""
        return fill_stages(self.schedule, self.p, self.m, self.shares) / self.n_stages

    @property
    def split(self) -> bool:
        """Whether the schedule splits each backward into input and weight gradients (I, W)."""
        return self.schedule in SPLIT_BACKWARD


# NOTE [the fill of a planned schedule]: a rank busy M R seconds a step (R: its stages' seconds per micro-batch)
# finishes after M R plus the schedule's fill: the warm-up and cool-down its order leaves idle. The fill is
# measured, not assumed: the schedule class's own order (`action_order`) is timed by the price's timeline
# (`timeline.simulate`) over S equal stages whose per-micro-batch second splits into forward f, input-gradient i
# and weight-gradient w as the model's own work does (`_shares`: each unit at its cheapest strategy; a backward
# matmul's weight gradient `MATMUL_WEIGHT_GRAD_SHARE` of it; the first stage's I empty, its W the whole backward,
# as the price times it); the fill is that makespan minus M v, in stage-seconds. The step's fill term is that
# many mean stage times, ``fill / S * sum_s T_s``: linear in the MILP's variables. GPipe and 1F1B give p - 1,
# interleaved 1F1B p - 1 as well once M >= p (more below: torch's order then idles longer); the zero-bubble
# schedules fill their bubbles with W: (p - 1)/3 with equal parts, a third of 1F1B's (measured at other splits:
# interleaved_zb (p - 1)(f + i - w), zbv (p - 1) i once M >= 2p, more below). Exact for equal stages; an unbalanced cut is charged its slowest rank M times (R) and
# the mean stage the fill, as before. The price times the built plan's real stages (NOTE [final choice by price]).
@functools.lru_cache(maxsize=1024)
def _fill(schedule: str, p: int, m: int, shares: tuple[float, float, float]) -> float:
    v = SCHEDULES.get(schedule, 1 if schedule in SINGLE_STAGE else 2)
    S = p * v
    f, i, w = shares
    dur: dict[tuple[int, str], float] = {}
    for s_ in range(S):
        dur.update({(s_, "F"): f, (s_, "B"): i + w, (s_, "I"): i, (s_, "W"): w})
    dur.update({(0, "I"): 0.0, (0, "W"): i + w})
    tl = simulate(action_order(schedule, S, p, m), dur, stage_rank={s_: stage_rank(schedule, s_, p) for s_ in range(S)},
                  sent_after=overlap_pairs(schedule, S, p, m))  # NOTE [an overlapped pair's sends]
    return max(0.0, tl.makespan_s / (f + i + w) - m * v)


def fill_stages(schedule: str, p: int, m: int, shares: tuple[float, float, float]) -> float:
    """The fill of `schedule` over p ranks and m micro-batches in stage-seconds (NOTE [the fill of a planned
    schedule]), for a stage second split as `shares` (forward, input gradient, weight gradient; each rounded to 5%
    of it, so that the cost graphs of one model share a timing: the fill moves by under 0.05 (p - 1) with them)."""
    tot = sum(shares) or 1.0
    f, i, w = (round(20 * x / tot) / 20 for x in shares)
    if schedule not in SPLIT_BACKWARD:  # a full backward runs I and W as one B: only their sum times it
        i, w = i + w, 0.0
    return _fill(schedule, p, m, (f, i, w))


def _shares(cg) -> tuple[float, float, float]:
    """The model's step split into forward, input-gradient and weight-gradient seconds, each unit at its cheapest
    strategy (`_step_time`) and counted once per block it stands for."""
    runs = {u: info.count for info in cg.templates.values() for u in info.units}
    f = i = w = 0.0
    for u, unit in enumerate(cg.units):
        c = min((c for c, ok in zip(unit.costs, unit.allowed) if ok), key=_step_time)
        n = runs.get(u, 1)
        f += n * c.fwd_s
        w += n * c.w_s
        i += n * max(0.0, _step_time(c) - c.fwd_s - c.w_s)
    return (f, i, w) if f + i + w > 0 else (1.0, 1.0, 1.0)


def _layout(cg, schedule: str) -> _Layout:
    g = cg.graph
    blocks = sorted(((mb, t) for t, info in cg.templates.items() for mb in info.members),
                    key=lambda x: int(x[0].rpartition(".")[2]))
    first = g.first_block_op()  # the units before it run on the first stage, the others on the last
    in_template = {u for info in cg.templates.values() for u in info.units}
    head = [u for u, unit in enumerate(cg.units) if u not in in_template and unit.leader < first]
    tail = [u for u, unit in enumerate(cg.units) if u not in in_template and unit.leader >= first]
    roles = cg.roles
    p = cg.cluster.mesh.size(roles.pp)
    return _Layout(blocks, head, tail, p, roles.pp_microbatches, schedule, _shares(cg))


@functools.lru_cache(maxsize=256)
def split_shares(schedule: str, n_stages: int, p: int, m: int) -> tuple[float, ...]:
    """Per stage, the share of its micro-batches whose backward the schedule class's order runs split, an input- then
    a weight-gradient action (I, W) rather than one B: 1 for interleaved_zb and zbv, part of them for dualpipev,
    whose overlapped pairs run whole backwards; 0 for the others. A function of its integers and torch's order:
    remembered per process (every cut's step reads it)."""
    if schedule not in SPLIT_BACKWARD:
        return (0.0,) * n_stages
    counts = [0] * n_stages
    for acts in action_order(schedule, n_stages, p, m).values():
        for a in acts:
            if a.kind == "I":
                counts[a.stage] += 1
    return tuple(c / m for c in counts)


def split_host_s(cg, lay: _Layout, cut: _Cut) -> list[float]:
    """Per stage, a split backward's own host seconds a micro-batch (`HardwareSpec.split_backward_op_s` per backward
    op its units dispatch, as counted at capture, times the share of its micro-batches whose backward is split:
    `split_shares`; the first stage runs its backward whole): zeros for a schedule that does not split (NOTE
    [framework overheads], as the price charges it, on each I action)."""
    S = lay.n_stages
    if not lay.split:
        return [0.0] * S
    share = split_shares(lay.schedule, S, lay.p, lay.m)
    per_op = cg.cluster.rank_hardware().split_backward_op_s
    bwd_ops = cg.graph.bwd_ops
    ops = [sum(bwd_ops.get(i, 0) for i in unit.nodes) if bwd_ops is not None else len(unit.nodes)
           for unit in cg.units]
    out = [0.0] * S
    for u, stages in cut.mult.items():
        for st, k_n in stages:
            if st > 0:
                out[st] += share[st] * k_n * ops[u] * per_op
    return out


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


def pinned_ends(cg, lay: _Layout) -> set[int]:
    """The block positions after which a stage must end (`Roles.pp_cuts`, the boundaries a partial schedule pins)."""
    return {i for i, (path, _) in enumerate(lay.blocks) if path in cg.roles.pp_cuts}


def neighbours(stages: tuple, n: int, pinned: set[int]) -> list[tuple[tuple[int, ...], ...]]:
    """The cuts of blocks 0..n-1 that move one boundary of `stages` (contiguous, in block order) by one block, every
    stage kept non-empty and every pinned boundary kept (a stage ends after each block position in `pinned`)."""
    edges = [st[0] for st in stages[1:]]
    out = []
    for i, e in enumerate(edges):
        if e - 1 in pinned:
            continue
        for d in (-1, 1):
            bounds = [0, *edges[:i], e + d, *edges[i + 1:], n]
            if all(a < b for a, b in zip(bounds, bounds[1:])):
                out.append(tuple(tuple(range(a, b)) for a, b in zip(bounds, bounds[1:])))
    return out


def partitions(cg, lay: _Layout, budget_bytes: float | None = None) -> list[tuple[tuple[int, ...], ...]]:
    """Cuts of the real blocks into S contiguous stages (each a tuple of block positions) that keep every pinned
    boundary (`Roles.pp_cuts`: a stage ends after each), each exact by dynamic programming over the blocks:
    the one that minimises the largest stage's time (head on stage 0, tail on the last; each unit at its cheapest
    strategy); under `budget_bytes`, the fastest whose every stage's memory lower bound (each unit's smallest
    static bytes, and its smallest saved bytes times the micro-batches the stage keeps in flight,
    `_stage_in_flight`: the first stages of 1F1B keep the most) fits, and the one that minimises the largest
    stage's memory, and the one that minimises the largest stage's time with the checkpoints its memory needs (each
    checkpointed block keeping its input in place of its saved bytes, recomputing its forward; for budgets that
    need checkpoints); and the even one. Raises PlanError for a pinned boundary
    that is not one of the blocks, or pins no cut into S stages keeps."""
    per, head, tail = _weights(cg, lay)
    n, S = len(lay.blocks), lay.n_stages
    where = {path: i for i, (path, _) in enumerate(lay.blocks)}
    bad = [c for c in cg.roles.pp_cuts if c not in where or where[c] == n - 1]
    if bad:
        raise PlanError(f"pipeline: pinned stage boundary {bad[0]!r} is not a block of the container that can end a "
                        f"stage (blocks {lay.blocks[0][0]} .. {lay.blocks[-1][0]}, the last excepted)")
    pinned = pinned_ends(cg, lay)
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
        # the time of a stage with the checkpoints its memory needs: a checkpointed block keeps its input instead
        # of its saved bytes in each micro-batch in flight and recomputes its forward (block averages over the span)
        rec = {t: _cheapest(cg, info.units, lambda c: c.rec_s) + cg.ckpt_host_s.get(t, 0.0)
               for t, info in cg.templates.items()}
        spared = {t: max(0.0, act[t] - min(info.input_bytes, default=act[t])) for t, info in cg.templates.items()}
        rc_w, sp_w = _prefix([rec[t] for _, t in lay.blocks]), _prefix([spared[t] for _, t in lay.blocks])
        span_rc, span_sp = rc_w[None, :] - rc_w[:, None], sp_w[None, :] - sp_w[:, None]
        span_n = np.maximum(np.arange(n + 1)[None, :] - np.arange(n + 1)[:, None], 1)

        def forced(s_: int) -> np.ndarray:
            over = np.maximum(memory(s_) - share, 0.0)
            with np.errstate(divide="ignore", invalid="ignore"):
                c = np.where(over > 0, np.ceil(over / (k[s_] * span_sp / span_n)), 0.0)
            return np.where(c <= span_n, seconds(s_) + np.nan_to_num(c) * span_rc / span_n, math.inf)

        out += [c for c in (fits, _minmax(n, S, pinned, forced, must=False), _minmax(n, S, pinned, memory))
                if c is not None]
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
    of its action order that no other moment dominates (NOTE [pipeline in the plan]): the part of its memory's
    moments (`moments.rank_moments`) that counts micro-batches, one walk of the order for both."""
    return {r: [dict(kv) for kv in acts] for r, acts in _inflight(lay.schedule, lay.n_stages, lay.p, lay.m).items()}


@functools.lru_cache(maxsize=256)
def _inflight(schedule: str, n_stages: int, p: int, m: int) -> dict[int, tuple[tuple[tuple[int, int], ...], ...]]:
    """`inflight` of a schedule's shape (a function of its integers and torch's order: remembered per process)."""
    out = {}
    for r, mine in _moments(schedule, n_stages, p, m, False).items():
        acts = _undominated(list(dict.fromkeys(Moment(mo.act, frozenset(), frozenset()) for mo in mine)))
        out[r] = tuple(mo.act for mo in acts)
    return out


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


