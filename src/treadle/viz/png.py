"""PNG figures with matplotlib (the optional `viz` extra: ``pip install 'treadle[viz]'``): the memory over the
step, the step-time breakdown and the timeline of a predicted step, and a profile's memory over the step.

Figures are built on `matplotlib.figure.Figure` (Agg), never through pyplot, so nothing global changes.
Raises ImportError naming the extra when matplotlib is missing.
"""

from __future__ import annotations

from typing import Any

from .html import breakdown_parts, profile_memory_points
from ..units import bytes_unit
from .svg import MEMORY_COLOURS, PHASE_COLOURS, stream_colour
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


def timeline_figure(tl: Timeline) -> Any:
    """One row per track with its slices (compute coloured by phase, comm by stream)."""
    fig = _figure(10, 0.5 + 0.45 * len(tl.tracks))
    ax = fig.add_subplot()
    for i, track in enumerate(tl.tracks):
        spans = [s for s in tl.spans if s.track == track]
        colours = [PHASE_COLOURS.get(s.phase, "#888") if track == COMPUTE else stream_colour(track, tl.tracks)
                   for s in spans]
        ax.broken_barh([(s.start_s * 1e3, s.duration_s * 1e3) for s in spans], (i - 0.4, 0.8), facecolors=colours)
    ax.set_yticks(range(len(tl.tracks)), tl.tracks)
    ax.invert_yaxis()
    ax.axvline(tl.forward_end_s * 1e3, color="#333", ls=":", lw=1)
    ax.set_xlabel("ms")
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
