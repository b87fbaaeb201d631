"""The MILP of a pipelined step (NOTE [pipeline in the plan] in `plan.py`): one per proposed cut (`cuts.py`) and per
cut beside the best of them, and the same step and peak computed directly for a choice (`evaluate`; the tests hold
the MILP to the exhaustive oracle of `oracle.py`)."""

from __future__ import annotations

import math
import time
from dataclasses import replace

from ...cost.collective_cost import collective_time_s, send_recv_time_s
from ...errors import PlanError
from ...form import forms
from ...planner.ilp import (_BYTES, _SECONDS, Solution, _block_exprs, _Model, add_layout_match, add_memory,
                            add_one_strategy, add_strategy_vars, as_var, block_bounds, checkpoint_vars)
from ...planner.grad_live import working_of, working_terms
from ...planner.policies import counts_of, offered, pick
from .cuts import (PipelineChoice, _cut, _Cut, _layout, _Layout, _step_time, _tail_time, neighbours, partitions,
                   pinned_ends)
from .floors import (_FLOOR_TOL, _memory_floor_of_cut, _memory_mins, _objective_floor, _recompute_floor,
                     _role_floor, _unit_mins, coupled_mins, stage_constants, template_mins)
from .conflicts import SPLIT_BACKWARD
from .kinds import _stage_counts_allow, _tied_bytes, _torch_takes, schedules  # noqa: F401 (schedules: the face)
from .moments import memory_rows, moment_bytes, rank_moments, tied_on_last, tracks_gathered, unit_bytes
from .stage_policies import add_stage_policies, policy_terms
from .zero import zero_terms
from ..sequence.gather import active as sp_active

# NOTE [cuts beside the proposed ones]: the proposed cuts (`cuts.partitions`: exact for the largest stage's time, for
# its memory bound, for its time with the checkpoints that bound needs) are not every cut, and the step is more than
# the largest stage's time (the fill, the sends, each stage's forced checkpoints). From the best proposal, every cut
# moving one stage boundary by one block (`cuts.neighbours`, pinned boundaries kept) is solved too, floors first,
# and the walk goes on from each one level with the best (within `_LEVEL`: a level stretch can lead to a better cut)
# or better, at most `_NEIGHBOUR_TRIES` cuts (Llama-3.1-405B's 64-stage role assignments walked 99 cuts each at 3 a
# stage: +9 s of planning; capped, none). Against every contiguous cut solved exhaustively (test_pipeline_plan.py,
# 12 cases) the proposals alone missed one by 2.3% (two boundaries one block off, via a level cut); the walk finds it.
_NEIGHBOUR_TRIES = 24
_LEVEL = 1e-6


def _grad_sum_units(cg) -> dict[tuple, tuple[int, float]]:
    """The tensor form's input-gradient sums (NOTE [shared input-gradient sum]): key -> (the first unit that needs
    it, whose stages run it; seconds per execution)."""
    from ..tensor.plan import grad_sum_keys

    first: dict[tuple, int] = {}
    for u, unit in enumerate(cg.units):
        for c in unit.costs:
            for (j, a) in c.grad_sums:
                first.setdefault((j, a, unit.count), u)
    return {key: (first[key], t) for key, t in grad_sum_keys(cg).items()}


def _send_s(cg, lay: _Layout, cut: _Cut, s: int) -> list[tuple[int, float]] | float:
    """Seconds of the send across boundary s (into stage s + 1): per strategy of the next block's input unit, as
    [(unit strategy variable key, seconds)], or a constant."""
    link = cg.cluster.link(cg.roles.pp)
    first = cut.stages[s + 1][0] if cut.stages[s + 1] else None
    if first is None or lay.rank(s) == lay.rank(s + 1):  # two stages of one rank hand over in memory
        return 0.0
    info = cg.templates[lay.blocks[first][1]]
    if info.input_unit is None:
        return 0.0
    return [((info.input_unit, k), send_recv_time_s(b, link)) for k, b in enumerate(info.input_bytes)]


def _tied_s(cg, lay: _Layout) -> float:
    """The all-reduce over pp of the gradients of parameters both the first and the last stage read (a tied
    embedding and head), at their full size (an upper bound under tensor parallelism)."""
    nbytes = _tied_bytes(cg)
    p = cg.cluster.mesh.size(cg.roles.pp)
    return collective_time_s("all_reduce", nbytes, p, cg.cluster.link(cg.roles.pp)) if nbytes else 0.0


def base_model(cg) -> tuple[_Model, dict, dict]:
    """What every cut's MILP of `cg` starts from: the strategy variables, one strategy per unit, every form's
    constraint families (the tensor form's gradient sums: their variables, in `shared`) and the layout match.
    Returns (model, strategy variables, shared); a cut adds to a copy of the model."""
    m = _Model()
    s = add_strategy_vars(m, cg)
    add_one_strategy(m, cg, s)
    shared: dict = {}
    for f in forms():
        f.ilp_rows(m, cg, s, shared)
    add_layout_match(m, cg, s)
    return m, s, shared


def unit_coefs(cg, zt) -> list[list[tuple]]:
    """Per unit, each strategy's (index, one execution's seconds, always-held bytes, once-a-step seconds, ZeRO-3
    gather seconds or None, saved bytes or None inside a block template, gradient bytes, gathered bytes, bytes a
    split backward keeps from I to W): what every cut's MILP reads of it, times the unit's executions in a stage
    (the bytes: `moments.unit_bytes`)."""
    in_template = {u for info in cg.templates.values() for u in info.units}
    out = []
    for u, unit in enumerate(cg.units):
        rows = []
        for k, c in enumerate(unit.costs):
            base, grads, gathered = unit_bytes(c, zt, u, k)
            rows.append((k, _step_time(c) if zt is None else zt.step_s(c), base,
                         _tail_time(c) if zt is None else zt.tail_s(u, k, c), zt.gather_s(u, k) if zt is not None
                         else None, None if u in in_template else c.act_bytes, grads, gathered, c.w_held_bytes))
        out.append(rows)
    return out


def _solve_cut(cg, lay: _Layout, cut: _Cut, *, budget_bytes, checkpoint: bool, time_limit_s: float,
               rel_gap: float, min_ckpt: dict, minimise: str, cutoff_s: float | None = None,
               coefs: list | None = None, base: tuple | None = None):
    """The MILP of NOTE [pipeline in the plan] for one cut; returns (Solution without stages, per-stage counts) or
    None when infeasible. `coefs`, `base`: `unit_coefs` and `base_model` of `cg`, where the caller keeps them for
    every cut."""
    t0 = time.perf_counter()
    S, p, M = lay.n_stages, lay.p, lay.m
    base = base if base is not None else base_model(cg)
    m = _Model()  # a copy of the base model, added to below
    m.__dict__.update({k: list(v) for k, v in vars(base[0]).items()})
    s, shared = base[1], base[2]
    T: list[dict[int, float]] = [dict() for _ in range(S)]
    A: list[dict[int, float]] = [dict() for _ in range(S)]  # activations per micro-batch (scaled bytes)
    static: list[dict[int, float]] = [dict() for _ in range(S)]
    tail: list[dict[int, float]] = [dict() for _ in range(S)]
    GR: list[dict[int, float]] = [dict() for _ in range(S)]  # gradients, from the stage's first backward
    GA: list[dict[int, float]] = [dict() for _ in range(S)]  # parameters FSDP2 holds gathered
    WH: list[dict[int, float]] = [dict() for _ in range(S)]  # kept from I to W a micro-batch

    def add(d: dict, j: int, x: float) -> None:
        if x:
            d[j] = d.get(j, 0.0) + x

    zt = zero_terms(cg)  # NOTE [pipeline FSDP2 in the plan]
    G: list[dict[int, float]] = [dict() for _ in range(S)]  # a micro-batch's gathers of each stage
    Gc, Tc, Qc = stage_constants(cg, zt, lay, cut)
    for u, terms in enumerate(coefs if coefs is not None else unit_coefs(cg, zt)):
        for st, k_n in cut.mult.get(u, []):
            Ts, Ss, Ls, Gs, As = T[st], static[st], tail[st], G[st], A[st]
            for k, step, held, tl, gather, act, gr, ga, wh in terms:
                j = s[u, k]
                add(GR[st], j, k_n * gr * _BYTES)
                add(GA[st], j, k_n * ga * _BYTES)
                add(WH[st], j, k_n * wh * _BYTES)
                if x := k_n * step * _SECONDS:
                    Ts[j] = Ts.get(j, 0.0) + x
                if x := k_n * held * _BYTES:
                    Ss[j] = Ss.get(j, 0.0) + x
                if x := k_n * tl * _SECONDS:
                    Ls[j] = Ls.get(j, 0.0) + x
                if gather is not None and (x := k_n * gather * _SECONDS):
                    Gs[j] = Gs.get(j, 0.0) + x
                if act is not None and (x := act * _BYTES):
                    As[j] = As.get(j, 0.0) + x
    for u, per in tied_on_last(cg, lay, cut).items():  # NOTE [a tied parameter on two ranks]
        for k, (base, gr) in enumerate(per):
            add(static[S - 1], s[u, k], base * _BYTES)
            add(GR[S - 1], s[u, k], gr * _BYTES)
    ys = shared.get("grad_sum_vars", {})
    for key, (u, sec) in _grad_sum_units(cg).items():
        if key in ys:
            for st, k_n in cut.mult.get(u, []):
                add(T[st], ys[key], k_n * sec * _SECONDS)
    for z, u, sec in shared.get("sp_credit_vars", ()):  # a sequence-parallel gather's reduce-scatter, on its stages
        for st, k_n in cut.mult.get(u, []):
            add(T[st], z, -k_n * sec * _SECONDS)
    ck: dict[tuple[int, int], object] = {}
    zts: dict[int, list[int]] = {r: [] for r in range(p)}
    for t, info in cg.templates.items():
        # a block's saved bytes, recompute and kept input, each one variable (stated once, read by every stage's
        # checkpoint rows and memory rows: the same MILP, far fewer matrix entries)
        At, Ft, It = (as_var(m, e) for e in _block_exprs(cg, s, t))
        host = cg.ckpt_host_s.get(t, 0.0) * _SECONDS
        stages_t = [st for st in range(S) if cut.n[st].get(t)]
        left = min_ckpt.get(t, 0)
        bounds = block_bounds(cg, t)
        for st in stages_t:
            n_t = cut.n[st][t]
            cv = checkpoint_vars(m, n_t, At, Ft, It, bounds, host=host, enabled=checkpoint,
                                 least=n_t if left >= info.count else 0)
            ck[(t, st)] = cv
            for j, x in At.items():
                add(A[st], j, n_t * x)
            for b_, (za, zf, zi, y) in enumerate(zip(cv.zA, cv.zF, cv.zI, cv.ys)):
                w = float(2 ** b_)
                add(A[st], za, -w)
                add(A[st], zi, w)
                add(T[st], zf, w)
                add(T[st], y, w * host)
            zts[lay.rank(st)].append(cv.zT)
        if 0 < left < info.count:  # some of this template's blocks must be checkpointed: at least that many in all
            m.row({y: float(2 ** b_) for st in stages_t for b_, y in enumerate(ck[(t, st)].ys)}, float(left),
                  math.inf, "ckpt_count")
    pol = add_stage_policies(m, cg, s, lay, cut, A, T, zts, ck, enabled=checkpoint)
    if zt is not None:  # a stage takes the longer of its compute and its gathers (overlapped), else their sum
        for st in range(S):
            if zt.overlap:
                V = m.var(ub=math.inf)
                m.row({V: 1.0, **{j: -x for j, x in T[st].items()}}, 0.0, math.inf, "pp_fsdp_compute")
                m.row({V: 1.0, **{j: -x for j, x in G[st].items()}}, Gc[st] * _SECONDS, math.inf, "pp_fsdp_gather")
                T[st] = {V: 1.0}
            else:
                for j, x in G[st].items():
                    add(T[st], j, x)
                Tc[st] += Gc[st]
    m.c = [0.0] * len(m.c)  # the objective is the pipelined step, stated below
    R = m.var(ub=math.inf)
    Q = m.var(ub=math.inf)
    for r, mine in enumerate(lay.ranks()):
        row = {R: 1.0}
        for st in mine:
            for j, x in T[st].items():
                row[j] = row.get(j, 0.0) - x
        m.row(row, sum(Tc[st] for st in mine) * _SECONDS, math.inf, "pp_rank_time")
        row = {Q: 1.0}
        for st in mine:
            for j, x in tail[st].items():
                row[j] = row.get(j, 0.0) - x
        m.row(row, Qc[r] * _SECONDS, math.inf, "pp_rank_tail")
    alpha = lay.alpha  # NOTE [the fill of a planned schedule]
    obj: dict[int, float] = {R: float(M), Q: 1.0}
    for st in range(S):
        for j, x in T[st].items():
            obj[j] = obj.get(j, 0.0) + alpha * x
    for b_ in range(S - 1):
        send = _send_s(cg, lay, cut, b_)
        if isinstance(send, list):
            for (u, k), sec in send:
                obj[s[u, k]] = obj.get(s[u, k], 0.0) + 2 * sec * _SECONDS
    # memory per rank at each undominated moment (NOTE [a rank's memory at each moment]), with one recomputed
    # block or working set
    work = working_terms(cg)
    fixed = cg.fixed_static_bytes * _BYTES
    rows_needed = budget_bytes is not None or minimise == "memory"
    trans = []
    for r, mine in enumerate(lay.ranks()):
        trans.append(m.var(ub=math.inf))
        for z in zts[r]:
            m.row({trans[r]: 1.0, z: -1.0}, 0.0, math.inf, "pp_transient")
        for u, w in ((u, w) for u, w in work if any(lay.rank(st) == r for st, _ in cut.mult.get(u, ()))):
            m.row({trans[r]: 1.0, **{s[u, k]: -x * _BYTES for k, x in enumerate(w) if x}}, 0.0, math.inf,
                  "pp_working")
    mem_rows = (memory_rows(m, lay, rank_moments(lay, tracks_gathered(cg)), static, A, GR, GA, WH, trans)
                if rows_needed else [])
    if minimise == "memory":
        P = m.var(ub=math.inf)
        for row in mem_rows:
            m.row({P: 1.0, **{j: -x for j, x in row.items()}}, fixed, math.inf, "peak")
        obj = {P: 1.0}
    for j, x in obj.items():
        m.c[j] += x
    if cutoff_s is not None and minimise == "time":  # NOTE [a cutoff from the best plan found]
        m.row({j: x for j, x in enumerate(m.c) if x}, -math.inf, cutoff_s * _SECONDS, "cutoff")
    if budget_bytes is not None:
        for row in mem_rows:
            add_memory(m, row, fixed, budget_bytes)
    res = m.solve(time_limit_s, rel_gap)
    solve_s = time.perf_counter() - t0
    if res.x is None:
        return None, solve_s, len(m.c), len(m.clb)
    x = res.x
    choice = [next(k for k in range(len(unit.costs)) if x[s[u, k]] > 0.5) for u, unit in enumerate(cg.units)]
    counts = {key: int(round(sum(2 ** b_ * x[y] for b_, y in enumerate(cv.ys)))) for key, cv in ck.items()}
    pcounts = {key: n for key, n in counts_of(x, pol).items() if n}
    status = "optimal" if res.status == 0 else "time_limit"
    gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
    return (choice, counts, pcounts, status, gap), solve_s, len(m.c), len(m.clb)


def evaluate(cg, lay: _Layout, cut: _Cut, choice: list[int], counts: dict[tuple[int, int], int],
             policies: dict[tuple[int, int, str], int] | None = None):
    """The step and each rank's peak of a choice, per-stage checkpoint counts ((template, stage) -> count) and
    per-stage selective policy counts ((template, stage, policy) -> count: NOTE [checkpoint policies in a pipeline's
    stages]), as the MILP states them (NOTE [pipeline in the plan]), computed directly. Returns (step_s,
    peak_bytes, terms)."""
    S, p, M = lay.n_stages, lay.p, lay.m
    T = [0.0] * S
    A = [0.0] * S
    static = [0.0] * S
    tail = [0.0] * S
    rec = [0.0] * S
    trans = [0.0] * p
    zt = zero_terms(cg)  # NOTE [pipeline FSDP2 in the plan]
    G, GR, GA, WH = [0.0] * S, [0.0] * S, [0.0] * S, [0.0] * S  # gathers' seconds; bytes (NOTE in moments.py)
    Gc, Tc, Qc = stage_constants(cg, zt, lay, cut)
    in_template = {u: t for t, info in cg.templates.items() for u in info.units}
    for u, unit in enumerate(cg.units):
        k = choice[u]
        c = unit.costs[k]
        for st, k_n in cut.mult.get(u, []):
            T[st] += k_n * (_step_time(c) if zt is None else zt.step_s(c))
            base, gr, ga = unit_bytes(c, zt, u, k)
            static[st] += k_n * base
            GR[st] += k_n * gr
            GA[st] += k_n * ga
            WH[st] += k_n * c.w_held_bytes
            tail[st] += k_n * (_tail_time(c) if zt is None else zt.tail_s(u, k, c))
            if zt is not None:
                G[st] += k_n * zt.gather_s(u, k)
            if u not in in_template:
                A[st] += c.act_bytes
    for u, per in tied_on_last(cg, lay, cut).items():  # NOTE [a tied parameter on two ranks]
        static[S - 1] += per[choice[u]][0]
        GR[S - 1] += per[choice[u]][1]
    needed = {(j, a, cg.units[u].count) for u, unit in enumerate(cg.units)
              for (j, a) in unit.costs[choice[u]].grad_sums}
    for key, (u, sec) in _grad_sum_units(cg).items():
        if key in needed:
            for st, k_n in cut.mult.get(u, []):
                T[st] += k_n * sec
    for g in sp_active(cg, choice):  # the MILP's sp_credit_vars, realised
        for st, k_n in cut.mult.get(g.unit, []):
            T[st] -= k_n * g.saving_s
    for t, info in cg.templates.items():
        At = sum(cg.units[u].costs[choice[u]].act_bytes for u in info.units)
        Ft = sum(cg.units[u].costs[choice[u]].rec_s for u in info.units)
        It = info.input_bytes[choice[info.input_unit]] if info.input_unit is not None else 0.0
        host = cg.ckpt_host_s.get(t, 0.0)
        for st in range(S):
            n_t = cut.n[st].get(t, 0)
            if not n_t:
                continue
            c_ = counts.get((t, st), 0)
            A[st] += (n_t - c_) * At + c_ * It
            T[st] += c_ * (Ft + host)
            rec[st] += c_ * (Ft + host)
            if c_:
                trans[lay.rank(st)] = max(trans[lay.rank(st)], At)
    policy_terms(cg, lay, choice, policies or {}, A, T, rec, trans)
    for u, sts in cut.mult.items():  # NOTE [a backward's working set], beside the recomputed block's
        for r in {lay.rank(st) for st, _ in sts}:
            trans[r] = max(trans[r], working_of(cg, choice, (u,)))
    if zt is not None:
        T = [max(T[st], G[st] + Gc[st]) if zt.overlap else T[st] + G[st] + Gc[st] for st in range(S)]
    T = [t_ + c_ for t_, c_ in zip(T, Tc)]
    ranks = lay.ranks()
    R = max(sum(T[st] for st in mine) for mine in ranks)
    Q = max(sum(tail[st] for st in mine) + Qc[r] for r, mine in enumerate(ranks))
    sends = 0.0
    link = cg.cluster.link(cg.roles.pp)
    for b_ in range(S - 1):
        nxt = cut.stages[b_ + 1]
        if nxt and lay.rank(b_) != lay.rank(b_ + 1):
            info = cg.templates[lay.blocks[nxt[0]][1]]
            if info.input_unit is not None:
                sends += 2 * send_recv_time_s(info.input_bytes[choice[info.input_unit]], link)
    tied = _tied_s(cg, lay)
    alpha = lay.alpha  # NOTE [the fill of a planned schedule]
    step = M * R + alpha * sum(T) + Q + sends + tied
    moments = rank_moments(lay, tracks_gathered(cg))  # NOTE [a rank's memory at each moment]
    peaks = []
    for r, mine in enumerate(ranks):
        st_b = sum(static[st] for st in mine) + cg.fixed_static_bytes
        at = [(*moment_bytes(mo, A, GR, GA, WH), trans[r] if mo.backward else 0.0) for mo in moments[r]]
        act, held, tr = max(at, key=sum, default=(0.0, 0.0, 0.0))  # a backward's moment adds the transient
        peaks.append((st_b + held + act + tr, st_b + held, act, tr))  # held: the moment's static
    peak = max(peaks)
    busiest = max(range(p), key=lambda r: sum(T[st] for st in ranks[r]))
    recompute = M * sum(rec[st] for st in ranks[busiest])
    terms = {"compute_s": step - sends - tied - recompute, "comm_s": sends + tied, "recompute_s": recompute,
             "static_bytes": peak[1] - cg.fixed_static_bytes, "activation_bytes": peak[2], "transient_bytes": peak[3],
             "fixed_bytes": cg.fixed_static_bytes, "bubble_s": alpha * sum(T), "rank_s": R, "tail_s": Q,
             "stage_s": tuple(T), "rank_peak_bytes": tuple(x[0] for x in peaks)}
    return step, peak[0], terms


def _choice_of(cg, lay: _Layout, cut: _Cut, counts: dict[tuple[int, int], int], terms: dict,
               policies: dict[tuple[int, int, str], int] | None = None) -> PipelineChoice:
    paths = [tuple(lay.blocks[i][0] for i in st) for st in cut.stages]
    ckpt, under = [], []
    order = lambda x: int((x[0] if isinstance(x, tuple) else x).rpartition(".")[2])  # noqa: E731
    for st, positions in enumerate(cut.stages):
        chosen: list[str] = []
        kept: list[tuple[str, str]] = []
        for t in sorted({lay.blocks[i][1] for i in positions}):
            members = [lay.blocks[i][0] for i in positions if lay.blocks[i][1] == t]
            own = {p_: n for (t2, st2, p_), n in (policies or {}).items() if (t2, st2) == (t, st) and n}
            for path, how in pick(members, counts.get((t, st), 0), own).items():
                if how == "full":
                    chosen.append(path)
                else:
                    kept.append((path, how))
        ckpt.append(tuple(sorted(chosen, key=order)))
        under.append(tuple(sorted(kept, key=order)))
    roles = cg.roles
    return PipelineChoice(roles.pp, lay.schedule, roles.pp_microbatches, tuple(paths), tuple(ckpt),
                          terms["stage_s"], terms["rank_peak_bytes"], terms["bubble_s"],
                          policies=tuple(under) if any(under) else ())


def _scalars(terms: dict) -> dict[str, float]:
    return {k: float(v) for k, v in terms.items() if isinstance(v, (int, float))}


def solve(cg, *, budget_bytes, checkpoint: bool, time_limit_s: float, rel_gap: float, min_ckpt: dict,
          minimise: str, cutoff_s: float | None = None) -> Solution | None:
    """The best plan of a pipeline role assignment: the MILP of NOTE [pipeline in the plan] for each schedule
    (`schedules`) and each proposed cut (`partitions`), then the cuts beside the best (NOTE [cuts beside the proposed
    ones]), the fastest (with
    ``minimise="memory"``: the smallest peak) kept. None without a pp axis. `cutoff_s` (NOTE [a cutoff from the
    best plan found]): only plans faster are sought, each cut's MILP held below the best so far; status "pruned"
    when none is."""
    if cg.roles.pp is None:
        return None
    best: Solution | None = None
    best_cut: tuple[str, _Layout, tuple] | None = None
    walked: set[tuple[str, tuple]] = set()  # (schedule, cut) solved
    n_vars = n_cons = 0
    spent = 0.0
    key = (lambda x: (x.peak_bytes, x.step_s)) if minimise == "memory" else (lambda x: (x.step_s, x.peak_bytes))
    zt = zero_terms(cg)
    coefs = unit_coefs(cg, zt)
    base = None  # built at the first cut solved
    mins = _unit_mins(cg, zt)
    mem = _memory_mins(cg, zt) if budget_bytes is not None else None
    tmins = template_mins(cg, mem) if mem is not None else None

    def above(floor: float, bound: float | None) -> bool:  # NOTE [a lower bound before the MILP]
        return minimise == "time" and bound is not None and floor > bound * (1 + _FLOOR_TOL)

    def solve_one(lay: _Layout, stages: tuple, best: Solution | None, level: bool = False) -> Solution | None:
        """The best plan of one cut, or None (pruned by a floor, infeasible, not better than `best`; with `level`:
        not worse than it by more than `_LEVEL`)."""
        nonlocal base, spent, n_vars, n_cons
        cut = _cut(cg, lay, stages)
        bound = cutoff_s  # and below this role assignment's best cut so far (a neighbour: level with it)
        if best is not None and minimise == "time":
            ceiling = best.step_s * (1 + _LEVEL) if level else best.step_s
            bound = ceiling if bound is None else min(bound, ceiling)
        rec = None  # NOTE [the recomputation a budget forces]
        if mem is not None:
            if _memory_floor_of_cut(cg, lay, cut, mem) > budget_bytes * (1 + 1e-9):
                return None  # no plan of this cut fits: the MILP would find it infeasible
            if minimise == "time":
                rec = _recompute_floor(cg, lay, cut, mem, tmins, budget_bytes, checkpoint and not lay.split)
                if rec is None:
                    return None  # no checkpoints make it fit: infeasible too (a policy keeps more than full)
                if offered(cg, stages=True):  # a policy may save bytes for fewer seconds than a full checkpoint
                    rec = 0.0
        if above(_objective_floor(cg, lay, cut, zt, mins, rec), bound):
            return None
        got, solve_s, nv, nc = _solve_cut(cg, lay, cut, budget_bytes=budget_bytes,
                                          checkpoint=checkpoint and not lay.split,
                                          time_limit_s=time_limit_s, rel_gap=rel_gap, min_ckpt=min_ckpt,
                                          minimise=minimise, cutoff_s=bound, coefs=coefs,
                                          base=(base := base or base_model(cg)))
        spent += solve_s
        n_vars, n_cons = max(n_vars, nv), max(n_cons, nc)
        if got is None:
            return None
        choice, counts, pcounts, status, gap = got
        step, peak, terms = evaluate(cg, lay, cut, choice, counts, pcounts)
        if budget_bytes is not None and peak > budget_bytes * (1 + 1e-9):
            return None
        return Solution(choice, {}, step, peak, status, gap, solve_s, nv, nc, _scalars(terms),
                        stages=_choice_of(cg, lay, cut, counts, terms, pcounts))

    # the schedules by their floor, lowest first: the best plan found so far prunes the cuts of the others
    # (NOTE [a lower bound before the MILP]); the floor reads the schedule class's order, so torch must take it
    # (the split-backward ones without checkpoints, so not where checkpoints are required or memory is minimised:
    # NOTE [zero-bubble schedules in the plan] in kinds.py)
    no_split = minimise == "memory" or any(min_ckpt.values())
    if no_split and cg.roles.pp_schedule in SPLIT_BACKWARD:
        raise PlanError(f"pipeline schedule {cg.roles.pp_schedule!r}: a split-backward schedule is planned without "
                        f"checkpointed blocks (torch's split backward runs their forward again for the weight "
                        f"gradients: NOTE [zero-bubble schedules in the plan]), so not with required checkpoints or "
                        f"when minimising memory; plan it without them, or pin 1f1b or interleaved_1f1b")
    kinds = [(_role_floor(cg, lay, mins), kind, lay) for kind in _stage_counts_allow(cg)
             if not (no_split and kind in SPLIT_BACKWARD) and _torch_takes(cg, kind) for lay in (_layout(cg, kind),)]
    tightened = cutoff_s is None and budget_bytes is None  # (or nothing to prune: no floor to tighten)
    for floor, kind, lay in sorted(kinds, key=lambda x: x[0]):
        if above(floor, cutoff_s):
            continue
        if not tightened:  # NOTE [a block's floors under the layout match], once a schedule's plain floor passes
            base, tightened = base or base_model(cg), True
            mins, mem = coupled_mins(cg, base, coefs, mins, mem)
        if above(_role_floor(cg, lay, mins), cutoff_s):
            continue
        for stages in partitions(cg, lay, budget_bytes):
            walked.add((kind, stages))
            sol = solve_one(lay, stages, best)
            if sol is not None and (best is None or key(sol) < key(best)):
                best, best_cut = sol, (kind, lay, stages)
    # NOTE [cuts beside the proposed ones]: from the best cut, its neighbours, a plateau walked as far as it is level
    frontier, tries = [best_cut] if best is not None and minimise == "time" else [], 0
    while frontier and tries < _NEIGHBOUR_TRIES:
        kind, lay, stages = frontier.pop(0)
        for near in neighbours(stages, len(lay.blocks), pinned_ends(cg, lay)):
            if (kind, near) in walked or tries >= _NEIGHBOUR_TRIES:
                continue
            walked.add((kind, near))
            tries += 1
            sol = solve_one(lay, near, best, level=True)
            if sol is not None and sol.step_s <= best.step_s * (1 + _LEVEL):
                frontier.append((kind, lay, near))
                if key(sol) < key(best):
                    best, best_cut = sol, (kind, lay, near)
    if best is None:
        status = "pruned" if cutoff_s is not None and minimise == "time" else "infeasible"
        return Solution([], {}, math.inf, math.inf, status, math.inf, spent, n_vars, n_cons)
    best.solve_s = spent
    best.stages = replace(best.stages, weighed=tuple(kind for _, kind, _ in kinds))
    return best
