"""PNG figures with matplotlib (the optional `viz` extra: ``pip install 'treadle[viz]'``): the memory over the
step, the step-time breakdown and the timeline of a predicted step, and a profile's memory over the step.

Figures are built on `matplotlib.figure.Figure` (Agg), never through pyplot, so nothing global changes.
Raises ImportError naming the extra when matplotlib is missing.
"""

from __future__ import annotations

from typing import Any

from .html import breakdown_parts, profile_memory_points
from ..units import bytes_unit
from .svg import MEMORY_COLOURS, PHASE_COLOURS, slice_label, stream_colour
from .timeline import COMPUTE, Timeline


def require_matplotlib() -> None:
    """Raise ImportError naming the `viz` extra when matplotlib is not installed."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("treadle --png / treadle.viz.png needs matplotlib: pip install 'treadle[viz]'") from exc


def _figure(w: float, h: float) -> Any:  # -> matplotlib.figure.Figure
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), dpi=110, layout="constrained")


def memory_figure(tl: Timeline) -> Any:
    """Stacked per-device memory over the step (one area per category), the predicted peak and the budget."""
    fig = _figure(8, 3.6)
    ax = fig.add_subplot()
    unit = bytes_unit([tl.peak_bytes, tl.budget_bytes or 0.0])
    t_ms = [p.t_s * 1e3 for p in tl.memory]
    cats = list(tl.memory[0].by_category()) if tl.memory else []
    ys = [[p.by_category()[c] / unit[1] for p in tl.memory] for c in cats]
    ax.stackplot(t_ms, ys, labels=cats, colors=[MEMORY_COLOURS[c] for c in cats], alpha=0.85)
    ax.axhline(tl.peak_bytes / unit[1], color="#222", ls="--", lw=1, label="predicted peak")
    if tl.budget_bytes is not None:
        ax.axhline(tl.budget_bytes / unit[1], color="#d62728", ls="--", lw=1.5, label="budget")
    ax.axvspan(0, tl.forward_end_s * 1e3, color="#000", alpha=0.04, lw=0)
    ax.set_xlabel("time in the step (ms)")
    ax.set_ylabel(f"{unit[0]} per device")
    ax.set_title(f"memory over the step: {tl.title}", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return fig


def breakdown_figure(tl: Timeline) -> Any:
    """The critical path split into forward, backward, recompute and exposed communication per stream."""
    fig = _figure(8, 2.2)
    ax = fig.add_subplot()
    left = 0.0
    for label, colour, s in breakdown_parts(tl):
        ax.barh([0], [s * 1e3], left=[left], color=colour, label=f"{label}: {s * 1e3:,.1f} ms")
        left += s * 1e3
    ax.set_yticks([])
    ax.set_xlabel("ms")
    ax.set_title(f"step {tl.step_s * 1e3:.4g} ms: {tl.title}", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return fig


MIN_SLICE_FRACTION = 0.002  # of the step: a shorter slice (a short collective) is drawn this wide, so it shows


def timeline_figure(tl: Timeline) -> Any:
    """One row per track with its slices (compute coloured by phase, comm by stream), a title with the step, a
    legend of the colours, the end of the forward marked and named, module names on the slices wide enough,
    and every slice at least MIN_SLICE_FRACTION of the step wide."""
    from matplotlib.patches import Patch

    width_in = 11.0
    fig = _figure(width_in, 1.3 + 0.5 * len(tl.tracks))
    ax = fig.add_subplot()
    step_ms = max(tl.step_s * 1e3, 1e-9)
    min_ms = MIN_SLICE_FRACTION * step_ms
    px_per_ms = 0.78 * width_in * 110 / step_ms  # the axes take about 78% of the figure's width
    for i, track in enumerate(tl.tracks):
        spans = [s for s in tl.spans if s.track == track]
        colours = [PHASE_COLOURS.get(s.phase, "#888") if track == COMPUTE else stream_colour(track, tl.tracks)
                   for s in spans]
        bars = [(s.start_s * 1e3, max(s.duration_s * 1e3, min_ms)) for s in spans]
        ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=colours, edgecolors="none")
        for s, (x, w) in zip(spans, bars):
            label = slice_label(s.name, w * px_per_ms, px_per_char=7.0)
            if label:
                ax.text(x + 0.003 * step_ms, i, label, va="center", ha="left", fontsize=6.5, color="#111",
                        clip_on=True)
    ax.set_yticks(range(len(tl.tracks)), tl.tracks)
    ax.invert_yaxis()
    ax.set_xlim(0, step_ms * 1.01)
    fx = tl.forward_end_s * 1e3
    ax.axvline(fx, color="#333", ls=":", lw=1)
    ax.text(fx, 1.0, "\u2190 forward | backward \u2192", ha="center", va="bottom", fontsize=7, color="#333",
            transform=ax.get_xaxis_transform())
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(f"the step on one device (of {tl.world_size}): {tl.title}, {step_ms:.4g} ms", fontsize=9, pad=12)
    phases = [p for p in PHASE_COLOURS if any(s.phase == p and s.track == COMPUTE for s in tl.spans)]
    handles = [Patch(color=PHASE_COLOURS[p], label="waiting for a collective" if p == "exposed comm" else p)
               for p in phases]
    handles += [Patch(color=stream_colour(t, tl.tracks), label=f"{t} (collectives)") for t in tl.tracks
                if t != COMPUTE]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    return fig


def profile_memory_figure(prof) -> Any:
    """A profile's memory over the step: resident bytes plus live activations, the peak and device memory."""
    fig = _figure(8, 3.6)
    ax = fig.add_subplot()
    ts, live, _ = profile_memory_points(prof)
    unit = bytes_unit([float(prof.peak_bytes)])
    resident = prof.param_bytes + prof.optimizer_state_bytes + prof.buffer_bytes + prof.input_bytes
    t_ms = [t * 1e3 for t in ts]
    ax.stackplot(t_ms, [[resident / unit[1]] * len(ts), [b / unit[1] for b in live]],
                 labels=["resident (parameters,\noptimizer states,\nbuffers, inputs)",
                         "activations +\ngradients (live)"],
                 colors=[MEMORY_COLOURS["static"], MEMORY_COLOURS["activations"]], alpha=0.85)
    ax.axhline(prof.peak_bytes / unit[1], color="#222", ls="--", lw=1, label="peak")
    ax.set_xlabel("time in the step (ms, roofline)")
    ax.set_ylabel(unit[0])
    ax.set_title(f"memory over the step: {prof.model} on {prof.hardware.name}", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return fig


def save_plan_pngs(tl: Timeline, prefix: str) -> list[str]:
    """Write PREFIX-memory.png, PREFIX-breakdown.png and PREFIX-timeline.png; return the paths."""
    out = []
    for kind, make in (("memory", memory_figure), ("breakdown", breakdown_figure), ("timeline", timeline_figure)):
        path = f"{prefix}-{kind}.png"
        make(tl).savefig(path)
        out.append(path)
    return out


def save_profile_png(prof, prefix: str) -> list[str]:
    """Write PREFIX-memory.png of a profile; return the paths."""
    path = f"{prefix}-memory.png"
    profile_memory_figure(prof).savefig(path)
    return [path]
