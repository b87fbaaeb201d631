"""One MILP (HiGHS via `scipy.optimize.milp`) choosing every unit's strategy and each block template's
checkpoint count, minimising the training-step time under a per-device memory budget.

Formulation (per role assignment; all times in seconds, memory in bytes per device):

    variables  s[u,k] in {0,1}        strategy k of unit u                     (one_strategy)
               y[t,b] in {0,1}        bit b of c_t, the number of checkpointed blocks of template t
               q[t]   in {0,1}        c_t > 0
               zA, zF, zI, zT >= 0    products y·A_t, y·F_t, y·In_t, q·A_t     (ckpt_linearise, McCormick;
                                      exact because one factor is binary and the other bounded)
               T >= 0                 the largest recomputed block, or the largest backward working set
                                      (transient, working_set: NOTE [a backward's working set])

    A_t  = sum_{u in t,k} act[u,k] s[u,k]      saved bytes of one block of t
    F_t  = sum_{u in t,k} rec[u,k] s[u,k]      seconds one block's recompute repeats (to its last saving op)
    In_t = sum_k in_bytes[k] s[input unit,k]   bytes a checkpointed block keeps (its input)
    c_t  = sum_b 2^b y[t,b] <= L_t                                              (ckpt_count)

    min  sum_u count_u sum_k (compute+comm)[u,k] s[u,k]  +  sum_t sum_b 2^b zF[t,b]
    s.t. sum_k s[u,k] = 1                                                      (one_strategy)
         for each edge and placement value v: sum_{k: pub_u(k)=v} s[u,k] = sum_{l: in_v(l)=v} s[v,l]
                                                                                (layout_match)
         static(s) + fixed + act_outside(s) + sum_t (L_t A_t - sum_b 2^b zA + sum_b 2^b zI) + T <= budget
                                                                                (memory)
         q[t] >= y[t,b];  T >= zT[t];  T >= sum_k work[u,k] s[u,k]               (ckpt_any, transient, working_set)
         each parallel form's families (`treadle.form.Form.ilp_rows`; data parallelism:
         E >= latency + sum_u count_u sum_k (dp_comm - W)[u,k] s[u,k],  E >= 0   dp_exposure)
         y[g] >= s[u,k] for each strategy needing input-gradient sum g           (grad_sum)
         a form's variant of a template's blocks: an integer count w of them, its constant terms linear in w
         (variant_count, variant_excludes, variant_checkpointed: NOTE [block variants] in `variants.py`)
         with selective checkpoint policies allowed, a count of a template's blocks under each, its products as
         the full count's (policy_count: NOTE [checkpoint policies in the plan] in `policies.py`)

    where the objective counts each y[g] (count x seconds of a shared all-reduce, NOTE [shared
    input-gradient sum] in `treadle.forms.tensor.plan`) and E (the exposed data-parallel sync, NOTE [bucketed data parallel] in
    `treadle.forms.data.plan`) besides compute and comm;

`add_*` functions below add each family; `solve` assembles them. `solve_exhaustive` enumerates all
choices of a tiny cost graph with the same cost formulas and is the test oracle. The memory at the peak
is the start of backward: every saved activation is alive, plus one recomputed block (see NOTE in
cost_graph.py for what each term counts).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import PlanError
from ..form import forms
from ..quiet import native_stdout_to_stderr
from . import policies, variants
from .ckpt_vars import (_BYTES, _SECONDS, CheckpointVars, _block_exprs, _mccormick, _upper,  # noqa: F401
                        block_bounds, checkpoint_vars)
from .cost_graph import CostGraph
from .grad_live import working_terms
from .step_eval import evaluate  # noqa: F401  (the ILP's terms of one choice, computed directly)

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class Solution:
    """The solver's choice and what it predicts. `status`: "optimal", "time_limit" (incumbent returned) or
    "infeasible". `gap` is HiGHS's relative MIP gap (0 when proven optimal)."""

    choice: list[int]
    ckpt: dict[int, int]
    step_s: float
    peak_bytes: float
    status: str
    gap: float
    solve_s: float
    n_vars: int = 0
    n_cons: int = 0
    terms: dict[str, float] = field(default_factory=dict)
    stages: Any = None  # a pipeline's stages, micro-batches and per-stage checkpoints (`treadle.forms.pipeline.plan`)
    variants: dict[tuple[int, str], int] = field(default_factory=dict)  # blocks per variant (NOTE [block variants])
    # blocks per (template, selective checkpoint policy) (NOTE [checkpoint policies in the plan] in `policies.py`)
    policies: dict[tuple[int, str], int] = field(default_factory=dict)


class _Model:
    """Sparse MILP under construction: named variables and named constraint families."""

    def __init__(self) -> None:
        self.c: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integ: list[int] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.clb: list[float] = []
        self.cub: list[float] = []
        self.family: list[str] = []


    def var(self, *, lb: float = 0.0, ub: float = 1.0, integer: bool = False, cost: float = 0.0) -> int:
        self.c.append(cost)
        self.lb.append(lb)
        self.ub.append(ub)
        self.integ.append(1 if integer else 0)
        return len(self.c) - 1

    def row(self, terms: dict[int, float] | list[tuple[int, float]], lb: float, ub: float, family: str) -> None:
        r = len(self.clb)
        items = terms.items() if isinstance(terms, dict) else terms
        for j, v in items:
            if v != 0.0:
                self.rows.append(r)
                self.cols.append(j)
                self.vals.append(v)
        self.clb.append(lb)
        self.cub.append(ub)
        self.family.append(family)

    def solve(self, time_limit_s: float, rel_gap: float):
        from scipy.optimize import Bounds, LinearConstraint, milp  # the solver: imported where it runs
        from scipy.sparse import coo_matrix

        n = len(self.c)
        ij = (np.array(self.rows, dtype=np.int32), np.array(self.cols, dtype=np.int32))
        A = coo_matrix((np.array(self.vals, dtype=np.float64), ij), shape=(len(self.clb), n)).tocsr()
        cons = [LinearConstraint(A, np.array(self.clb), np.array(self.cub))] if self.clb else []
        with native_stdout_to_stderr():  # NOTE [a native solver's stdout]
            return milp(np.array(self.c), integrality=np.array(self.integ), bounds=Bounds(self.lb, self.ub),
                        constraints=cons, options={"time_limit": time_limit_s, "mip_rel_gap": rel_gap, "disp": False})


@dataclass(slots=True)
class _Vars:
    s: dict[tuple[int, int], int]
    bits: dict[int, list[int]]
    q: dict[int, int]
    zA: dict[int, list[int]]
    zF: dict[int, list[int]]
    zI: dict[int, list[int]]
    zT: dict[int, int]
    T: int | None
    variants: dict[tuple[int, str], int]  # (template, name) -> count variable (NOTE [block variants])
    policies: dict = field(default_factory=dict)  # (template, policy) -> its CheckpointVars (`policies.py`)


def add_strategy_vars(m: _Model, cg: CostGraph) -> dict[tuple[int, int], int]:
    """s[u,k] with the per-execution cost times the unit's count; disallowed strategies fixed to 0."""
    s = {}
    for u, unit in enumerate(cg.units):
        for k, c in enumerate(unit.costs):
            s[u, k] = m.var(ub=1.0 if unit.allowed[k] else 0.0, integer=True,
                            cost=unit.count * (c.compute_s + c.comm_s) * _SECONDS)
    return s


def head_units(cg: CostGraph) -> list[int]:
    """The units of the ops that run before the first repeated block, outside every block (forward order:
    the graph's node order); empty for a graph without repeated blocks (NOTE [the last bucket])."""
    nodes = cg.graph.nodes
    first = cg.graph.first_block_op()
    if first is None:
        return []
    return [u for u, unit in enumerate(cg.units)
            if all(nodes[i].kind == "op" and nodes[i].block is None and i < first for i in unit.nodes)]


def add_one_strategy(m: _Model, cg: CostGraph, s) -> None:
    for u, unit in enumerate(cg.units):
        m.row({s[u, k]: 1.0 for k in range(len(unit.costs))}, 1.0, 1.0, "one_strategy")


def add_layout_match(m: _Model, cg: CostGraph, s) -> None:
    for e in cg.edges:
        for val in set(e.u_vals) | set(e.v_vals):
            terms: dict[int, float] = {}
            for k, x in enumerate(e.u_vals):
                if x == val:
                    terms[s[e.u, k]] = terms.get(s[e.u, k], 0.0) + 1.0
            for l, x in enumerate(e.v_vals):
                if x == val:
                    terms[s[e.v, l]] = terms.get(s[e.v, l], 0.0) - 1.0
            m.row(terms, 0.0, 0.0, "layout_match")


def as_var(m: _Model, expr: dict[int, float]) -> dict[int, float]:
    """`expr` as one variable e (a row e = expr, "block_expr") where it has more than one term: a block's
    expression read by several rows (the checkpoint products, a pipeline's stages and memory moments) is then
    stated once, the same MILP with far fewer matrix entries."""
    if len(expr) <= 1:
        return expr
    e = m.var(ub=math.inf)
    m.row({e: 1.0, **{j: -x for j, x in expr.items()}}, 0.0, 0.0, "block_expr")
    return {e: 1.0}


def add_checkpoints(m: _Model, cg: CostGraph, s, *, enabled: bool, min_ckpt: dict[int, int]) -> _Vars:
    """Checkpoint counts per template (binary expansion) and the McCormick products (ckpt_linearise)."""
    bits, q, zA, zF, zI, zT = {}, {}, {}, {}, {}, {}
    for t, info in cg.templates.items():
        A, F, In = _block_exprs(cg, s, t)
        host = cg.ckpt_host_s.get(t, 0.0) * _SECONDS  # NOTE [framework overheads]: per checkpointed block
        cv = checkpoint_vars(m, info.count, A, F, In, block_bounds(cg, t), host=host, enabled=enabled,
                             least=min_ckpt.get(t, 0))
        bits[t], q[t], zA[t], zF[t], zI[t], zT[t] = cv.ys, cv.q, cv.zA, cv.zF, cv.zI, cv.zT
    return _Vars(s, bits, q, zA, zF, zI, zT, None, {})


def memory_expression(m: _Model, cg: CostGraph, v: _Vars, *,
                      static_only: bool = False) -> tuple[dict[int, float], float]:
    """Peak memory per device as (terms, constant) in GiB (NOTE [row scaling]), adding the transient
    variable T (transient)."""
    terms: dict[int, float] = {}

    def add(j: int, x: float) -> None:
        if x:
            terms[j] = terms.get(j, 0.0) + x

    if static_only:
        for u, unit in enumerate(cg.units):
            for k, c in enumerate(unit.costs):
                add(v.s[u, k], unit.count * c.static_bytes * _BYTES)
        for key, x in variants.variants_of(cg).items():
            add(v.variants[key], x.delta.static_bytes * _BYTES)
        return terms, cg.fixed_static_bytes * _BYTES
    for u, unit in enumerate(cg.units):
        for k, c in enumerate(unit.costs):
            add(v.s[u, k], (unit.count * c.static_bytes + unit.count * c.act_bytes) * _BYTES)
    for j, x in variants.memory_terms(cg, v.variants, _BYTES).items():
        add(j, x)
    zs = [(v.zA[t], v.zI[t]) for t in cg.templates] + [(cv.zA, cv.zI) for cv in v.policies.values()]
    for zA, zI in zs:
        for b, (za, zi) in enumerate(zip(zA, zI)):
            add(za, -float(2 ** b))
            add(zi, float(2 ** b))
    work = working_terms(cg)  # NOTE [a backward's working set]: at another moment than a recompute, so the larger
    if cg.templates or work:
        T = m.var(ub=math.inf)
        v.T = T
        for zt in [*v.zT.values(), *(cv.zT for cv in v.policies.values())]:
            m.row({T: 1.0, zt: -1.0}, 0.0, math.inf, "transient")
        for u, w in work:
            m.row({T: 1.0, **{v.s[u, k]: -x * _BYTES for k, x in enumerate(w) if x}}, 0.0, math.inf, "working_set")
        add(T, 1.0)
    return terms, cg.fixed_static_bytes * _BYTES


def first_template(cg: CostGraph) -> int | None:
    """The template of the first repeated block in forward order (None without blocks)."""
    if not cg.templates:
        return None
    return min(cg.templates, key=lambda t: min(i for u in cg.templates[t].units for i in cg.units[u].nodes))


def add_memory(m: _Model, terms: dict[int, float], const: float, budget_bytes: float) -> None:
    """Peak <= budget. `terms` and `const` come in the ILP's scaled unit (NOTE [row scaling]); this one row is
    stated in bytes, so HiGHS's absolute feasibility tolerance (1e-7) is far below a byte (NOTE [exact
    budget]). Only the McCormick rows need the small scale."""
    m.row({j: v / _BYTES for j, v in terms.items()}, -math.inf, budget_bytes - const / _BYTES, "memory")


# NOTE [exact budget]: the memory row is scaled (NOTE [row scaling]) and HiGHS accepts a row violated by up
# to its feasibility tolerance, i.e. a plan some bytes over the budget. `solve` therefore re-checks the
# chosen plan's peak in bytes (`evaluate`, exact sums of integers) and, when it is over, solves again with
# the budget lowered by the excess plus a margin (1 byte, then 16x more each time), at most _BUDGET_RETRIES
# times; a plan still over is reported infeasible, never returned. `add_memory` states the row in bytes, so
# with the default scaling the first solution already holds.
_BUDGET_RETRIES = 4


def solve(cg: CostGraph, *, budget_bytes: float | None, checkpoint: bool = True, time_limit_s: float = 20.0,
          rel_gap: float = 1e-4, min_ckpt: dict[int, int] | None = None,
          minimise: str = "time", memory: str = "all", cutoff_s: float | None = None) -> Solution:
    """Solve the MILP; with a budget, the returned plan's peak is within it to the byte (NOTE [exact
    budget]). `budget_bytes=None` drops the memory constraint; ``minimise="memory"`` minimises
    the peak instead of the step time (used to report the smallest feasible budget); ``memory="static"``
    constrains only parameters, gradients and optimizer state (stage one of the two-stage mode).
    Returns a Solution with status "infeasible" (and empty choice) when no plan fits. A parallel form that owns
    the step's formula solves it instead (`treadle.form.Form.solve`: a pipeline's stages), and may take
    `cutoff_s` (NOTE [a cutoff from the best plan found]: status "pruned" when no plan of it is faster)."""
    for f in forms():
        own = f.solve(cg, budget_bytes=budget_bytes, checkpoint=checkpoint, time_limit_s=time_limit_s,
                      rel_gap=rel_gap, min_ckpt=min_ckpt or {}, minimise=minimise, cutoff_s=cutoff_s)
        if own is not None:
            return own
    limit = budget_bytes
    sol = _solve_once(cg, budget_bytes=limit, checkpoint=checkpoint, time_limit_s=time_limit_s, rel_gap=rel_gap,
                      min_ckpt=min_ckpt, minimise=minimise, memory=memory)
    step = 1.0
    for _ in range(_BUDGET_RETRIES):
        if budget_bytes is None or sol.status == "infeasible" or _peak_of(cg, sol, memory) <= budget_bytes:
            return sol
        limit = limit - (_peak_of(cg, sol, memory) - budget_bytes) - step
        step *= 16
        logger.debug("ILP plan over budget by %.0f B; re-solving under %.0f B", sol.peak_bytes - budget_bytes, limit)
        sol = _solve_once(cg, budget_bytes=limit, checkpoint=checkpoint, time_limit_s=time_limit_s, rel_gap=rel_gap,
                          min_ckpt=min_ckpt, minimise=minimise, memory=memory)
    if budget_bytes is not None and sol.status != "infeasible" and _peak_of(cg, sol, memory) > budget_bytes:
        return Solution([], {}, math.inf, math.inf, "infeasible", math.inf, sol.solve_s, sol.n_vars, sol.n_cons)
    return sol


def _peak_of(cg: CostGraph, sol: Solution, memory: str) -> float:
    """The peak the budget constrains: all memory, or static only (stage one of two_stage)."""
    if memory == "static":
        return sol.terms["static_bytes"] + cg.fixed_static_bytes
    return sol.peak_bytes


def _solve_once(cg: CostGraph, *, budget_bytes: float | None, checkpoint: bool, time_limit_s: float,
                rel_gap: float, min_ckpt: dict[int, int] | None, minimise: str, memory: str) -> Solution:
    t0 = time.perf_counter()
    m = _Model()
    s = add_strategy_vars(m, cg)
    add_one_strategy(m, cg, s)
    w = variants.add_variant_vars(m, cg, s, _SECONDS)
    shared: dict = {"variants": w}  # read by the data-parallel exposure rows (NOTE [block variants])
    for f in forms():  # each form's constraint families (tensor parallelism: grad_sum; sequence: sp_gather; data:
        f.ilp_rows(m, cg, s, shared)  # dp_exposure)
    add_layout_match(m, cg, s)
    v = add_checkpoints(m, cg, s, enabled=checkpoint, min_ckpt=min_ckpt or {})
    v.variants = w
    variants.link_checkpoints(m, cg, w, v.bits, v.q, _SECONDS)
    v.policies = policies.add_vars(m, cg, s, enabled=checkpoint, seconds=_SECONDS, nbytes=_BYTES)
    policies.add_rows(m, cg, v.bits, v.policies)
    terms, const = memory_expression(m, cg, v, static_only=(memory == "static"))
    rows = [(terms, const)]
    if memory != "static":  # further points of the step (data parallelism: NOTE [the backward's end])
        for f in forms():
            rows += f.memory_rows(m, cg, v)
    if minimise == "memory":
        m.c = [0.0] * len(m.c)
        if len(rows) == 1:
            for j, x in terms.items():
                m.c[j] += x
        else:  # the larger of the two points: P >= each row (same constant)
            P = m.var(ub=math.inf, cost=1.0)
            for t_, _c in rows:
                m.row({P: 1.0, **{j: -x for j, x in t_.items()}}, 0.0, math.inf, "peak")
    if budget_bytes is not None:
        for t_, c_ in rows:
            add_memory(m, t_, c_, budget_bytes)
    res = m.solve(time_limit_s, rel_gap)
    solve_s = time.perf_counter() - t0
    n_vars, n_cons = len(m.c), len(m.clb)
    logger.debug("ILP %s: %d vars, %d constraints, status %s, %.2f s", cg.roles, n_vars, n_cons, res.status, solve_s)
    if res.x is None:
        return Solution([], {}, math.inf, math.inf, "infeasible", math.inf, solve_s, n_vars, n_cons)
    x = res.x
    choice = []
    for u, unit in enumerate(cg.units):
        ks = [k for k in range(len(unit.costs)) if x[s[u, k]] > 0.5]
        if len(ks) != 1:
            raise PlanError(f"ILP returned a non-integral choice for unit {u} ({cg.units[u].module}); "
                            f"this is a solver bug, please report it")
        choice.append(ks[0])
    ckpt = {t: int(round(sum(2 ** b * x[y] for b, y in enumerate(ys)))) for t, ys in v.bits.items()}
    counts = {key: int(round(x[j])) for key, j in w.items()}
    pol = policies.counts_of(x, v.policies)
    status = "optimal" if res.status == 0 else "time_limit"
    gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
    step_s, peak, terms_out = evaluate(cg, choice, ckpt, counts, pol)
    return Solution(choice, ckpt, step_s, peak, status, gap, solve_s, n_vars, n_cons, terms_out, variants=counts,
                    policies=pol)


def feasible_choice(cg: CostGraph, choice: list[int]) -> bool:
    """Whether a choice meets every layout_match edge."""
    return all(e.u_vals[choice[e.u]] == e.v_vals[choice[e.v]] for e in cg.edges)


def solve_exhaustive(cg: CostGraph, *, budget_bytes: float | None, checkpoint: bool = True,
                     limit: int = 2_000_000) -> Solution:
    """Enumerate every strategy choice, checkpoint count, variant count and selective-policy count (test oracle
    for tiny graphs). Raises PlanError when the space exceeds `limit` combinations."""
    t0 = time.perf_counter()
    sizes = [len(u.costs) for u in cg.units]
    ck_ranges = [range(info.count + 1) if checkpoint else range(1) for info in cg.templates.values()]
    keys = list(variants.variants_of(cg))
    var_ranges = [range(v.most + 1) for v in variants.variants_of(cg).values()]
    pkeys = policies.offered(cg)
    pol_ranges = [range(cg.templates[t].count + 1) if checkpoint else range(1) for t, _ in pkeys]
    space = math.prod(sizes) * math.prod(len(r) for r in ck_ranges + var_ranges + pol_ranges)
    if space > limit:
        raise PlanError(f"solve_exhaustive: {space} combinations exceed the limit {limit}")
    best: Solution | None = None
    tids = list(cg.templates)
    for choice in itertools.product(*[range(n) for n in sizes]):
        if not all(cg.units[u].allowed[k] for u, k in enumerate(choice)):
            continue
        if not feasible_choice(cg, list(choice)):
            continue
        for cks, ws, ps in itertools.product(itertools.product(*ck_ranges), itertools.product(*var_ranges),
                                             itertools.product(*pol_ranges)):
            ckpt, counts, pol = dict(zip(tids, cks)), dict(zip(keys, ws)), dict(zip(pkeys, ps))
            if any(ckpt[t] + sum(n for (t2, _), n in pol.items() if t2 == t) > cg.templates[t].count for t in tids):
                continue
            if any(counts[key] and any(choice[u] == k for u, k in v.excludes)
                   for key, v in variants.variants_of(cg).items()):
                continue
            step, peak, terms = evaluate(cg, list(choice), ckpt, counts, pol)
            if budget_bytes is not None and peak > budget_bytes * (1 + 1e-9):
                continue
            if best is None or step < best.step_s - 1e-15:
                best = Solution(list(choice), ckpt, step, peak, "optimal", 0.0, 0.0, terms=terms, variants=counts,
                                policies=pol)
    if best is None:
        return Solution([], {}, math.inf, math.inf, "infeasible", math.inf, time.perf_counter() - t0)
    best.solve_s = time.perf_counter() - t0
    return best
