"""Lower bounds of a pipeline role assignment that let the search skip work without changing its answer: the
memory floor of every plan of it (NOTE [a memory floor of the stages]), and the time and memory floors of one
cut's MILP (NOTE [a lower bound before the MILP]). tests/test_plan_floors.py holds each under the solver's
figures."""

from __future__ import annotations

from ...planner.floors import block_min
from .cuts import SCHEDULES, _Cut, _Layout, _step_time, _tail_time, split_host_s
from .moments import moment_bytes, rank_moments, tracks_gathered, unit_bytes
from .zero import _zero_constants, zero_terms

# NOTE [a lower bound before the MILP]: with a cutoff (NOTE [a cutoff from the best plan found]) most cuts of most
# role assignments cannot beat the best plan found (405B on 512 GPUs: 1376 cut MILPs, 15 feasible under their
# cutoffs), and building and solving each costs tens of milliseconds. Every term of the MILP's objective is bounded
# below by each unit's cheapest allowed strategy, without recomputation, gradient sums or sends (each >= 0): a
# stage's T_s >= sum_u n_s(u) min_k step[u,k] (under ZeRO-3 with overlap, also >= its gathers' min plus their
# latency), a rank's R >= the sum of its stages' and Q >= its tail's mins. `_objective_floor` is that bound of a
# cut; `_role_floor` the bound of every cut of a schedule at once (the largest rank is at least the mean, and the
# stages' sum does not depend on the cut). Under a budget the recomputation it forces is added (NOTE [the
# recomputation a budget forces]), and each block's units are bounded jointly (NOTE [a block's floors under the layout
# match]): 405B on 512 H100 at 80 GiB, 899 cut MILPs solved with the per-unit floors, 89 with both (the same 13
# feasible, the same plan; planning 80.6 -> 53 s). A cut, or a whole role assignment, whose bound is above the cutoff is
# not built: the MILP would find nothing under its cutoff row (which, as this bound, leaves out the constant tied
# parameters' all-reduce). It changes which plans are found by nothing (tests/test_plan_floors.py holds the bounds
# under each solved cut's objective).
_FLOOR_TOL = 1e-6  # a bound this close above the cutoff still solves (the MILP's own tolerance)


def _allowed(unit) -> list[int] | range:
    """A unit's allowed strategies (all of them where none is marked allowed)."""
    return [k for k, a in enumerate(unit.allowed) if a] or range(len(unit.costs))


def _unit_mins(cg, zt) -> tuple[list[float], list[float], list[float]]:
    """Per unit the smallest over its allowed strategies of a micro-batch's seconds (`_step_time`), of its ZeRO-3
    gathers (0 without) and of its once-a-step tail."""
    t, g, q = [], [], []
    for u, unit in enumerate(cg.units):
        ok = _allowed(unit)
        t.append(min((_step_time(unit.costs[k]) if zt is None else zt.step_s(unit.costs[k])) for k in ok))
        g.append(min(zt.gather_s(u, k) for k in ok) if zt is not None else 0.0)
        q.append(min((_tail_time(unit.costs[k]) if zt is None else zt.tail_s(u, k, unit.costs[k])) for k in ok))
    return t, g, q


def _objective_floor(cg, lay: _Layout, cut: _Cut, zt, mins, recompute: list[float] | None = None) -> float:
    """A lower bound of `_solve_cut`'s objective (seconds; NOTE [a lower bound before the MILP]); `recompute`: per
    rank the least recomputation a micro-batch its memory forces (`_recompute_floor`), added to its compute."""
    S, M = lay.n_stages, lay.m
    tmin, gmin, qmin = mins
    T, G, tail = [0.0] * S, [0.0] * S, [0.0] * S
    for u in range(len(cg.units)):
        for st, k_n in cut.mult.get(u, []):
            T[st] += k_n * tmin[u]
            G[st] += k_n * gmin[u]
            tail[st] += k_n * qmin[u]
    Gc, Tc, Qc = stage_constants(cg, zt, lay, cut)
    comp = list(T)  # the compute a recomputation adds to (overlapped gathers hide behind it, not it behind them)
    if zt is not None:
        if zt.overlap:
            T = [max(T[st], G[st] + Gc[st]) for st in range(S)]
        else:
            T = [T[st] + G[st] for st in range(S)]
            Tc = [Tc[st] + Gc[st] for st in range(S)]
            comp = list(T)
    ranks = lay.ranks()
    x = recompute or [0.0] * lay.p
    R = max(max(sum(T[st] + Tc[st] for st in mine), sum(comp[st] + Tc[st] for st in mine) + x[r])
            for r, mine in enumerate(ranks))
    Q = max(sum(tail[st] for st in mine) + Qc[r] for r, mine in enumerate(ranks))
    return M * R + Q + lay.alpha * max(sum(T) + sum(Tc), sum(comp) + sum(Tc) + sum(x))


def template_mins(cg, mem) -> dict[int, tuple[float, float, float]]:
    """Per template the smallest saved bytes of one block (its units' smallest, `mem`: `_memory_mins`), the smallest
    input it keeps when checkpointed, and the least seconds its recomputation adds a micro-batch (with the host
    cost of checkpointing it): what `_recompute_floor` trades."""
    act_min = mem[1]
    out = {}
    for t, info in cg.templates.items():
        saved = sum(act_min[u] for u in info.units)
        kept = min(info.input_bytes) if info.input_unit is not None and info.input_bytes else 0.0
        rec = sum(min(cg.units[u].costs[k].rec_s for k in _allowed(cg.units[u])) for u in info.units)
        out[t] = (saved, kept, rec + cg.ckpt_host_s.get(t, 0.0))
    return out


# NOTE [the recomputation a budget forces]: under a budget the MILP's memory row of each moment of each rank's order
# (NOTE [pipeline in the plan]) reads, for c checkpointed blocks of template t on stage s with k_s micro-batches in
# flight, k_s (n_ts - c) A_t + k_s c I_t (saved bytes A_t, kept input I_t of the chosen strategies), and adds
# c (F_t + host_t) to T_s. With every unit at its smallest bytes the row is at least L0 - sum c k_s d_t, where L0
# is the row with no checkpoint and d_t = A_t,min - I_t,min: a plan fits only if its checkpoints remove at least
# L0 - budget there, and each removes at most k_s d_t for at least F_t,min + host_t seconds. The least seconds that
# removes it is a fractional knapsack (cheapest seconds per byte first, at most n_ts blocks each): a lower bound of
# the recomputation on that rank, taken over its moments (each row must hold); none can remove it, no plan fits.
# The time floor adds it to the rank's compute (NOTE [a lower bound before the MILP]). On 405B over 512 H100 at
# 80 GiB, where most cuts' memory forces checkpoints, the plain floor was 0.52-0.90 of the cutoff of the cuts
# the MILP then found nothing under, their best plans 1.0-6.6x it.
def _recompute_floor(cg, lay: _Layout, cut: _Cut, mem, tmins, budget: float, checkpoint: bool) -> list[float] | None:
    """Per rank the least recompute seconds a micro-batch that `budget` forces on a cut (NOTE [the recomputation a
    budget forces]); None when no checkpoints fit it. `mem`: `_memory_mins`; `tmins`: `template_mins`."""
    S, p = lay.n_stages, lay.p
    static, A0, GR, GA = _stage_bytes(cg, cut, S, mem, {t: m[0] for t, m in tmins.items()})
    moments = rank_moments(lay, tracks_gathered(cg))
    out = [0.0] * p
    for r in range(p):
        base = sum(static[st] for st in range(S) if lay.rank(st) == r) + cg.fixed_static_bytes
        for mo in moments[r]:
            excess = base + sum(moment_bytes(mo, A0, GR, GA)) - budget * (1 + 1e-9)
            if excess <= 0:
                continue
            items = sorted((tmins[t][2] / (k_ * (tmins[t][0] - tmins[t][1])), k_ * (tmins[t][0] - tmins[t][1]), n_t)
                           for st, k_ in mo.act if k_ > 0 and checkpoint
                           for t, n_t in cut.n[st].items() if tmins[t][0] > tmins[t][1])
            cost = 0.0
            for per_byte, gain, n_t in items:
                if n_t * gain >= excess:  # the rest, a fraction of these blocks
                    cost += excess * per_byte
                    excess = 0.0
                    break
                cost += n_t * gain * per_byte
                excess -= n_t * gain
            if excess > 0:
                return None
            out[r] = max(out[r], cost)
    return out


# NOTE [a block's floors under the layout match]: the floors above take each unit at its own cheapest (smallest)
# strategy, but every cut's MILP also holds the layout match between units (`add_layout_match`): a block's units
# cannot all take their own best strategies at once. With two tensor axes this is most of the gap: on 405B over
# 512 H100 (tensor over fsdp x tp) a block's units sum to 0.37 GiB of static bytes at their smallest, and at least
# 2.26 GiB under the layout match. `coupled_mins` raises, for each block template, the sum of its units' seconds and
# static bytes to its minimum over the base model that every cut's MILP extends (one strategy per unit, every
# form's rows, the layout match), solved as a linear programme: a lower bound of that sum in every cut's MILP
# (on these models it equals the integer minimum). Added to one unit of the template, every floor that sums a
# stage's units reads it. About 10 ms a template, so it is solved once per role assignment, and only once the
# plain floors leave a cut to solve.
def coupled_mins(cg, base, coefs, mins, mem):
    """`mins` (`_unit_mins`) and `mem` (`_memory_mins`, or None) with each template's units' sum of seconds and of
    static bytes raised to its minimum under the layout match (NOTE [a block's floors under the layout match]);
    `base`: `milp.base_model(cg)`, `coefs`: `milp.unit_coefs(cg, zt)`."""
    from ...planner.ilp import _BYTES, _SECONDS, _Model

    model, s, _ = base

    def least(units: list[int], field: int, scale: float) -> float:
        lp = _Model()
        lp.__dict__.update(vars(model))
        lp.c = [0.0] * len(model.c)
        lp.integ = [0] * len(model.c)
        for u in units:
            for term in coefs[u]:
                lp.c[s[u, term[0]]] += term[field] * scale
        res = lp.solve(30.0, 1e-9)
        return float(res.fun) / scale * (1 - 1e-6) if res.x is not None else 0.0

    t, g, q = (list(x) for x in mins)
    st = list(mem[0]) if mem is not None else None
    for info in cg.templates.values():
        units, lead = list(info.units), info.units[0]
        t[lead] += max(0.0, least(units, 1, _SECONDS) - sum(t[u] for u in units))
        if st is not None:
            st[lead] += max(0.0, least(units, 2, _BYTES) - sum(st[u] for u in units))
    return (t, g, q), ((st, *mem[1:]) if mem is not None else None)


def stage_constants(cg, zt, lay: _Layout, cut: _Cut) -> tuple[list[float], list[float], list[float]]:
    """What a cut's stages pay whatever the choice: per stage its ZeRO-3 gathers' latency a micro-batch and its
    seconds a micro-batch besides its units' (FSDP2's hooks, a split backward's host cost: `split_host_s`), per
    rank its once-a-step seconds (`_zero_constants`)."""
    Gc, Tc, Qc = _zero_constants(zt, cut, lay.ranks())
    return Gc, [a + b for a, b in zip(Tc, split_host_s(cg, lay, cut))], Qc


def _memory_mins(cg, zt) -> tuple[list[float], list[float], dict[int, float], list[float], list[float]]:
    """Per unit its smallest bytes a stage always holds and its smallest saved bytes over its allowed strategies; per
    template the fewest bytes a block keeps (its saved bytes, or its kept input where checkpointing keeps less); per
    unit its smallest gradients' and gathered parameters' bytes (`moments.unit_bytes`: each term at its own
    smallest, a lower bound of their sum at any moment)."""
    st, act, gr, ga = [], [], [], []
    for u, unit in enumerate(cg.units):
        ok = _allowed(unit)
        split = [unit_bytes(unit.costs[k], zt, u, k) for k in ok]
        st.append(min(x[0] for x in split))
        gr.append(min(x[1] for x in split))
        ga.append(min(x[2] for x in split))
        act.append(min(unit.costs[k].act_bytes for k in ok))
    return st, act, {t: block_min(info, act) for t, info in cg.templates.items()}, gr, ga


def _stage_bytes(cg, cut: _Cut, S: int, mem, block: dict[int, float]) -> tuple[list[float], ...]:
    """Per stage of a cut its always-held bytes, the bytes a micro-batch in flight keeps, its gradients' and its
    gathered parameters' bytes, every unit at its smallest (`mem`: `_memory_mins`), each block of template t
    keeping `block[t]`."""
    st_min, act_min, _, gr_min, ga_min = mem
    in_template = {u for info in cg.templates.values() for u in info.units}
    static, A, GR, GA = [0.0] * S, [0.0] * S, [0.0] * S, [0.0] * S
    for u in range(len(cg.units)):
        for st, k_n in cut.mult.get(u, []):
            static[st] += k_n * st_min[u]
            GR[st] += k_n * gr_min[u]
            GA[st] += k_n * ga_min[u]
            if u not in in_template:
                A[st] += act_min[u]
    for st in range(S):
        A[st] += sum(n_t * block[t] for t, n_t in cut.n[st].items())
    return static, A, GR, GA


def _memory_floor_of_cut(cg, lay: _Layout, cut: _Cut, mem) -> float:
    """A lower bound of the busiest rank's peak of a cut: the MILP's memory rows (NOTE [a rank's memory at each
    moment]) at every undominated moment, each term at its smallest (`_memory_mins`), without the recomputed
    block."""
    S, p = lay.n_stages, lay.p
    static, A, GR, GA = _stage_bytes(cg, cut, S, mem, mem[2])
    moments = rank_moments(lay, tracks_gathered(cg))
    peak = 0.0
    for r in range(p):
        base = sum(static[st] for st in range(S) if lay.rank(st) == r)
        held = max((sum(moment_bytes(mo, A, GR, GA)) for mo in moments[r]), default=0.0)
        peak = max(peak, base + held)
    return peak + cg.fixed_static_bytes


def _role_floor(cg, lay: _Layout, mins) -> float:
    """A lower bound of `_objective_floor` over every cut of `lay` (NOTE [a lower bound before the MILP])."""
    tmin, _, qmin = mins
    # a unit's executions over all stages (`_cut`'s multiplicities summed): its template's blocks, else one
    runs = {u: info.count for info in cg.templates.values() for u in info.units}
    total = sum(runs.get(u, 1) * tmin[u] for u in range(len(cg.units)))
    tail = sum(runs.get(u, 1) * qmin[u] for u in range(len(cg.units)))
    p = lay.p
    return lay.m * total / p + tail / p + lay.alpha * total


# NOTE [a memory floor of the stages]: the pipeline's memory rows (NOTE [a rank's memory at each moment]) are per pp
# rank: its stages' always-held bytes, the fixed bytes, and at each moment the micro-batches in flight on each of
# its stages times their saved bytes, the gradients of the stages that ran a backward and (ZeRO-3 with reshard after
# forward) the stages held gathered. A rank's peak is therefore at least its static bytes with every gradient whole
# (the step's end), and at least its always-held bytes with one stage's saved bytes and that stage gathered (its
# first forward), itself at least the mean over its v stages; the busiest rank is at least the mean over ranks; and
# the last stage (the head, the loss: with a large vocabulary the largest activation of the step) and the first
# stage are each on some rank. The floor is the largest of those, with each unit's smallest bytes (each term at its
# own smallest) and each block's smaller of its saved bytes and its kept input (NOTE [a memory floor before the
# costs] in `treadle.planner.floors`); it holds for every cut and schedule.
def memory_floor(ft) -> float | None:
    """A lower bound of the busiest pp rank's peak over every plan of a pipeline role assignment (NOTE [a memory
    floor of the stages]); None without a pp axis."""
    roles = ft.roles
    if roles.pp is None:
        return None
    p = ft.cluster.mesh.size(roles.pp)
    v = SCHEDULES[roles.pp_schedule] if roles.pp_schedule else max(SCHEDULES.values())  # the most stages a rank
    runs = {u: info.count for info in ft.templates.values() for u in info.units}  # over all stages
    zt = zero_terms(ft)  # ZeRO-3 beside the pipeline (NOTE [pipeline FSDP2 in the plan]; `ft` reads as the cost
    grads, gathered = [], []  # graph it will be): each unit's smallest gradients beside its shard, and gathered
    for u, unit in enumerate(ft.units):
        ks = range(len(unit.strategies))
        grads.append(min(zt.held_grads(u, k) for k in ks) if zt is not None else 0.0)
        gathered.append(min(zt.held_gathered(u, k) for k in ks) if zt is not None else 0.0)
    first = ft.graph.first_block_op() or 0
    ends = {True: [0.0, 0.0], False: [0.0, 0.0]}  # head (before the blocks), tail: [held bytes, saved]
    for u, unit in enumerate(ft.units):
        if u not in runs:
            e = ends[unit.leader < first]
            e[0] += ft.base_min[u] + gathered[u]
            e[1] += ft.act_min[u]
    n_of = [runs.get(u, 1) for u in range(len(ft.units))]  # executions over all stages: a block's count, else one
    whole = sum(n * (ft.static_min[u] + grads[u]) for u, n in enumerate(n_of))  # the step's end
    base = sum(n * ft.base_min[u] for u, n in enumerate(n_of))
    saved = sum(info.count * ft.block_min(t) for t, info in ft.templates.items()) + ends[True][1] + ends[False][1]
    saved += sum(n * gathered[u] for u, n in enumerate(n_of))  # each stage gathered at its first forward
    mean = max(whole, base + saved / v) / p
    return ft.fixed + max(mean, *(e[0] + e[1] for e in ends.values()))
