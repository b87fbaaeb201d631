"""The pipeline MILP's test oracle: every strategy choice and per-stage checkpoint count of one cut, evaluated by the
MILP's own `evaluate` (tiny graphs only)."""

from __future__ import annotations

import itertools
import math

from ...errors import PlanError
from ...planner.ilp import Solution
from ...planner.policies import offered
from .cuts import _cut, _layout
from .milp import _choice_of, _scalars, evaluate


def solve_exhaustive(cg, stages, *, budget_bytes: float | None, schedule: str = "1f1b",
                     limit: int = 2_000_000) -> Solution:
    """Every strategy choice and per-stage checkpoint count (and selective policy count, where offered) of one cut
    under `schedule`, evaluated directly (the MILP's test oracle on tiny graphs). Raises PlanError when the space
    exceeds `limit`."""
    from ...planner.ilp import feasible_choice

    lay = _layout(cg, schedule)
    cut = _cut(cg, lay, stages)
    keys = [(t, st) for st in range(lay.n_stages) for t, n_t in cut.n[st].items()]
    pols = [(t, st, p_) for t, st in keys for t2, p_ in offered(cg, stages=True) if t2 == t]
    keys_all = keys + pols
    ranges = [range(cut.n[k[1]][k[0]] + 1) for k in keys_all]
    sizes = [len(u.costs) for u in cg.units]
    space = math.prod(sizes) * math.prod(len(r) for r in ranges)
    if space > limit:
        raise PlanError(f"solve_exhaustive: {space} combinations exceed the limit {limit}")
    best: Solution | None = None
    for choice in itertools.product(*[range(n) for n in sizes]):
        if not all(cg.units[u].allowed[k] for u, k in enumerate(choice)) or not feasible_choice(cg, list(choice)):
            continue
        for cs in itertools.product(*ranges):
            counts = dict(zip(keys, cs[:len(keys)]))
            pcounts = {k: n for k, n in zip(pols, cs[len(keys):]) if n}
            if any(counts[t, st] + sum(n for (t2, st2, _), n in pcounts.items() if (t2, st2) == (t, st))
                   > cut.n[st][t] for t, st in keys):
                continue
            step, peak, terms = evaluate(cg, lay, cut, list(choice), counts, pcounts)
            if budget_bytes is not None and peak > budget_bytes * (1 + 1e-9):
                continue
            if best is None or step < best.step_s - 1e-15:
                best = Solution(list(choice), {}, step, peak, "optimal", 0.0, 0.0, terms=_scalars(terms),
                                stages=_choice_of(cg, lay, cut, counts, terms, pcounts))
    return best or Solution([], {}, math.inf, math.inf, "infeasible", math.inf, 0.0)
