"""NOTE [final choice by price]: the solver's best plans, priced as built (`treadle.pricing.price`), the fastest that
fits the budget chosen, each re-solved with its budget corrected by the price's error where it misses."""

from __future__ import annotations

import logging
import math
from typing import Callable

from torch import nn

from ..errors import PlanError
from ..profile.fake_gaps import copy_model
from ..schedule.core import create_schedule
from .capabilities import runtime_capabilities
from .cost_graph import CostGraph
from .ilp import Solution
from .to_schedule import apply_decisions, decisions_from_solution

logger = logging.getLogger(__name__)


PRICE_RESOLVES = 4  # NOTE [final choice by price]: re-solves of a candidate whose priced peak misses the budget
PRICE_SLACK = 0.02  # a priced peak this close under the budget (fraction of it) is not re-solved


def resolve_by_price(sol: Solution, p, cg: CostGraph, budget: float, solve_for, price_of) -> list:
    """[(solution, price)] of one role assignment, re-solved until its priced peak is within PRICE_SLACK under
    `budget` (NOTE [final choice by price]). The solver's budget moves by the price's error,
    ``solver peak + (budget - priced peak)``; once a solver budget whose plan fits (lo) and one whose plan does
    not (hi) are known, a proposal outside (lo, hi) bisects it instead; an infeasible solver budget (floor)
    stands in for lo until one fits. Plans seen before are not priced again."""
    key = lambda s_: (tuple(s_.choice), tuple(sorted(s_.ckpt.items())), s_.stages,  # noqa: E731
                      tuple(sorted(s_.variants.items())), tuple(sorted(s_.policies.items())))
    seen = {key(sol): p}
    tried = [(sol, p)]
    lo, hi, floor, target = -math.inf, math.inf, 0.0, budget  # floor: the largest solver budget found infeasible
    for _ in range(PRICE_RESOLVES):
        if target is not None:  # (None: the last proposal was infeasible; `p` is still the older plan's)
            if p.peak_bytes <= budget:
                lo = max(lo, target)
            else:
                hi = min(hi, target)
        slack = budget - p.peak_bytes
        if 0 <= slack <= PRICE_SLACK * budget:
            break
        proposal = sol.peak_bytes + slack
        below = lo if not math.isinf(lo) else floor
        if not max(lo, floor) < proposal < hi:
            if (math.isinf(lo) and not floor) or math.isinf(hi) or hi - below <= PRICE_SLACK * budget:
                break
            proposal = (below + hi) / 2
        target = proposal
        again = solve_for(cg, target) if target > 0 else None
        logger.debug("re-solve %s at solver budget %.0f B (priced %.0f B against %.0f B): %s", cg.roles, target,
                     p.peak_bytes, budget, "infeasible" if again is None or again.status == "infeasible"
                     else f"solver peak {again.peak_bytes:.0f} B")
        if again is None or again.status == "infeasible":
            floor, target = max(floor, proposal), None  # too small for the solver: bisect above it
            continue
        if key(again) in seen:
            sol, p = again, seen[key(again)]
            continue
        try:
            p = price_of(again, cg)
        except PlanError as exc:
            logger.info("price of %s (re-solved) failed: %s", cg.roles, exc)
            break
        sol = again
        seen[key(sol)] = p
        tried.append((sol, p))
    return tried


def choose_by_price(model: nn.Module, inputs: dict, candidates: list[tuple[Solution, CostGraph]],
                     is_leaf_param: Callable[[str], bool], budget: float | None, loss_fn,
                     solve_for: Callable[[CostGraph, float | None], Solution] | None = None, execution: str = "eager",
                     variants: list[CostGraph] = (),
                     solve_variant: Callable[[CostGraph, float | None], Solution] | None = None,
                     variant_band: float = 1.0):
    """NOTE [final choice by price]: the solver's cost graph is linear and per-op; `price` runs the built schedule.
    Each candidate (best plan of one role assignment) is turned into its schedule on a copy of `model` and
    priced; the fastest whose priced peak fits `budget` wins (none fits: the solver's best and no price; `plan_model`
    then prices the other role assignments, and raises PlanError when none fits).
    A candidate whose priced peak misses the budget — over it, or under it by more than PRICE_SLACK — is solved
    again (`solve_for`, at most PRICE_RESOLVES times) with the solver's budget moved by the difference,
    ``solver peak + (budget - priced peak)``: the linear memory model's error on that role assignment, measured
    by the price, corrects its budget (over: less memory, so the plan fits as built; under: more, so it
    checkpoints no more than the budget needs), bisecting between a solver budget that fit and one that did not
    once both are known (`resolve_by_price`; a solver budget found infeasible bounds the bisection from below).
    Each new plan is priced; the fastest that fits is the candidate's plan. `variants` (the cost graphs of other ways
    of running a candidate's role assignment, NOTE [each schedule priced on its own]) are solved after the
    candidates are priced (`solve_variant(cost graph, cutoff)`, the cutoff the fastest price that fits over
    `variant_band`: only plans that could win), then priced fastest first, each only where `variant_band` times its
    solver step is still below the fastest price that fits.
    Returns (solution, cost graph, its price dict, [{roles, mesh, solver_step_s, step_s, solver_peak_bytes,
    peak_bytes, resolves}])."""
    from .. import pricing
    from ..profile.profiler import model_flops

    useful = float(model_flops(model, dict(inputs), loss_fn=loss_fn))  # every candidate's (the same model)

    def price_of(sol: Solution, cg: CostGraph):
        m = copy_model(model)  # fake tensors: copied without torch's data_ptr warning
        _, is_leaf_module = runtime_capabilities(m)
        decisions = decisions_from_solution(cg, sol.choice, sol.ckpt, leaf_param=is_leaf_param, stages=sol.stages,
                                            variants=sol.variants, policies=sol.policies)
        sch = apply_decisions(create_schedule(m, mesh=cg.cluster.mesh), decisions, leaf_module=is_leaf_module)
        return pricing.price(sch, inputs, cg.cluster, loss_fn=loss_fn, execution=execution, useful_flops=useful)

    rows, best = [], None

    def consider(sol: Solution, cg: CostGraph) -> None:
        nonlocal best
        try:
            p = price_of(sol, cg)
        except PlanError as exc:
            logger.info("price of %s failed: %s", cg.roles, exc)
            return
        tried = [(sol, p)]
        if budget is not None and solve_for is not None:
            tried = resolve_by_price(sol, p, cg, budget, solve_for, price_of)
        fitting = [(s_, p_) for s_, p_ in tried if budget is None or p_.peak_bytes <= budget]
        sol, p = min(fitting, key=lambda sp: sp[1].step_s) if fitting else tried[-1]
        rows.append({"mesh": str(cg.cluster.mesh), "roles": str(cg.roles), "solver_step_s": sol.step_s,
                     "step_s": p.step_s, "solver_peak_bytes": sol.peak_bytes, "peak_bytes": p.peak_bytes,
                     "resolves": len(tried) - 1})
        fits = budget is None or p.peak_bytes <= budget
        if fits and (best is None or p.step_s < best[2].step_s):
            best = (sol, cg, p)

    for sol, cg in candidates:
        consider(sol, cg)
    if variants and solve_variant is not None:  # NOTE [each schedule priced on its own]
        solved = []
        for cg in variants:
            sol = solve_variant(cg, None if best is None else best[2].step_s / variant_band)
            if sol.status in ("infeasible", "pruned"):
                logger.info("%s: %s (no plan could beat the best price over %.2f)", cg.roles, sol.status, variant_band)
            else:
                solved.append((sol, cg))
        for sol, cg in sorted(solved, key=lambda sc: sc[0].step_s):
            if best is not None and variant_band * sol.step_s >= best[2].step_s:
                logger.info("%s: not priced (solver step %.4g s; %.2fx of it above the best price %.4g s)", cg.roles,
                            sol.step_s, variant_band, best[2].step_s)
                continue
            consider(sol, cg)
    if best is None:  # no candidate fits by its price: the solver's own choice (its memory model binds)
        sol, cg = candidates[0]
        return sol, cg, None, rows
    return best[0], best[1], best[2].to_dict(), rows
