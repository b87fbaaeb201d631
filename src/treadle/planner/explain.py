"""Explanations of a Plan: a per-module table (rich or text), the estimate and the binding constraint.

Formatters build data into a `rich.table.Table` or a string and print nothing; units are picked here
(ms, GiB) and nowhere else.
"""

from __future__ import annotations

from collections import Counter

from rich.table import Table

from ..units import bytes_unit as _mem_unit

def _fmt(x: float, unit: tuple[str, float]) -> str:
    return f"{x / unit[1]:.3f} {unit[0]}"


COMM_COLUMN = "comm ms (total, before overlap)"  # a row's communication; the step's exposed part is the summary's
TOTAL_ROW = "all modules (sum of rows)"
TABLE_NOTE = ("the solver's cost model per module, over all x blocks a row stands for; comm is each module's "
              "communication before overlap (data-parallel gradient sync included), not the step's exposed comm; "
              "memory: parameters, gradients, optimizer states and saved activations (checkpointing not "
              "subtracted); <step: no module>: host overheads, the role's constant comm, buffers and inputs")


def _columns(plan) -> tuple[tuple[str, float], tuple[str, ...]]:
    unit = _mem_unit([r.memory_bytes for r in plan.rows])
    return unit, ("module", "x", "layout", "compute ms", COMM_COLUMN, "recompute ms", f"memory {unit[0]}")


def _cells(plan, top: int | None, unit: tuple[str, float]) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
    """The rows shown (the `top` most expensive when given) and the sum of every row (whatever `top` shows)."""
    rows = list(plan.rows)
    if top is not None:
        rows = sorted(rows, key=lambda r: -(r.compute_s + r.comm_s + r.recompute_s))[:top]
    body = [(r.path, str(r.count), r.layout, f"{r.compute_s * 1e3:.3f}", f"{r.comm_s * 1e3:.3f}",
             f"{r.recompute_s * 1e3:.3f}", f"{r.memory_bytes / unit[1]:.3f}") for r in rows]
    rs = plan.rows
    total = (TOTAL_ROW, "", "", f"{sum(r.compute_s for r in rs) * 1e3:.3f}", f"{sum(r.comm_s for r in rs) * 1e3:.3f}",
             f"{sum(r.recompute_s for r in rs) * 1e3:.3f}", f"{sum(r.memory_bytes for r in rs) / unit[1]:.3f}")
    return body, total


def plan_table(plan, *, top: int | None = None) -> Table:
    """Rows of `plan` (most expensive first when `top` is given) and their sum, as a rich Table: the solver's
    figures per module (TABLE_NOTE, the caption)."""
    unit, head = _columns(plan)
    t = Table(*head, title=f"plan on {plan.cluster} ({plan.roles}, {plan.mode})", caption=TABLE_NOTE)
    t.columns[0].overflow = "fold"  # a module path is read whole, never cut with an ellipsis
    for c in t.columns[3:]:  # numbers: their headers wrap, the paths get the width
        c.max_width = 14
    body, total = _cells(plan, top, unit)
    for cells in body:
        t.add_row(*cells)
    t.add_section()
    t.add_row(*total)
    return t


def mesh_table(plan) -> Table:
    """One row per logical mesh the plan searched: its best role assignment and the runner-up, with the
    solver's predicted step, MFU and peak (MFU scaled from the chosen plan's: same model FLOPs and world);
    the chosen mesh is marked *. Built from `plan.solver["alternatives"]`."""
    alts = plan.solver.get("alternatives") or []
    by_mesh: dict[str, list[dict]] = {}
    for a in alts:
        by_mesh.setdefault(a.get("mesh", ""), []).append(a)
    e = plan.estimated
    unit = _mem_unit([a["peak_bytes"] for a in alts if a["status"] != "infeasible"])
    t = Table("mesh", "best roles", "solver step ms", "solver MFU", f"solver peak {unit[0]}", "runner-up roles",
              "solver step ms", title=f"meshes searched ({len(by_mesh)}; solver estimates, best first)")
    t.columns[0].no_wrap = True  # a mesh ('dp=2,tp=2') is read whole

    def ok(a: dict) -> bool:
        return a["status"] != "infeasible" and a["step_s"] > 0

    ranked = sorted(by_mesh.items(), key=lambda kv: min((a["step_s"] for a in kv[1] if ok(a)), default=float("inf")))
    for mesh, rows in ranked:
        good = sorted((a for a in rows if ok(a)), key=lambda a: (a["step_s"], a["peak_bytes"]))
        mark = "* " if mesh == str(plan.cluster.mesh) else ""
        short = mesh.removeprefix("Mesh(").removesuffix(")").replace(" ", "")
        if not good:
            t.add_row(mark + short, "no plan fits the budget", "-", "-", "-", "", "")
            continue
        b = good[0]
        mfu = e.mfu * e.step_s / b["step_s"] if e.step_s else 0.0
        r = good[1] if len(good) > 1 else None
        t.add_row(mark + short, b["roles"], f"{b['step_s'] * 1e3:.4g}", f"{mfu * 100:.1f}%",
                  f"{b['peak_bytes'] / unit[1]:.2f}", r["roles"] if r else "-",
                  f"{r['step_s'] * 1e3:.4g}" if r else "-")
    return t


def precision_line(plan) -> str | None:
    """What the plan assumes about precision: the parameter dtype, master weights and the MFU peak."""
    dt = plan.solver.get("param_dtype")
    if not dt:
        return None
    dev = (plan.solver.get("device") or {}).get("name", plan.cluster.device_name)
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dt, dt)
    if dt == "float32":
        return f"precision: fp32 (parameters, gradients and AdamW states in fp32; MFU against the fp32 peak of {dev})"
    return (f"precision: {short} mixed ({short} parameters, gradients and compute; fp32 master weights and AdamW "
            f"states counted in memory; MFU against the {short} peak of {dev})")


def summary_lines(plan) -> list[str]:
    """The estimate, the binding constraint and the solver's statistics, as lines. With a price (`plan.price`) the
    step, memory and MFU are the price's, and the solver's own figures are one line labelled as the solver's."""
    s = plan.solver
    prec = precision_line(plan)
    lines = [*([prec] if prec else []), *_step_lines(plan), plan.cluster.assumptions(),
             *([f"cluster: {s['cluster_measured']}"] if s.get("cluster_measured") else []),
             f"binding constraint: {plan.binding}"]
    if s.get("replicated"):
        lines.append(f"why nothing is sharded: {s['replicated']}")
    lines.append(f"solver: {s.get('status')} (gap {s.get('gap', 0):.2g}), {s.get('n_vars')} vars, "
                 f"{s.get('n_constraints')} constraints, planning {s.get('planning_s', 0):.2f} s")
    unit = _mem_unit([plan.estimated.peak_bytes])
    lines += pipeline_lines(plan, unit)
    ck = s.get("checkpoints") or {}
    if ck:
        lines.append("checkpointed blocks: " + ", ".join(f"{c} like {p}" for p, c in ck.items()))
    if s.get("policies"):  # NOTE [checkpoint policies in the plan]
        lines.append("selective checkpoints: " + ", ".join(f"{n} blocks like {k}" for k, n in s["policies"].items()))
    if s.get("variants"):  # NOTE [block variants]
        lines.append("block variants: " + ", ".join(f"{w} blocks like {k}" for k, w in s["variants"].items()))
    alts = s.get("alternatives") or []
    if len(alts) > 1:
        lines.append("alternatives (solver estimates): " + "; ".join(
            f"{a.get('mesh', '')} {a['roles']}: {a['status']}" +
            (f" {a['step_s'] * 1e3:.2f} ms {_fmt(a['peak_bytes'], unit)}" if a["status"] != "infeasible" else "")
            for a in alts[:8]) + (f"; ... {len(alts) - 8} more" if len(alts) > 8 else ""))
    pruned = s.get("pruned") or []
    if pruned:  # NOTE [a cutoff from the best plan found] in candidates.py
        lines.append(f"pruned: {len(pruned)} pipelined role assignments had no plan faster than one the search kept "
                     f"(e.g. {pruned[0].get('mesh', '')} {pruned[0]['roles']})")
    floored = [a for a in alts if "memory_floor_bytes" in a]
    if floored:  # NOTE [a memory floor before the costs] in floors.py
        low = min(floored, key=lambda a: a["memory_floor_bytes"])
        lines.append(f"memory floor: {len(floored)} role assignments cannot fit the budget and were not built (the "
                     f"least needs at least {_fmt(low['memory_floor_bytes'], unit)}: {low.get('mesh', '')} "
                     f"{low['roles']})")
    priced = s.get("priced") or []
    if priced:  # NOTE [final choice by price] in plan.py
        lines.append("final choice by price: " + "; ".join(
            f"{r['roles']}: {r['step_s'] * 1e3:.2f} ms {_fmt(r['peak_bytes'], unit)}"
            + (f" (re-solved {r['resolves']}x: its priced peak missed the budget)" if r.get("resolves") else "")
            for r in priced))
    if plan.unknown_ops:
        lines.append("ops without a sharding rule (run replicated): " +
                     ", ".join(f"{k} x{v}" for k, v in sorted(plan.unknown_ops.items())))
    if s.get("unknown_flops"):
        lines.append("ops without a FLOP formula (priced by bytes only): " +
                     ", ".join(f"{k} x{v}" for k, v in sorted(s["unknown_flops"].items())))
    return lines


def pipeline_lines(plan, unit) -> list[str]:
    """A pipelined plan's stages (NOTE [pipeline in the plan]): per stage its blocks, checkpointed blocks and
    seconds per micro-batch, per pp rank its peak, the fill; and why this pipeline — the best plan without one,
    and the best over another pp axis (another degree), by price where they were priced, else the solver's."""
    sp = plan.solver.get("stages")
    if not sp:
        return []
    blocks, ck = sp["blocks"], sp["checkpointed"]
    times = sp.get("stage_s") or ()
    out = [f"pipeline: {len(blocks)} stages over {sp['axis']} ({sp['schedule']}, {sp['n_microbatches']} "
           f"micro-batches), fill (bubble) {sp.get('bubble_s', 0.0) * 1e3:.3f} ms (solver's)"]
    for s_, b in enumerate(blocks):
        span = f"{b[0]}..{b[-1].rpartition('.')[2]}" if len(b) > 1 else (b[0] if b else "-")
        t = f", {times[s_] * 1e3:.3f} ms a micro-batch" if s_ < len(times) else ""
        pol = sp["policies"][s_] if sp.get("policies") else ()
        under = "".join(f", {n} under {p_}" for p_, n in sorted(Counter(p_ for _, p_ in pol).items()))
        out.append(f"  stage {s_}: {len(b)} blocks {span}{t}, {len(ck[s_])} checkpointed{under}")
    peaks = sp.get("rank_peak_bytes") or ()
    if peaks:
        out.append("  peak per pp rank: " + ", ".join(_fmt(x, unit) for x in peaks))
    out += _why_pipeline(plan, sp["axis"])
    return out


def _why_pipeline(plan, axis: str) -> list[str]:
    """The runner-ups of a pipelined plan: the best without a pipeline and the best over each other pp axis."""
    priced = {r["roles"]: r for r in plan.solver.get("priced") or []}
    alts = [a for a in plan.solver.get("alternatives") or [] if a["status"] != "infeasible"]

    def fig(a) -> tuple[float, str]:
        r = priced.get(a["roles"])
        return (r["step_s"], "priced") if r else (a["step_s"], "solver's")

    chosen = plan.price["step_s"] if plan.price else plan.estimated.step_s
    lines = []
    flat = [a for a in alts if "pipeline " not in a["roles"]]
    others: dict[str, dict] = {}
    for a in alts:
        pp = next((part.split()[1] for part in a["roles"].split("; ") if part.startswith("pipeline ")), None)
        if pp and pp != axis and pp not in others:
            others[pp] = a
    for label, a in ([("without a pipeline", flat[0])] if flat else []) + [
            (f"pipelined over {pp} instead", a) for pp, a in others.items()]:
        t, whose = fig(a)
        lines.append(f"  {label}: {a['roles']} {t * 1e3:.3f} ms ({whose}; {(t / chosen - 1) * 100:+.1f}%)")
    if not flat:
        lines.append("  without a pipeline: no plan fits (or pipelining was pinned)")
    return lines


def _solver_line(plan, *, head: str) -> str:
    e = plan.estimated
    unit = _mem_unit([e.peak_bytes])
    return (f"{head}: step {e.step_s * 1e3:.3f} ms = compute {e.compute_s * 1e3:.3f} + recompute "
            f"{e.recompute_s * 1e3:.3f} + exposed comm {e.comm_s * 1e3:.3f} ms, peak {_fmt(e.peak_bytes, unit)} = "
            f"static {e.static_bytes / unit[1]:.3f} + activations {e.activation_bytes / unit[1]:.3f} + recomputed "
            f"block {e.transient_bytes / unit[1]:.3f} {unit[0]}, solver's MFU {e.mfu * 100:.1f}%")


def _step_lines(plan) -> list[str]:
    """The step, memory and MFU: the price's when the plan has one (the figures the pictures draw and the budget
    was checked against), then the solver's own estimate, labelled; else the solver's alone."""
    p = getattr(plan, "price", None)
    if not p:
        return [_solver_line(plan, head="solver's estimate (this plan holds no price)")]
    return price_lines(p) + [
        _solver_line(plan, head="solver's estimate (its own cost model: the table's figures, not the price's)")]


def price_lines(p: dict) -> list[str]:
    """A price (`Price.to_dict()`) as three lines: the step as compute + recompute + exposed comm beside the total
    communication before overlap; the peak as static + activations + transient; the MFU. `treadle explain` and
    `treadle price` print these."""
    unit = _mem_unit([p["peak_bytes"]])
    hidden = p.get("overlapped_comm_s", p["comm_s"] - p["exposed_comm_s"])
    dev = p["device"]["name"] if isinstance(p.get("device"), dict) else str(p.get("device", ""))
    pipe = _pipeline_lines(p["pipeline"]) if p.get("pipeline") else []
    compiled = ", blocks compiled" if p.get("execution") == "compiled" else ""
    return pipe + [f"price of the schedule (rehearsed, overlap modelled{compiled}): step {p['step_s'] * 1e3:.3f} ms = compute "
            f"{p['compute_s'] * 1e3:.3f} + recompute {p['recompute_s'] * 1e3:.3f} + exposed comm "
            f"{p['exposed_comm_s'] * 1e3:.3f} ms; comm (total, before overlap) {p['comm_s'] * 1e3:.3f} ms, of which "
            f"{hidden * 1e3:.3f} hidden behind compute",
            f"memory (price): peak {_fmt(p['peak_bytes'], unit)} per device = static {p['static_bytes'] / unit[1]:.3f}"
            f" + activations {p['activation_bytes'] / unit[1]:.3f} + transient {p['transient_bytes'] / unit[1]:.3f} "
            f"{unit[0]}",
            f"MFU {p['mfu'] * 100:.1f}% (price, on {dev})"]


def _pipeline_lines(pi: dict) -> list[str]:
    """A priced pipeline in two lines (NOTE [pipeline price]): its bubble and critical path; each stage's
    forward / backward per micro-batch and its send. The step and memory lines after them are the slowest rank's
    and the largest rank's, whose exposed comm holds the bubble."""
    ranks = pi["ranks"]
    slow, big = str(pi["slowest_rank"]), str(pi["largest_rank"])
    stages = "; ".join(f"s{s['stage']} (rank {s['rank']}) F {s['forward_s'] * 1e3:.3f} B {s['backward_s'] * 1e3:.3f}"
                       + (f" W {s['weight_s'] * 1e3:.3f}" if s.get("weight_s") else "")
                       + (f" send {s['send_bytes'] / 2**10:.0f} KiB {s['send_s'] * 1e3:.3f}" if s.get("send_s") else "")
                       for s in pi["stages"])
    return [f"pipeline {pi['schedule']} over {pi['axis']}={len(ranks)}, {pi['n_stages']} stages, "
            f"{pi['n_microbatches']} micro-batches: bubble {pi['bubble_fraction'] * 100:.1f}% of rank time "
            f"({pi['bubble_s'] * 1e3:.3f} ms on the slowest, rank {slow}; in its exposed comm below); peak on rank "
            f"{big}; critical path {' '.join(pi['critical_path'])}",
            f"per stage and micro-batch, ms: {stages}"] + _pipeline_fsdp_line(pi)


def _pipeline_fsdp_line(pi: dict) -> list[str]:
    """FSDP2 beside the pipeline (NOTE [pipeline FSDP2 price]): per rank the seconds of its stages' gathers and
    reduce-scatters, inside its actions' time; nothing without FSDP2."""
    ranks = pi["ranks"]
    if not any(r.get("fsdp_gather_s") or r.get("fsdp_reduce_s") for r in ranks.values()):
        return []
    per = "; ".join(f"rank {k} gathers {r['fsdp_gather_s'] * 1e3:.3f} reduce-scatters {r['fsdp_reduce_s'] * 1e3:.3f}"
                    for k, r in ranks.items())
    return [f"{pi['data_parallel']} per step, ms (inside the actions above): {per}"]


def explain_text(plan, *, top: int | None = None) -> str:
    """The table (with its sum row and note) and the summary as plain text (fixed-width columns)."""
    unit, head = _columns(plan)
    body, total = _cells(plan, top, unit)
    widths = [max(len(h), *(len(b[i]) for b in body + [total])) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head)] + [fmt.format(*b) for b in body] + [fmt.format(*total), f"({TABLE_NOTE})"]
    return "\n".join(lines + [""] + summary_lines(plan))
