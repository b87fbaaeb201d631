"""A pp rank's memory at each moment of its step, as the pipeline's price walks it (NOTE [a rank's memory at each
moment]): the moments (`rank_moments`), a unit strategy's bytes by when they are held (`unit_bytes`), a moment's
bytes (`moment_bytes`), and the MILP's rows of them (`memory_rows`).

NOTE [a rank's memory at each moment]: the price walks each rank's actions (NOTE [a stage's gradients at its peak]
in `price.py`) and holds, beside the parameters and optimizer state: the activations of the micro-batches in flight;
the gradients of the stages that have run a backward (a stage's accumulate from its first backward to the step's
end, so none exist at the warm-up's end, where the activations peak); under ZeRO-3 with reshard after forward the
stages FSDP2 holds gathered while the action runs (NOTE [pipeline FSDP2]), and then each gradient whole. The planner
states the same moments: at each action the micro-batches in flight on each stage (after a forward, before a
backward frees them; a split backward's I keeps its output gradients to W: NOTE [a split backward's memory]); the
stages whose gradients exist (a stage's from its first B, made while that micro-batch is still held: NOTE [a
stage's gradients at its first backward]; or from the end of its first W, as the price counts them); the stages
gathered while it runs; whether a backward (B or I) runs then, which holds the rank's transient beside the rest (the
price adds a backward's working set there only); and at the step's end every gradient. A moment that another
covers (as many micro-batches on each stage, the gradients and the gathered stages of it and more) is left out:
every term is non-negative. The rows before held every stage's gradients, and under ZeRO-3 every stage gathered
and its gradients whole, at every moment: Llama-3-8B on 2 x 8 H100 pipelined over the nodes with ZeRO-3 over the tensor axis (27.4 GiB), 34.8 GiB by
the MILP against 27.1 priced (now 27.1); and they missed what a split backward keeps from I to W (GPT-2-XL on 1 x 8
H100, interleaved_zb over 16 micro-batches: 0.85x the price; 1.00x with NOTE [a tied parameter on two ranks]).
Left out as the rows were before: the replicas' flattened bucket of the step's end (the price's, at most about one
bucket); the transient term is the rank's largest (the price's, the stage's own at its backward).

NOTE [a stage's gradients at its first backward]: while a stage's first backward runs, its micro-batch's saved
activations are freed and its gradients made, unit by unit in reverse order; the price rehearses that order. The
rows hold the stage's gradients whole beside the whole micro-batch at its first B: an upper bound of every point of
it (tiny LLaMA 1F1B over 2 micro-batches: the first rank 1.106x its price). Tried and left out (2026-12-07): holding
them from the B's end only (the two ends of a backward that frees as much as it makes), with each block node's
working set measured over its own block's frees (the capture's is over the whole model's, which the later blocks'
frees hide: 0 for every tiny LLaMA block, so a rank without the loss is about 5% under its price). Every tiny LLaMA
pipelined rank then read 0.989-1.005x its price, but a tiny Mixtral's under ZeRO-3 beside a pipeline 0.88x (its
experts' whole gradients are made before its small activations are freed): not a bound. The exact term is a stage's
first-backward excess per block template, its gradients made less its activations freed at each unit of the block,
e + (n - 1) max(0, G - A) over a stage's n blocks, measured by the capture with the gradients counted, with the
checkpointed blocks' kept inputs and the head's and tail's units on their stages.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .facts import action_order
from .fsdp import fsdp_states


@dataclass(frozen=True, slots=True)
class Moment:
    """A point of a rank's step: micro-batches in flight per stage (`act`: (stage, count) pairs), the stages whose
    gradients exist (`grads`), the stages FSDP2 holds gathered (`gathered`), the micro-batches between a split
    backward's I and W per stage (`waiting`), and whether a backward (B or I) runs then, with its transient bytes
    (`backward`)."""

    act: tuple[tuple[int, int], ...]
    grads: frozenset[int]
    gathered: frozenset[int]
    waiting: tuple[tuple[int, int], ...] = ()
    backward: bool = False

    def covers(self, other: "Moment") -> bool:
        """Whether this moment holds at least what `other` holds, every term alike."""
        mine, wait = dict(self.act), dict(self.waiting)
        return (self.grads >= other.grads and self.gathered >= other.gathered
                and (self.backward or not other.backward)
                and all(mine.get(s, 0) >= k for s, k in other.act)
                and all(wait.get(s, 0) >= k for s, k in other.waiting))


def tracks_gathered(cg) -> bool:
    """Whether a cost graph's ranks hold their stages gathered only while FSDP2 keeps them so: ZeRO-3 over more than
    one rank with reshard after forward (`zero.zero_terms`'s `reshard`); else nothing is gathered, or it stays so."""
    roles = cg.roles
    return bool(roles.zero and roles.reshard_after_forward
                and math.prod(cg.cluster.mesh.size(a) for a in roles.shard_axes) > 1)


def rank_moments(lay, gathered: bool) -> dict[int, tuple[Moment, ...]]:
    """Rank -> its undominated moments (NOTE [a rank's memory at each moment]) of `lay`'s schedule; `gathered`: the
    stages FSDP2 holds gathered are tracked (ZeRO-3 with reshard after forward), else none is."""
    return _moments(lay.schedule, lay.n_stages, lay.p, lay.m, gathered)


@functools.lru_cache(maxsize=256)
def _moments(schedule: str, n_stages: int, p: int, m: int, gathered: bool) -> dict[int, tuple[Moment, ...]]:
    """`rank_moments` of a schedule's shape (a function of its integers and torch's order: remembered per process)."""
    order = action_order(schedule, n_stages, p, m)
    states = fsdp_states(schedule, order, True) if gathered else None
    out = {}
    for r, acts in order.items():
        cur: dict[int, int] = {}
        wait: dict[int, int] = {}
        done: set[int] = set()
        seen: list[Moment] = []
        for i, a in enumerate(acts):
            if a.kind == "F":
                cur[a.stage] = cur.get(a.stage, 0) + 1
            elif a.kind == "I":  # the graph is kept for W, with the output gradients W reads
                wait[a.stage] = wait.get(a.stage, 0) + 1
            elif a.kind == "B":  # its gradients are made while its micro-batch is still held (the price's
                done.add(a.stage)  # transient of a backward; a W's, as the price counts it, from its end on)
            held = states[r].held[i] if states is not None else frozenset()
            seen.append(Moment(_counts(cur), frozenset(done), held, _counts(wait), a.kind in ("B", "I")))
            if a.kind in ("B", "W"):  # NOTE [a split backward's memory] in price.py: W frees the stage's graph
                cur[a.stage] = cur.get(a.stage, 0) - 1
            if a.kind == "W":
                wait[a.stage] = wait.get(a.stage, 0) - 1
                done.add(a.stage)
        seen.append(Moment(_counts(cur), frozenset(done), frozenset(), _counts(wait)))  # the step's end
        out[r] = _undominated(list(dict.fromkeys(seen)))  # each distinct moment once, in order of occurrence
    return out


def _undominated(unique: list[Moment]) -> tuple[Moment, ...]:
    """The moments no other covers (`Moment.covers`), in their order: each moment a vector (micro-batches in flight
    and waiting per stage, whether its gradients exist and whether it is gathered), compared at once (a rank of an
    interleaved schedule over 32 micro-batches has hundreds of moments); whether a backward runs is one more
    entry."""
    if len(unique) < 2:
        return tuple(unique)
    stages = sorted({s for mo in unique for s, _ in mo.act + mo.waiting}.union(
        *(mo.grads | mo.gathered for mo in unique)))
    col, d = {s: i for i, s in enumerate(stages)}, len(stages)
    vec = np.zeros((len(unique), 4 * d + 1), dtype=np.int64)
    for i, mo in enumerate(unique):
        for s, k in mo.act:
            vec[i, col[s]] = k
        for s, k in mo.waiting:
            vec[i, d + col[s]] = k
        for s in mo.grads:
            vec[i, 2 * d + col[s]] = 1
        for s in mo.gathered:
            vec[i, 3 * d + col[s]] = 1
        vec[i, 4 * d] = mo.backward
    # distinct moments are distinct vectors: another that is at least as large everywhere covers it
    return tuple(mo for i, mo in enumerate(unique) if np.count_nonzero((vec >= vec[i]).all(axis=1)) == 1)


def _counts(cur: dict[int, int]) -> tuple[tuple[int, int], ...]:
    return tuple(sorted((s, k) for s, k in cur.items() if k > 0))


def unit_bytes(c, zt, u: int, k: int) -> tuple[float, float, float]:
    """(always held, held from its stage's first backward, held while its stage is gathered) bytes of unit u's
    strategy k (`c`: its StrategyCost; `zt`: the ZeRO-3 terms or None): its parameters and optimizer state (the
    shard), its gradients (whole under ZeRO-3), its gathered parameters (NOTE [pipeline FSDP2 in the plan])."""
    grads = c.static_grad_bytes + (zt.held_grads(u, k) if zt is not None else 0.0)
    return c.static_bytes - c.static_grad_bytes, grads, zt.held_gathered(u, k) if zt is not None else 0.0


def moment_bytes(mo: Moment, act: list[float], grads: list[float], gathered: list[float],
                 waiting: list[float] | None = None) -> tuple[float, float]:
    """(activations, gradients and gathered parameters) a moment holds, per stage's bytes (`waiting`: what a split
    backward keeps from I to W a micro-batch, counted with the activations; None: nothing)."""
    kept = math.fsum(k * waiting[s] for s, k in mo.waiting) if waiting is not None else 0.0
    return (math.fsum(k * act[s] for s, k in mo.act) + kept,
            math.fsum(grads[s] for s in mo.grads) + math.fsum(gathered[s] for s in mo.gathered))


# NOTE [a stage's memory as variables]: a rank's memory is stated at every undominated moment of its schedule
# (`rank_moments`), each row reading its stages' bytes. Written out, each of those rows repeats every strategy
# variable of the rank's stages (405B on 512 H100: about 200k matrix entries a cut, most of the MILP's build and
# solve). Each stage's always-held bytes, its activations, its gradients and its gathered parameters are therefore
# one variable each, defined once by an equality row ("stage_expr", unbounded: an exact substitution, as `as_var`
# does for a block's expressions) and read by every moment: the same MILP, with far fewer matrix entries.
def stage_var(m, expr: dict[int, float]) -> dict[int, float]:
    if len(expr) <= 1:
        return expr
    e = m.var(lb=-math.inf, ub=math.inf)
    m.row({e: 1.0, **{j: -x for j, x in expr.items()}}, 0.0, 0.0, "stage_expr")
    return {e: 1.0}


def memory_rows(m, lay, moments, static, act, grads, gathered, waiting, trans) -> list[dict[int, float]]:
    """Each rank's row at each of its moments (NOTE [a rank's memory at each moment]), in the MILP's scaled bytes:
    its stages' always-held bytes, the micro-batches in flight times their stages' saved bytes (and those between a
    split backward's I and W times what it keeps), the gradients and gathered parameters the moment holds, and at a
    backward's moments the rank's transient variable (`trans[r]`); per stage expressions ({var: coefficient}), each
    stated once where a row reads it (NOTE [a stage's memory as variables])."""
    exprs = {"static": static, "act": act, "grads": grads, "gathered": gathered, "waiting": waiting}
    made: dict[tuple[str, int], dict[int, float]] = {}

    def part(name: str, st: int) -> dict[int, float]:
        if (name, st) not in made:
            made[name, st] = stage_var(m, exprs[name][st])
        return made[name, st]

    rows = []
    for r, mine in enumerate(lay.ranks()):
        base: dict[int, float] = {}
        for st in mine:
            _add(base, part("static", st), 1.0)
        for mo in moments[r]:
            row = dict(base)
            if mo.backward:  # a backward's transient (the price's, at B and I)
                _add(row, {trans[r]: 1.0}, 1.0)
            for name, items in (("act", mo.act), ("waiting", mo.waiting),
                                ("grads", ((st, 1) for st in sorted(mo.grads))),
                                ("gathered", ((st, 1) for st in sorted(mo.gathered)))):
                for st, k_ in items:
                    _add(row, part(name, st), k_)
            rows.append(row)
    return rows


def _add(row: dict[int, float], expr: dict[int, float], w: float) -> None:
    for j, x in expr.items():
        row[j] = row.get(j, 0.0) + w * x


# NOTE [a tied parameter on two ranks]: a parameter both the first and the last stage read (GPT-2's embedding and
# head) is held by both stages' ranks as build places it (the price counts it on each: its parameters and optimizer
# state, and its gradient from the stage's first backward); the cost graph states it once, on its owner (the first
# consumer, on the first stage). The last stage's rank, where it is another rank, holds the owner's strategy's copy
# too: GPT-2-XL on 1 x 8 H100, interleaved_zb over 16 micro-batches, the last rank's rows were 1.05 GiB under its
# price without it (a bf16 embedding of 50257 x 1600 with its fp32 master and AdamW states).
def tied_terms(b, cg) -> None:
    """Per unit strategy the (always-held, gradient) bytes of the parameters it owns that the last stage reads too
    (NOTE [a tied parameter on two ranks]), into `cg.form_terms["pipeline"]["tied"]` (unit -> per strategy);
    nothing without a pp axis or such a parameter. `b`: the cost graph's builder (`NodeCosts`)."""
    if cg.roles.pp is None:
        return
    tied = tied_params(cg)
    if not tied:
        return
    out: dict[int, list[tuple[float, float]]] = {}
    for u, unit in enumerate(cg.units):
        per = []
        for members in unit.strategies:
            base = grads = 0.0
            for i, (combo, _) in members.items():
                for src, pl in b.owned_params(b.nodes[i], combo):
                    if src.param in tied:
                        own = b.own_split.get(src.param)
                        g = b.param_grad_static_bytes(src.out, pl, own)
                        base += b.owned_static_bytes(src, pl) - g
                        grads += g * (b.param_divisor if own is None else 1)  # whole under ZeRO-3 (FSDP2's)
            per.append((base, grads))
        if any(x != (0.0, 0.0) for x in per):
            out[u] = per
    cg.form_terms.setdefault("pipeline", {})["tied"] = out


def tied_params(cg) -> set[str]:
    """The parameters both the first and the last stage read: read by a unit before the blocks (the first stage's,
    as `cuts._layout` places them) and by one after them (the last stage's)."""
    first = cg.graph.first_block_op() or 0
    in_template = {u for info in cg.templates.values() for u in info.units}
    unit_of = {i: u for u, unit in enumerate(cg.units) for i in unit.nodes}
    side = {u: unit.leader < first for u, unit in enumerate(cg.units) if u not in in_template}  # True: the head
    return {n.param for n in cg.graph.nodes if n.kind == "param"
            and {side.get(unit_of.get(x)) for x in n.users} >= {True, False}}


def tied_on_last(cg, lay, cut) -> dict[int, list[tuple[float, float]]]:
    """The owners' tied bytes (`tied_terms`) the last stage's rank holds besides: those whose owner runs on another
    rank (none where one rank runs both, as the V schedules place them)."""
    tied = (cg.form_terms.get("pipeline") or {}).get("tied") or {}
    last = lay.rank(lay.n_stages - 1)
    return {u: per for u, per in tied.items() if all(lay.rank(st) != last for st, _ in cut.mult.get(u, ()))}
