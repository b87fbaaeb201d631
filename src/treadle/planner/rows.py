"""The explanation of a solution: one row per module (layouts, compute, communication, recompute, memory), each
op billed to the module it came from, each form adding its own terms (`treadle.form.Form.adjust_rows`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..form import forms
from ..placement import R, placement_str
from ..units import fmt_bytes_exact as _fmt_bytes
from .cost_graph import CostGraph
from .ilp import Solution, evaluate, solve
from .variants import variants_of

# NOTE [the step row]: what the solver's step holds that no module's row does, as one row: host overheads fixed by
# the role (FSDP2 units, foreach lists: `cg.host_s`) and a checkpointed block's host cost in compute and recompute
# (the solver's terms less the module rows' sums), each form's constants in comm (data parallelism: the
# reductions' latency part and DDP's buffer broadcast, `adjust_rows` of `treadle.forms.data`), the bytes no
# decision changes (buffers, user inputs) in memory. With it the rows' compute and recompute add up to the
# solver's estimate and their comm is the step's communication before overlap (at least its exposed part).
STEP_ROW = "<step: no module>"  # host overheads, role constants, buffers and inputs


@dataclass(slots=True)
class PlanRow:
    """One module of the explanation (costs over all real blocks it stands for)."""

    path: str
    count: int
    layout: str
    compute_s: float
    comm_s: float
    recompute_s: float
    memory_bytes: float


def plan_rows(cg: CostGraph, sol: Solution) -> list[PlanRow]:
    """Per-module rows of the chosen strategies. Each op is billed to its own module, also when it was merged
    into another module's decision unit (NOTE [billing by module] in cost_graph.py)."""
    g = cg.graph
    rows: dict[str, PlanRow] = {}
    ck = {t: c for t, c in sol.ckpt.items()}
    for u, unit in enumerate(cg.units):
        k = sol.choice[u]
        parts = unit.parts[k] if unit.parts is not None else {unit.module: unit.costs[k]}
        members = unit.strategies[k]
        layouts: dict[str, list[str]] = {}
        out_l: dict[str, str] = {}
        for i, (combo, pub) in members.items():  # leader first, then followers in graph order
            n = g.nodes[i]
            for pos, j in enumerate(n.inputs):
                if g.nodes[j].kind == "param":
                    pl = tuple(o.ins[pos] for o in combo)
                    if any(p != R for p in pl):
                        layouts.setdefault(n.module, []).append(f"{g.nodes[j].param.rsplit('.', 1)[-1]}:" +
                                                                ",".join(placement_str(p) for p in pl))
            if n.module not in out_l or n.module != unit.module:  # the leader's layout on its own row
                out_l[n.module] = ",".join(placement_str(p) for p in pub) if pub else "-"
        for module, c in parts.items():
            path = module or "<root>"
            rec = ck[unit.template] * c.rec_s if unit.template is not None and ck.get(unit.template) else 0.0
            rec += sum(n * c.sac.get(p, (0.0, c.rec_s, 0.0))[1] for (t, p), n in sol.policies.items()
                       if n and t == unit.template)  # NOTE [checkpoint policies in the plan]
            row = rows.get(path)
            if row is None:
                row = rows[path] = PlanRow(path, unit.count, "", 0.0, 0.0, 0.0, 0.0)
            row.compute_s += unit.count * c.compute_s
            row.comm_s += unit.count * (c.comm_s + c.dp_comm_s)  # data-parallel sync before overlap
            row.recompute_s += rec
            row.memory_bytes += unit.count * (c.static_bytes + c.act_bytes)
            desc = " ".join(layouts.get(module, []) + [f"out:{out_l.get(module, '-')}"])
            if desc not in row.layout:
                row.layout = (row.layout + " " + desc).strip() if len(row.layout) < 60 else row.layout
    step = PlanRow(STEP_ROW, 1, "-", 0.0, 0.0, 0.0,
                   float(cg.fixed_static_bytes))
    shared: dict = {"step_row": step}  # NOTE [the step row]: a form's constants of the role go to its comm
    for f in forms():  # each form's terms (tensor parallelism: the input-gradient sums, each billed once to its
        f.adjust_rows(cg, sol.choice, rows, shared)  # first user; sequence: the gathers' credit, where billed)
    for key, v in variants_of(cg).items():  # the variant blocks' difference (NOTE [block variants]), before overlap
        row = rows.get(v.module, step)
        row.comm_s += sol.variants.get(key, 0) * (v.delta.comm_s + v.delta.dp_comm_s)
        if row is not step:  # (the step row takes the compute no row holds, below)
            row.compute_s += sol.variants.get(key, 0) * v.delta.compute_s
        row.memory_bytes += sol.variants.get(key, 0) * (v.delta.static_bytes + v.delta.act_bytes)
    _, _, terms = evaluate(cg, sol.choice, sol.ckpt, sol.variants, sol.policies)
    step.compute_s += terms["compute_s"] - sum(r.compute_s for r in rows.values())
    step.recompute_s += terms["recompute_s"] - sum(r.recompute_s for r in rows.values())
    tol = 1e-9 * max(terms["compute_s"] + terms["recompute_s"], 1e-12)
    keep = step.memory_bytes > 0 or any(abs(v) > tol for v in (step.compute_s, step.comm_s, step.recompute_s))
    return list(rows.values()) + ([step] if keep else [])


def binding_constraint(cg: CostGraph, sol: Solution, budget: float | None, time_limit_s: float, checkpoint: str, *,
                       priced_peak_bytes: float | None = None) -> str:
    """Which constraint binds: re-solve the chosen mesh and roles without the budget and compare (the solver's
    steps). The slack is the budget less the peak it was checked against: the price's (the plan as built,
    NOTE [final choice by price]) when the plan was chosen by price, else the solver's."""
    if budget is None:
        return "none (no memory budget)"
    peak, whose = ((priced_peak_bytes, "priced peak (as built)") if priced_peak_bytes is not None
                   else (sol.peak_bytes, "solver's peak"))
    slack = budget - peak
    free = solve(cg, budget_bytes=None, time_limit_s=time_limit_s, checkpoint=checkpoint != "none")
    if free.status != "infeasible" and free.step_s < sol.step_s * (1 - 1e-6):
        return (f"memory binds: {whose} {_fmt_bytes(peak)} of {_fmt_bytes(budget)} (slack {_fmt_bytes(slack)}); "
                f"without the budget this mesh and roles would take {free.step_s * 1e3:.3f} ms instead of "
                f"{sol.step_s * 1e3:.3f} ms (+{(sol.step_s / free.step_s - 1) * 100:.1f}%, solver's estimates) at "
                f"solver's peak {_fmt_bytes(free.peak_bytes)}")
    return (f"none: memory slack {_fmt_bytes(slack)} ({slack / budget:.0%} of the budget) under the {whose} "
            f"{_fmt_bytes(peak)}; the plan is the fastest for its mesh and roles without a memory limit")
