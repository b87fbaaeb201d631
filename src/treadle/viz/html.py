"""Self-contained HTML reports of a Plan and of a ModelProfile: inline CSS and SVG, no scripts, no network.

    open("report.html", "w").write(plan_html(plan))      # mesh, breakdown, memory, layouts, alternatives, Python
    open("profile.html", "w").write(profile_html(prof))  # per-module FLOPs / bytes / activations, memory

Each section is a `<section id=...>` (ids in PLAN_SECTIONS / PROFILE_SECTIONS) so tests and links find it.
"""

from __future__ import annotations

from html import escape
from typing import Sequence

from ..units import bytes_unit, fmt_ms
from .costs import layout_tokens, plan_axes
from .schedule_view import collapse_schedule
from .svg import (MEMORY_COLOURS, PHASE_COLOURS, compare_bars, gantt, mesh_picture, stacked_area,
                  stacked_bar, stream_colour)
from .plan_timeline import timeline_from_plan
from .timeline import COMPUTE, Timeline

PLAN_SECTIONS = ("summary", "mesh", "breakdown", "memory", "layouts", "alternatives", "schedule")
PROFILE_SECTIONS = ("summary", "modules", "memory")
PLACEMENT_COLOURS = {"R": "#e8e8e8", "P": "#f9c98f", "S(0)": "#a8c6e8", "S(1)": "#b5dcae", "S(2)": "#f6e3a1",
                     "S(3)": "#d9c2e0", "S(4)": "#f4c2c8"}

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:20px}h2{font-size:16px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:28px}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:3px 6px;text-align:left}
th{background:#f6f6f6}td.num{text-align:right;font-variant-numeric:tabular-nums}
.chip{display:inline-block;padding:1px 5px;margin:1px;border-radius:3px;font-family:monospace;font-size:11px}
pre{background:#f7f7f7;padding:10px;overflow-x:auto;font-size:12px}.note{color:#666;font-size:12px}
.bar{background:#4e79a7;height:9px;display:inline-block}
"""


def _page(title: str, sections: list[tuple[str, str, str]]) -> str:
    body = "".join(f'<section id="{sid}"><h2>{escape(head)}</h2>{html}</section>' for sid, head, html in sections)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<style>{_CSS}</style></head><body><h1>{escape(title)}</h1>{body}</body></html>\n')


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], *, num_from: int = 99) -> str:
    """Cells are HTML already (escape text before)."""
    h = "<tr>" + "".join(f"<th>{escape(c)}</th>" for c in head) + "</tr>" if any(head) else ""
    b = "".join("<tr>" + "".join(f'<td class="num">{c}</td>' if i >= num_from else f"<td>{c}</td>"
                                 for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table>{h}{b}</table>"


def _chip(text: str, placement: str) -> str:
    colour = PLACEMENT_COLOURS.get(placement, "#ddd")
    return f'<span class="chip" style="background:{colour}">{escape(text)}</span>'


# ----------------------------------------------------------------------------- plan
def memory_chart(tl: Timeline) -> str:
    """Stacked per-device memory over the step with the budget and the source's peak as lines."""
    times = [p.t_s for p in tl.memory]
    cats = tl.memory[0].by_category().keys() if tl.memory else ()
    series = [(c, MEMORY_COLOURS[c], [p.by_category()[c] for p in tl.memory]) for c in cats]
    lines = [("predicted peak", "#222", tl.peak_bytes)]
    if tl.budget_bytes is not None:
        lines.append(("budget", "#d62728", tl.budget_bytes))
    bands = [("forward", 0.0, tl.forward_end_s)]
    return stacked_area(times, series, lines=lines, bands=bands)


def breakdown_parts(tl: Timeline) -> list[tuple[str, str, float]]:
    """(label, colour, seconds) of the critical path: forward, backward, recompute, optimizer, then each comm
    stream's exposed part."""
    bd = tl.breakdown()
    parts = [(k, PHASE_COLOURS[k], bd[k]) for k in ("forward", "backward", "recompute", "optimizer") if bd.get(k)]
    parts += [(t + " (exposed)", stream_colour(t, tl.tracks), bd[t]) for t in tl.tracks if t != COMPUTE and bd.get(t)]
    return parts


def _layout_table(plan) -> str:
    dp, zero, tp = plan_axes(plan)
    head = ["module", "x"] + [f"axis {a} (tensor)" for a in tp]
    if dp:
        head.append(f"axis {dp} (data)")
    rows = []
    for r in plan.rows:
        if r.path.startswith("<step"):  # NOTE [the step row] in treadle.planner.rows: no module, no layout
            continue
        cells = [escape(r.path), str(r.count)]
        toks = layout_tokens(r.layout)
        for i, _ in enumerate(tp):
            seen: list[str] = []
            for name, pls in toks:
                p = pls[i] if i < len(pls) else "R"
                chip = _chip(f"{name}:{p}", p)
                if chip not in seen:
                    seen.append(chip)
            cells.append("".join(seen))
        if dp:
            cells.append(_chip("batch S(0)" + (", weights S(0) (ZeRO-3)" if zero else ", weights R"), "S(0)"))
        rows.append(cells)
    legend = " ".join(_chip(k, k) for k in PLACEMENT_COLOURS)
    return (f'<p class="note">One row per module (x: repeated blocks it stands for); per tensor axis, the placement '
            f'of each sharded parameter and of the module outputs. R replicate, S(d) shard tensor dim d, P partial '
            f'sum. {legend}</p>' + _table(head, rows))


def _alternatives(plan) -> str:
    s = plan.solver or {}
    alts = s.get("alternatives") or []
    unit = bytes_unit([a.get("peak_bytes", 0.0) for a in alts if a.get("status") != "infeasible"] + [1.0])
    rows = [[escape(a.get("mesh", "")), escape(a["roles"]), escape(a["status"]),
             fmt_ms(a["step_s"]) if a["status"] != "infeasible" else "-",
             f"{a['peak_bytes'] / unit[1]:.3f}" if a["status"] != "infeasible" else "-"] for a in alts]
    ck = s.get("checkpoints") or {}
    html = f"<p><b>binding constraint:</b> {escape(plan.binding)}</p>"
    html += (f"<p>solver: {escape(str(s.get('status')))}, gap {s.get('gap', 0):.2g}, {s.get('n_vars')} variables, "
             f"{s.get('n_constraints')} constraints, planning {s.get('planning_s', 0):.2f} s</p>")
    if ck:
        html += "<p>checkpointed: " + ", ".join(f"{c} blocks like {escape(p)}" for p, c in ck.items()) + "</p>"
    head = ["mesh", "roles", "status", "solver step", f"solver peak {unit[0]}"]
    html += _table(head, rows, num_from=3) if rows else "<p>no alternatives recorded</p>"
    return html


def model_text(model) -> str:
    """A plan's `model` record as a person reads it: 'tiny-llama, batch 8, seq 32, fp32' (what it holds)."""
    if not isinstance(model, dict):
        return "model (not recorded)" if model is None else str(model)
    parts = [str(model.get("name", "model"))]
    parts += [f"{k} {model[k]}" for k in ("batch", "seq") if model.get(k) is not None]
    parts += [str(model["dtype"])] if model.get("dtype") else []
    parts += [f"{k} {v}" for k, v in model.items() if k not in ("name", "batch", "seq", "dtype")]
    return ", ".join(parts)


def _mem_split(peak: float, static: float, act: float, last: float, last_name: str) -> str:
    unit = bytes_unit([peak])
    return (f"{peak / unit[1]:.3f} {unit[0]} per device = static {static / unit[1]:.3f} + activations "
            f"{act / unit[1]:.3f} + {last_name} {last / unit[1]:.3f} {unit[0]}")


def _price_rows(p: dict) -> list[list[str]]:
    """Step, peak memory and MFU of a price (`Price.to_dict()`), each labelled as the price's."""
    hidden = p.get("overlapped_comm_s", p["comm_s"] - p["exposed_comm_s"])
    return [["step (price)", f"{fmt_ms(p['step_s'])} = compute {fmt_ms(p['compute_s'])} + recompute "
                             f"{fmt_ms(p['recompute_s'])} + exposed comm {fmt_ms(p['exposed_comm_s'])}; comm (total, "
                             f"before overlap) {fmt_ms(p['comm_s'])}, of which {fmt_ms(hidden)} hidden behind compute"],
            ["peak memory (price)", _mem_split(p["peak_bytes"], p["static_bytes"], p["activation_bytes"],
                                               p["transient_bytes"], "transient")],
            ["MFU (price)", f"{p['mfu'] * 100:.1f}%"]]


def _step_rows(plan) -> list[list[str]]:
    """Step, memory and MFU: the price's when the plan has one, then the solver's own estimate labelled (the
    figures `treadle explain` prints, in the same words)."""
    e, p = plan.estimated, plan.price
    budget = ""
    if plan.budget_bytes:
        bu = bytes_unit([plan.budget_bytes])
        budget = f" (budget {plan.budget_bytes / bu[1]:.3f} {bu[0]})"
    peak = _mem_split(e.peak_bytes, e.static_bytes, e.activation_bytes, e.transient_bytes, "recomputed block")
    solver = (f"step {fmt_ms(e.step_s)} = compute {fmt_ms(e.compute_s)} + recompute {fmt_ms(e.recompute_s)} + "
              f"exposed comm {fmt_ms(e.comm_s)}; peak {peak}; solver's MFU {e.mfu * 100:.1f}%")
    if p is None:
        return [["step (solver's estimate; no price)", solver + budget]]
    step, mem, mfu = _price_rows(p)
    return [step, [mem[0], mem[1] + budget], mfu,
            ["solver's estimate", solver + " (its own cost model: the per-module figures, not the price's)"]]


def measured_text(step_s: float, measured_s: list[float]) -> str:
    """'fastest 25.100 ms of 3 steps (25.100, 26.000, 27.200 ms); measured / predicted = 1.13x'."""
    ratio = f"; measured / predicted = {min(measured_s) / step_s:.2f}x" if step_s > 0 else ""
    return (f"fastest {fmt_ms(min(measured_s))} of {len(measured_s)} step(s) ("
            + ", ".join(f"{s * 1e3:.3f}" for s in measured_s) + f" ms){ratio}")


def plan_html(plan, *, timeline: Timeline | None = None, measured_s: Sequence[float] | None = None) -> str:
    """The report of `plan` (a treadle.planner.Plan, planned or loaded) as one HTML page; `timeline`
    defaults to `timeline_from_plan(plan)`; `measured_s`: measured step times (s, e.g.
    `treadle.viz.measured.step_times_s` of a trace), shown beside the predicted step."""
    tl = timeline or timeline_from_plan(plan)
    name = (plan.model or {}).get("name", "model") if isinstance(plan.model, dict) else "model"
    measured = list(measured_s or [])
    rows = [["model", escape(model_text(plan.model))], ["cluster", escape(str(plan.cluster))],
            ["roles", escape(plan.roles)], ["mode", escape(plan.mode)],
            *[[k, escape(v)] for k, v in _step_rows(plan)]]
    if measured:
        rows.append(["measured step", escape(measured_text(tl.step_s, measured))])
    rows.append(["binding constraint", escape(plan.binding)])
    why = (plan.solver or {}).get("replicated")
    if why:
        rows.append(["why nothing is sharded", escape(why)])
    summary = _table(["", ""], rows)
    m = plan.cluster.mesh
    mesh = mesh_picture(m.shape, m.names, [str(plan.cluster.link(a)) for a in m.names])
    dp, zero, tp = plan_axes(plan)
    mesh += (f'<p class="note">{plan.cluster.world_size} devices ({escape(plan.cluster.device_name)}); data parallel '
             f'on {escape(str(dp))}{" (ZeRO-3)" if zero else ""}; tensor axes {escape(", ".join(tp) or "none")}.</p>')
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in tl.notes)
    vs = ""
    if measured:
        vs = ("<p>predicted vs measured step:</p>" +
              compare_bars([("predicted", PHASE_COLOURS["forward"], tl.step_s),
                            (f"measured (fastest of {len(measured)})", "#e15759", min(measured))]))
    breakdown = (stacked_bar(breakdown_parts(tl)) + vs + "<p>the step on one device (hover a slice for its module):"
                 "</p>" + gantt(tl) + notes)
    memory = memory_chart(tl) + (_PRICE_MEMORY_NOTE if plan.price is not None else
                                 '<p class="note">per device (every device of the mesh holds the same); static = '
                                 'parameters + gradients + optimizer states, other = buffers + inputs. Activations '
                                 'are drawn growing linearly over the forward and shrinking over the backward; the '
                                 'planner\'s peak adds every term at once, an upper bound of the curve.</p>')
    lines = plan.python_lines()
    python = ("<pre>" + escape("\n".join(collapse_schedule(lines))) + "</pre>" +
              f"<details><summary>all {len(lines)} calls, in the plan's order</summary><pre>" +
              escape("\n".join(lines)) + "</pre></details>")
    return _page(f"treadle plan: {name} on {m}", [
        ("summary", "Summary", summary), ("mesh", "Mesh and links", mesh),
        ("breakdown", "Step time breakdown", breakdown), ("memory", "Memory over the step", memory),
        ("layouts", "Layouts per module and mesh axis", _layout_table(plan)),
        ("alternatives", "Alternatives compared and the binding constraint", _alternatives(plan)),
        ("schedule", "The schedule as Python", python)])


_PRICE_MEMORY_NOTE = ('<p class="note">per device (every device of the mesh holds the same), from the price\'s '
                      'totals (NOTE [price memory over the step] in treadle.viz.price_timeline): static = parameters, '
                      'optimizer states, buffers, inputs (and DDP buckets) all step; activations grow over the '
                      'forward and shrink over the backward; the recomputed block band holds the price\'s transient '
                      'bytes (gradients, temporaries, a recomputed block, gathered units) over the backward.</p>')


def price_html(price, *, timeline: Timeline | None = None, title: str = "",
               measured_pipeline: dict | None = None) -> str:
    """A `treadle.pricing.Price` (or its to_dict()) as one HTML page: summary, step-time breakdown with
    the timeline, memory over the step. `timeline` defaults to `timeline_from_price(price)`; a pipeline's
    `measured_pipeline` (`write_price_pictures`) adds its measured timeline and a table beside the predicted."""
    from .price_timeline import timeline_from_price

    p = price if isinstance(price, dict) else price.to_dict()
    tl = timeline or timeline_from_price(p, title=title or None)
    dev = p.get("device") or {}
    summary = _table(["", ""], [
        ["schedule", escape(title or tl.title)], ["data parallel", escape(str(p.get("data_parallel")))],
        ["device", escape(str(dev.get("name", "")) if isinstance(dev, dict) else str(dev))],
        *[[k, escape(v)] for k, v in _price_rows(p)]])
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in tl.notes)
    breakdown = (stacked_bar(breakdown_parts(tl)) + "<p>the step on one device (hover a slice for its module):</p>" +
                 gantt(tl) + notes)
    sections = [("summary", "Summary", summary), ("breakdown", "Step time breakdown", breakdown)]
    if measured_pipeline is not None:
        from .pipeline_timeline import COMPARE_HEAD, pipeline_compare_rows, timeline_from_measured_pipeline

        mtl = timeline_from_measured_pipeline(measured_pipeline)
        rows = [[escape(c) for c in row] for row in pipeline_compare_rows(p, measured_pipeline)]
        body = (_table(COMPARE_HEAD, rows, num_from=2) + f"<p>{escape(mtl.title)}:</p>" + gantt(mtl) +
                "".join(f'<p class="note">{escape(n)}</p>' for n in mtl.notes))
        sections.append(("measured", "Measured pipeline beside the predicted", body))
    sections.append(("memory", "Memory over the step", memory_chart(tl) + _PRICE_MEMORY_NOTE))
    return _page(f"treadle price: {title or tl.title}", sections)


# ----------------------------------------------------------------------------- profile
def profile_memory_points(prof, *, max_points: int = 1500) -> tuple[list[float], list[float], list[str]]:
    """(time at the end of each op in s, live activation bytes after it, phase) over the step's ops, thinned
    to at most `max_points` by keeping each bucket's highest point (the peak survives)."""
    t, out_t, out_b, out_p = 0.0, [], [], []
    for r in prof.ops:
        t += r.time_s
        out_t.append(t)
        out_b.append(float(r.live_after_bytes))
        out_p.append(r.phase)
    if len(out_t) > max_points:
        k = -(-len(out_t) // max_points)
        idx = [max(range(i, min(i + k, len(out_t))), key=lambda j: out_b[j]) for i in range(0, len(out_t), k)]
        out_t, out_b, out_p = [out_t[i] for i in idx], [out_b[i] for i in idx], [out_p[i] for i in idx]
    return out_t, out_b, out_p


def profile_memory_chart(prof) -> str:
    ts, live, phases = profile_memory_points(prof)
    if not ts:
        return "<p>this profile holds no op records (written with ops=False): no memory timeline</p>"
    n = len(ts)
    other = float(prof.buffer_bytes + prof.input_bytes)
    series = [("parameters", MEMORY_COLOURS["parameters"], [float(prof.param_bytes)] * n),
              ("optimizer states", MEMORY_COLOURS["optimizer states"], [float(prof.optimizer_state_bytes)] * n),
              ("buffers + inputs", MEMORY_COLOURS["buffers + inputs"], [other] * n),
              ("activations + gradients (live)", MEMORY_COLOURS["activations"], live)]
    bands, start = [], 0.0
    for i, p in enumerate(phases):
        if i + 1 == n or phases[i + 1] != p:
            if p != "forward":
                bands.append((p, start, ts[i]))
            start = ts[i]
    lines = [("peak", "#222", float(prof.peak_bytes)), ("device memory", "#d62728", float(prof.hardware.memory_bytes))]
    live_label = series[-1][0]  # nothing is live before the first op
    return stacked_area([0.0] + ts, [(a, c, [0.0 if a == live_label else v[0]] + list(v)) for a, c, v in series],
                        lines=lines, bands=bands)


def profile_html(prof, *, depth: int = 2) -> str:
    """The report of a `treadle.profile.ModelProfile`: totals, per-module figures down to `depth`, and the
    memory over the step (from the op records)."""
    from ..units import fmt_bytes, fmt_count, fmt_flops, fmt_time

    total_s = prof.step_time_s or 1e-12
    summary = _table(["", ""], [
        ["model", escape(prof.model)], ["hardware", escape(prof.hardware.name)], ["dtype", escape(prof.dtype)],
        ["FLOPs forward / backward / recompute", f"{fmt_flops(prof.forward_flops)} / {fmt_flops(prof.backward_flops)}"
                                                 f" / {fmt_flops(prof.recompute_flops)}"],
        ["parameters / gradients / optimizer states", f"{fmt_bytes(prof.param_bytes)} / {fmt_bytes(prof.grad_bytes)}"
                                                      f" / {fmt_bytes(prof.optimizer_state_bytes)}"],
        ["saved for backward", fmt_bytes(prof.saved_bytes + prof.saved_input_bytes)],
        ["peak memory", f"{fmt_bytes(prof.peak_bytes)} of {fmt_bytes(prof.hardware.memory_bytes)} at "
                        f"{escape(prof.peak_module or '<model>')} ({escape(prof.peak_phase)})"],
        ["step time (roofline)", f"{fmt_time(prof.step_time_s)} (fwd {fmt_time(prof.forward_time_s)}, "
                                 f"bwd {fmt_time(prof.backward_time_s)})"],
        ["MFU", f"{prof.mfu * 100:.1f}%"]])
    rows = []
    for m in prof.rows(max_depth=depth):
        share = m.time_s / total_s
        rows.append([escape("\u00a0\u00a0" * m.depth + (m.path or "<model>")), escape(m.type_name),
                     fmt_count(m.n_params), fmt_flops(m.forward_flops), fmt_flops(m.backward_flops + m.recompute_flops),
                     fmt_bytes(m.param_bytes), fmt_bytes(m.output_bytes), fmt_bytes(m.saved_bytes),
                     fmt_time(m.forward_time_s), fmt_time(m.backward_time_s),
                     f'<span class="bar" style="width:{max(share * 120, 0):.1f}px"></span> {share:.1%}'])
    modules = _table(["module", "type", "params", "FLOPs fwd", "FLOPs bwd", "param bytes", "output bytes",
                      "saved act", "time fwd", "time bwd", "% of step"], rows, num_from=2)
    memory = profile_memory_chart(prof) + ('<p class="note">one device, one step at roofline time; live = '
                                           'activations, temporaries and gradients allocated during the step.</p>')
    return _page(f"treadle profile: {prof.model} on {prof.hardware.name}", [
        ("summary", "Summary", summary), ("modules", "Per module (inclusive)", modules),
        ("memory", "Memory over the step", memory)])
