"""What a picture of a predicted step is drawn from: per-module costs by phase and by mesh axis (plain data).

`StepCosts` is the adapter between a priced schedule and the timeline (`timeline.py`): anything that can
say, per module, how long its forward, backward and recomputation take and which collectives it runs on
which mesh axis (and how much of each is hidden behind compute) can be drawn. `costs_from_plan` reads a
`treadle.planner.Plan` through its public fields only (rows, estimate, decisions, solver, cluster, roles);
a pricing function with an exact per-phase breakdown can fill the same classes.

NOTE [plan attribution]: a Plan row gives one compute, one communication and one recomputation total per
module. `costs_from_plan` splits them by these documented rules, which the slices' args repeat:
  * compute: forward 1/3, backward 2/3 — the planner's own ratio for an op whose inputs need a gradient
    (backward FLOPs and bytes are twice the forward's, `treadle.planner.node_costs`);
  * communication: a module whose layout is replicated on every tensor axis, and whose decisions change no
    layout there, can only communicate on the data-parallel axis (its gradient reduction; ZeRO-3 gathers and
    reduce-scatter): all of it goes to the backward. A module sharded on tensor axes (or changing a layout at
    its exit) communicates on those axes and, under data parallelism, on the
    data-parallel axis too; the row does not split these, so the slice sits on one stream named by every
    axis involved (e.g. "dp+tp"), half in the forward and half in the backward (Megatron's f/g pair);
  * overlap: the estimate's communication is its exposed part; when the rows' communication adds up to
    more (the solver hides part of the data-parallel sync behind the backward), every collective is drawn
    exposed by the same fraction, estimate / rows; otherwise nothing is overlapped.
The totals (compute, exposed communication, recomputation, step time) are exactly the estimate's.
This is the fallback for plans without a price (`Plan.price`): `timeline_from_plan` draws a priced plan
from its price (`treadle.viz.price_timeline`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

Phase = Literal["forward", "backward"]
BACKWARD_PER_FORWARD = 2.0  # see NOTE [plan attribution]

PLAN_ATTRIBUTION = ("plan rows give one total per module; forward:backward compute 1:2, tensor-axis "
                    "communication split evenly over forward and backward, data-parallel communication in "
                    "backward, nothing overlapped (see treadle.viz.costs NOTE [plan attribution])")


@dataclass(frozen=True, slots=True)
class CommCost:
    """One module's communication on one stream: `axes` (mesh axis names; several when the source cannot
    split them), `phase`, `seconds` in total over the module's `count` executions, `exposed_s` of those
    on the critical path (the rest runs in parallel with compute), and `collectives`: what runs, in words
    (e.g. "all-gather over tp (S(2) -> R at the exit)")."""

    axes: tuple[str, ...]
    phase: Phase
    seconds: float
    exposed_s: float
    collectives: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.seconds < 0 or not 0 <= self.exposed_s <= self.seconds * (1 + 1e-9) + 1e-15:
            raise ValueError(f"CommCost needs 0 <= exposed_s <= seconds; got {self!r}")

    @property
    def stream(self) -> str:
        """Track name: 'comm dp', 'comm dp+tp', or 'comm' when no axis is known."""
        return "comm " + "+".join(self.axes) if self.axes else "comm"


@dataclass(slots=True)
class ModuleCosts:
    """One module (or one module of a repeated block, standing for `count` executions): seconds in total
    over all executions. `block` names the repeated block it belongs to (None outside blocks);
    `recomputed` is how many of the `count` executions are recomputed in backward. `args` go to every slice."""

    path: str
    count: int
    forward_s: float
    backward_s: float
    recompute_s: float
    comm: list[CommCost] = field(default_factory=list)
    block: str | None = None
    recomputed: int = 0
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def comm_s(self) -> float:
        return sum(c.seconds for c in self.comm)


@dataclass(slots=True)
class MemoryTotals:
    """Per-device bytes at the peak by category, and the budget (None: unlimited).

    static: parameters + gradients + optimizer states; other: buffers and inputs (what no decision changes);
    activations: saved for backward at the end of the forward; transient: the recomputed block's
    activations while it is recomputed and back-propagated."""

    static_bytes: float
    other_bytes: float
    activation_bytes: float
    transient_bytes: float
    budget_bytes: float | None

    @property
    def peak_bytes(self) -> float:
        return self.static_bytes + self.other_bytes + self.activation_bytes + self.transient_bytes


@dataclass(slots=True)
class StepCosts:
    """A priced step: modules in forward order, the predicted step time and its split, memory, and where it
    runs. `axes` lists the comm streams in display order; `notes` say how the figures were attributed."""

    title: str
    modules: list[ModuleCosts]
    step_s: float
    compute_s: float
    comm_s: float
    recompute_s: float
    memory: MemoryTotals
    world_size: int
    streams: list[str]
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- from a Plan
_TOKEN = re.compile(r"(\S+?):(\S+)")


def layout_tokens(layout: str) -> list[tuple[str, list[str]]]:
    """'weight:S(1),R out:R,R' -> [('weight', ['S(1)', 'R']), ('out', ['R', 'R'])] (one placement per tensor
    axis, in the order of the plan's tensor axes). Text that is not NAME:PLACEMENTS is skipped."""
    out = []
    for m in _TOKEN.finditer(layout):
        out.append((m.group(1), m.group(2).split(",")))
    return out


def plan_axes(plan) -> tuple[str | None, bool, tuple[str, ...]]:
    """(data-parallel axes joined by "," or None, ZeRO-3, tensor axes in mesh order) of a plan, from its
    decisions and its roles text ('data-parallel dp (ZeRO-3); tensor tp')."""
    dp, zero = None, False
    for d in plan.decisions:
        if d.op == "data_parallel":
            ax, rep = d.args.get("axis"), d.args.get("replicate") or ()
            ax = [ax] if isinstance(ax, str) else list(ax or ())
            ax += [rep] if isinstance(rep, str) else list(rep)
            dp, zero = ",".join(a for a in plan.cluster.mesh.names if a in ax), bool(d.args.get("shard", False))
    m = re.search(r"tensor ([\w,]+)", plan.roles)
    names = plan.cluster.mesh.names
    tp = tuple(a for a in m.group(1).split(",") if a in names) if m else ()
    return dp, zero, tp


def _row_axes(layout: str, tp: tuple[str, ...]) -> set[str]:
    """Tensor axes on which any placement of the row is not Replicate."""
    axes: set[str] = set()
    for _, pls in layout_tokens(layout):
        for a, p in zip(tp, pls):
            if p != "R":
                axes.add(a)
    return axes


_FROM = {"P": "all-reduce", "R": "split (no communication)"}


def _collectives(plan, dp: str | None, zero: bool) -> dict[str, list[str]]:
    """Per module path: the collectives its decisions imply, in words. Layout changes at a module's exit
    (`sync`), gradient reductions of replicated parameters (`reduce_grads`); the data-parallel axis's
    gradient reduction goes under the key "" (every module with parameters)."""
    out: dict[str, list[str]] = {}
    for d in plan.decisions:
        a = d.args
        if d.op == "sync":
            src = str(a.get("from_", "?"))
            kind = _FROM.get(src, "all-gather" if src.startswith("S") else "conversion")
            if src == "P" and str(a.get("to", "")).startswith("S"):
                kind = "reduce-scatter"
            pretty = f"S({src[1:]})" if src.startswith("S") else src
            where = "at the input" if a.get("mode") == "fwd_pre" else "at the exit"
            out.setdefault(d.path, []).append(f"{kind} over {a.get('axis')} ({pretty} -> {a.get('to')} {where}; "
                                              f"its adjoint in backward)")
        elif d.op == "reduce_grads":
            out.setdefault(d.path, []).append(f"gradient all-reduce over {a.get('axis')} of {a.get('names')}")
    if dp is not None:
        out[""] = [f"ZeRO-3 over {dp}: parameter all-gather (forward and backward) and gradient reduce-scatter"
                   if zero else f"gradient all-reduce over {dp} (data parallel)"]
    return out


def _block_of(path: str, blocks: list[str]) -> str | None:
    for b in blocks:
        if path == b or path.startswith(b + "."):
            return b
    return None


def costs_from_plan(plan) -> StepCosts:
    """The step of `plan` (a `treadle.planner.Plan`, planned or loaded) as StepCosts, by NOTE [plan attribution],
    from its rows and the solver's own estimate (`plan.estimated`, what the rows add up to; the plan's price
    is drawn by `treadle.viz.price_timeline` instead). Raises ValueError when the rows do not add up to that
    estimate (a plan file edited by hand)."""
    est = plan.estimated
    dp, zero, tp = plan_axes(plan)
    ckpts: dict[str, int] = dict((plan.solver or {}).get("checkpoints") or {})
    # repeated blocks: the checkpoint templates the solver reports, else a run of rows with the same count > 1
    blocks = sorted(ckpts, key=len, reverse=True)
    modules: list[ModuleCosts] = []
    streams: list[str] = []
    colls = _collectives(plan, dp, zero)
    sync_axes: dict[str, set[str]] = {}  # a layout change at the exit shows only its target in the row layout
    for d in plan.decisions:
        if d.op in ("sync", "reduce_grads") and d.args.get("axis") in tp:
            sync_axes.setdefault(d.path, set()).add(d.args["axis"])
    for r in plan.rows:
        fwd = r.compute_s / (1 + BACKWARD_PER_FORWARD)
        bwd = r.compute_s - fwd
        axes = _row_axes(r.layout, tp) | sync_axes.get(r.path, set())
        if dp is not None:
            axes.update(dp.split(","))
        ordered = tuple(a for a in plan.cluster.mesh.names if a in axes)
        comm: list[CommCost] = []
        what = tuple(colls.get(r.path, [])) + (tuple(colls.get("", [])) if dp is not None else ())
        if r.comm_s > 0:
            if ordered == tuple(dp.split(",") if dp else ()) or not any(a in tp for a in ordered):
                comm.append(CommCost(ordered, "backward", r.comm_s, r.comm_s, what))
            else:
                half = r.comm_s / 2
                comm += [CommCost(ordered, "forward", half, half, what),
                         CommCost(ordered, "backward", half, half, what)]
        for c in comm:
            if c.stream not in streams:
                streams.append(c.stream)
        block = _block_of(r.path, blocks) if r.count > 1 else None
        recomputed = ckpts.get(block, 0) if block else 0
        modules.append(ModuleCosts(r.path, r.count, fwd, bwd, r.recompute_s, comm, block, recomputed,
                                   {"layout": r.layout, "memory_bytes": r.memory_bytes}))
    total_compute = sum(r.compute_s for r in plan.rows)
    total_comm = sum(r.comm_s for r in plan.rows)
    total_rec = sum(r.recompute_s for r in plan.rows)
    for what, mine, theirs in (("compute", total_compute, est.compute_s), ("recompute", total_rec, est.recompute_s)):
        if abs(mine - theirs) > 1e-6 * max(abs(theirs), 1e-9) + 1e-12:
            raise ValueError(f"costs_from_plan: the rows' {what} adds up to {mine:.6g} s but the estimate says "
                             f"{theirs:.6g} s; the plan file is inconsistent")
    tol = 1e-6 * max(abs(est.comm_s), 1e-9) + 1e-12
    if total_comm < est.comm_s - tol:
        raise ValueError(f"costs_from_plan: the rows' comm adds up to {total_comm:.6g} s, less than the "
                         f"estimate's exposed {est.comm_s:.6g} s; the plan file is inconsistent")
    notes = [PLAN_ATTRIBUTION]
    if total_comm > est.comm_s + tol:  # NOTE [plan attribution]: the solver hides part of the data-parallel sync
        frac = est.comm_s / total_comm
        for m in modules:
            m.comm = [CommCost(c.axes, c.phase, c.seconds, c.seconds * frac, c.collectives) for c in m.comm]
        notes.append(f"the rows' communication ({total_comm:.6g} s) exceeds the estimate's exposed part "
                     f"({est.comm_s:.6g} s): every collective drawn {frac:.1%} exposed")
    other = max(est.peak_bytes - est.static_bytes - est.activation_bytes - est.transient_bytes, 0.0)
    mem = MemoryTotals(est.static_bytes, other, est.activation_bytes, est.transient_bytes, plan.budget_bytes)
    name = (plan.model or {}).get("name", "model") if isinstance(plan.model, dict) else "model"
    title = f"{name} on {plan.cluster.mesh} ({plan.roles})"
    streams.sort(key=lambda s: (s.count("+"), s))
    return StepCosts(title, modules, est.step_s, est.compute_s, est.comm_s, est.recompute_s, mem,
                     plan.cluster.world_size, streams, notes)
