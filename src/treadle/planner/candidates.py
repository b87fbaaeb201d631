"""Which role assignments the search solves and prices, beyond enumerating them (`roles.py`): a pipeline only on the
slowest link, a cutoff from the best plan found, and the candidates priced of each kind; and the cyclic collector
paused while a search runs."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

from ..cost.cluster import ClusterSpec
from ..form import forms
from .roles import Roles


# NOTE [a cutoff from the best plan found]: a role assignment whose own solve states the step's formula (a
# pipeline's MILPs, one per schedule and cut: NOTE [pipeline in the plan]) is asked only for plans faster than what
# the search must keep anyway: with `price_top` 0 the best plan found so far of any kind, with K >= 1 the K-th best
# of its own kind (the K best of each kind are priced: NOTE [pipelined against unpipelined]); inside it, each cut's
# MILP also below its best cut so far. The cutoff is one row (objective <= cutoff, the step's constants left out, so
# it never removes a faster plan); HiGHS then proves most MILPs infeasible from their relaxation. A role assignment
# with no plan below its cutoff is "pruned": it could not change the choice, and is listed in
# `plan.solver["pruned"]` instead of the alternatives. The searches without a pipeline run first, so the cutoff
# starts low. Not exact on one path: when a budget is given and none of the K priced plans fits as built, the next
# ones tried are the solved alternatives, not the pruned ones.
def cutoff_for(steps: dict[bool, list[float]], kind: bool, price_top: int) -> float | None:
    """The step a role assignment of `kind` (pipelined or not) must beat, from the feasible `steps` found so far by
    kind; None while fewer than the plans the search keeps are found."""
    found = sorted(steps[False] + steps[True]) if price_top <= 0 else sorted(steps[kind])
    k = max(price_top, 1)
    return found[k - 1] if len(found) >= k else None


# NOTE [pipelines on the slowest link]: a pipeline sends one activation (and its gradient) per micro-batch across
# each stage boundary, far less than the tensor axes' collectives or the data-parallel gradient sync, which is why
# every published recipe puts pp on the links between nodes. With `pp_axis="auto"` the search weighs a pipeline
# only over an axis whose link is among the slowest of the live axes (every axis on one node of equal links); a
# pinned pp axis is planned wherever it is.
def pipeline_on_slowest_link(cluster: ClusterSpec, roles: Roles) -> bool:
    if roles.pp is None:
        return True
    live = [a for a in cluster.mesh.names if cluster.mesh.size(a) > 1 and a not in roles.off]

    def rate(a: str) -> float:
        link = cluster.link(a)
        return link.bandwidth_bytes_per_s * link.efficiency

    return rate(roles.pp) <= min(rate(a) for a in live) * (1 + 1e-9)


# NOTE [pipelined against unpipelined]: a pipeline role assignment is solved by the pipeline form's own MILP (its
# stages' timeline: NOTE [pipeline in the plan]), the others by the sum over ops; the two linear models err
# differently against the plan as built, so their estimates rank a pipelined plan against an unpipelined one less
# well than each ranks its own kind. With `price_top` K >= 1, where both kinds are feasible, the K best of each kind
# are priced as built (`treadle.price`) and the price decides (NOTE [final choice by price]); with K = 0 the
# solver's choice stands, unpriced.
def priced_candidates(feasible: list, price_top: int) -> list:
    """The candidates to price, best first by the solver: the `price_top` best of each kind, pipelined and
    unpipelined (NOTE [pipelined against unpipelined]), with and without float8 (the solver does not weigh it:
    NOTE [execution and float8 in the plan]); none for `price_top` 0."""
    if price_top <= 0:
        return []
    kinds: dict[tuple, list] = {}  # pipelined or not, float8 or not (NOTE [execution and float8 in the plan])
    for sc in feasible:
        kinds.setdefault((sc[1].roles.pp is not None, sc[1].roles.float8), []).append(sc)
    keep = {id(sc) for group in kinds.values() for sc in group[:price_top]}
    return [sc for sc in feasible if id(sc) in keep]


# NOTE [each schedule priced on its own]: a role assignment whose form owns the step's formula (a pipeline) is
# solved over several ways of running it (the schedule kinds) by one linear model, and the final choice by price
# saw only the way that model ranked first. Under a budget that is not enough: the linear memory model errs
# differently on each way, and the re-solve that corrects a candidate's budget by its price's error (NOTE [final
# choice by price]) then corrects one kind's budget by another kind's error. Measured (tiny LLaMA, PP2 x TP2 at 0.6x
# the free peak, this host's calibration): the solver's 1F1B plan over 2 micro-batches 1.07x its priced peak,
# its interleaved 1F1B plan 1.00x; the free search priced interleaved 1F1B plans only (its 1F1B plan did not fit
# the solver's budget), 1.07x the price of the 1F1B plan that pinning 1F1B found, and measured 1.18x it. So each
# candidate is split into its ways (`Form.price_variants`): its own with its solution, the others solved once the
# candidates are priced, every one re-solved by its own price's error. A way the solver did not rank first is solved
# and priced only where it could win: where VARIANT_BAND times its solver step is below the fastest priced plan that
# fits (its solve's cutoff; the pipeline's price has measured down to 0.81x its solver step on the bench's rows).
VARIANT_BAND = 0.75


def price_variants(candidates: list) -> tuple[list, list, dict]:
    """Split each (solution, cost graph) of `candidates` into its ways (NOTE [each schedule priced on its own]):
    returns (the candidates with their own way pinned, the cost graphs of the other ways, each way's cost graph by
    id -> its candidate's). Candidates no form splits are kept as they are."""
    own, others, home = [], [], {}
    for sol, cg in candidates:
        ways = [w for f in forms() for w in f.price_variants(cg, sol)]
        if not ways:
            own.append((sol, cg))
        for cg_k, is_own in ways:
            home[id(cg_k)] = cg
            if is_own:
                own.append((sol, cg_k))
            else:
                others.append(cg_k)
    return own, others, home


# NOTE [the collector paused while planning]: a search builds hundreds of thousands of long-lived objects (cost
# graphs, MILP rows, rehearsed ops), and CPython's cyclic collector traverses every tracked object at each full
# collection, many times over a search: 9 s of 64 s planning Llama-3.1-405B on 512 H100 (measured with the
# collector off: 55 s, the same plan; peak resident memory 779 MB with it, 822 MB without, since little of
# what a search drops is cyclic). `plan_model` therefore pauses it, and restores it as it was when it returns
# or raises; reference counting still frees everything else as it goes. Nothing a plan reads depends on it.
@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
