"""Inline SVG charts as strings (no scripts, no network): a stacked area over time with a budget line, a
stacked bar of a time split, a Gantt chart of a Timeline, and a device mesh with its links.

Inputs are seconds and bytes; units for display (ms, MiB / GiB) are picked here. Every chart carries a
`data-chart` attribute naming its kind, and every mark a `<title>` tooltip with its figures.
"""

from __future__ import annotations

import math
from html import escape
from typing import Sequence

from ..units import bytes_unit, fmt_ms
from .timeline import COMPUTE, Timeline

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")
COMM_PALETTE = ("#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#f28e2b")  # none is a phase colour
PHASE_COLOURS = {"forward": "#4e79a7", "backward": "#59a14f", "recompute": "#e15759", "optimizer": "#9467bd",
                 "exposed comm": "#d3d3d3"}
MEMORY_COLOURS = {"static": "#9c755f", "other": "#bab0ac", "activations": "#4e79a7", "recomputed block": "#e15759",
                  "parameters": "#9c755f", "gradients": "#edc948", "optimizer states": "#b07aa1",
                  "buffers + inputs": "#bab0ac"}


def stream_colour(name: str, streams: Sequence[str]) -> str:
    """A colour per communication stream, stable for a given list of streams."""
    comm = [s for s in streams if s != COMPUTE]
    i = comm.index(name) if name in comm else len(comm)
    return COMM_PALETTE[i % len(COMM_PALETTE)]


def _ticks(hi: float, n: int = 5) -> list[float]:
    if hi <= 0:
        return [0.0]
    raw = hi / n
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10, 20) if m * mag >= raw)
    return [i * step for i in range(int(hi / step) + 1)]


def stacked_area(times_s: Sequence[float], series: Sequence[tuple[str, str, Sequence[float]]], *,
                 lines: Sequence[tuple[str, str, float]] = (), bands: Sequence[tuple[str, float, float]] = (),
                 width: int = 780, height: int = 280, kind: str = "memory") -> str:
    """Stacked areas of `series` ((label, colour, bytes per time)) over `times_s`, horizontal `lines`
    ((label, colour, bytes): a budget, a peak) and shaded x `bands` ((label, start_s, end_s): phases)."""
    left, right, top, bottom = 70, 170, 14, 34
    w, h = width - left - right, height - top - bottom
    t_max = max(times_s[-1] if times_s else 0.0, 1e-12)
    totals = [sum(s[2][i] for s in series) for i in range(len(times_s))]
    y_max = max([*totals, *(v for _, _, v in lines), 1.0]) * 1.05
    unit = bytes_unit([y_max])
    X = lambda t: left + w * t / t_max  # noqa: E731
    Y = lambda b: top + h * (1 - b / y_max)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" data-chart="{kind}" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">']
    for label, a, b in bands:
        out.append(f'<rect x="{X(a):.1f}" y="{top}" width="{max(X(b) - X(a), 0):.1f}" height="{h}" fill="#f4f4f4">'
                   f'<title>{escape(label)}</title></rect><text x="{X(a) + 3:.1f}" y="{top + 11}" fill="#888">'
                   f'{escape(label)}</text>')
    base = [0.0] * len(times_s)
    for label, colour, vals in series:
        upper = [b + v for b, v in zip(base, vals)]
        pts = [f"{X(t):.1f},{Y(u):.1f}" for t, u in zip(times_s, upper)]
        pts += [f"{X(t):.1f},{Y(b):.1f}" for t, b in reversed(list(zip(times_s, base)))]
        peak = max(vals, default=0.0)
        out.append(f'<polygon data-series="{escape(label)}" points="{" ".join(pts)}" fill="{colour}" '
                   f'fill-opacity="0.85" stroke="none"><title>{escape(label)}: up to {peak / unit[1]:.3f} {unit[0]}'
                   f'</title></polygon>')
        base = upper
    for label, colour, v in lines:
        out.append(f'<line data-line="{escape(label)}" x1="{left}" x2="{left + w}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" '
                   f'stroke="{colour}" stroke-width="1.5" stroke-dasharray="6,3"><title>{escape(label)}: '
                   f'{v / unit[1]:.3f} {unit[0]}</title></line>')
    out.append(_axes(left, top, w, h, [(X(v / 1e3), f"{v:.4g}") for v in _ticks(t_max * 1e3)],
                     [(Y(v * unit[1]), f"{v:.4g}") for v in _ticks(y_max / unit[1])], "time in the step (ms)",
                     f"{unit[0]} per device"))
    legend = [(lb, c, "area") for lb, c, _ in series] + [(lb, c, "line") for lb, c, _ in lines]
    out.append(_legend(legend, left + w + 12, top))
    out.append("</svg>")
    return "".join(out)


def _axes(left: float, top: float, w: float, h: float, xt: list, yt: list, xlabel: str, ylabel: str) -> str:
    o = [f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="#333"/>',
         f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="#333"/>']
    for x, lb in xt:
        o.append(f'<line x1="{x:.1f}" y1="{top + h}" x2="{x:.1f}" y2="{top + h + 4}" stroke="#333"/>'
                 f'<text x="{x:.1f}" y="{top + h + 15}" text-anchor="middle">{lb}</text>')
    for y, lb in yt:
        o.append(f'<line x1="{left - 4}" y1="{y:.1f}" x2="{left}" y2="{y:.1f}" stroke="#333"/>'
                 f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{lb}</text>')
    o.append(f'<text x="{left + w / 2:.1f}" y="{top + h + 29}" text-anchor="middle">{escape(xlabel)}</text>'
             f'<text x="14" y="{top + h / 2:.1f}" transform="rotate(-90 14 {top + h / 2:.1f})" '
             f'text-anchor="middle">{escape(ylabel)}</text>')
    return "".join(o)


def _legend(items: list[tuple[str, str, str]], x: float, y: float) -> str:
    o = []
    for i, (label, colour, how) in enumerate(items):
        yy = y + 16 * i
        mark = (f'<rect x="{x}" y="{yy}" width="12" height="10" fill="{colour}"/>' if how == "area" else
                f'<line x1="{x}" y1="{yy + 5}" x2="{x + 12}" y2="{yy + 5}" stroke="{colour}" stroke-width="2" '
                f'stroke-dasharray="4,2"/>')
        o.append(f'{mark}<text x="{x + 16}" y="{yy + 9}">{escape(label)}</text>')
    return "".join(o)


def stacked_bar(parts: Sequence[tuple[str, str, float]], *, width: int = 780, kind: str = "breakdown") -> str:
    """One horizontal bar split into `parts` ((label, colour, seconds)), labelled with ms and share."""
    total = sum(max(v, 0.0) for _, _, v in parts) or 1e-12
    left, w = 10, width - 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" data-chart="{kind}" width="{width}" '
           f'height="{46 + 16 * len(parts)}" font-family="sans-serif" font-size="11">']
    x = float(left)
    for label, colour, v in parts:
        dx = w * max(v, 0.0) / total
        out.append(f'<rect data-part="{escape(label)}" data-seconds="{v:.9g}" x="{x:.2f}" y="6" width="{dx:.2f}" '
                   f'height="26" fill="{colour}"><title>{escape(label)}: {fmt_ms(v)} ({v / total:.1%})</title></rect>')
        x += dx
    out.append(_legend([(f"{lb}: {fmt_ms(v)} ({v / total:.1%})", c, "area") for lb, c, v in parts], left, 40))
    out.append("</svg>")
    return "".join(out)


MIN_SLICE_PX = 2.0  # a slice narrower than this (a short collective) is drawn this wide, so it shows


def gantt(tl: Timeline, *, width: int = 780, row_h: int = 22) -> str:
    """Each track of `tl` as a row of its slices (colour: phase on compute, stream on comm), in step time, with
    the end of the forward marked and a legend of the colours. A slice is at least MIN_SLICE_PX wide; a slice
    wide enough carries its module's name."""
    left, top = 110, 8
    w = width - left - 10
    legend = _gantt_legend(tl)
    height = top + row_h * len(tl.tracks) + 34 + 16 * len(legend)
    t_max = max(tl.step_s, 1e-12)
    X = lambda t: left + w * t / t_max  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" data-chart="timeline" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">']
    row = {t: i for i, t in enumerate(tl.tracks)}
    for t, i in row.items():
        out.append(f'<text x="{left - 6}" y="{top + row_h * i + 15}" text-anchor="end">{escape(t)}</text>')
    for s in tl.spans:
        colour = PHASE_COLOURS.get(s.phase, "#888") if s.track == COMPUTE else stream_colour(s.track, tl.tracks)
        y = top + row_h * row[s.track] + 2
        dx = max(X(s.end_s) - X(s.start_s), MIN_SLICE_PX)
        out.append(f'<rect x="{X(s.start_s):.2f}" y="{y}" width="{dx:.2f}" height="{row_h - 4}" fill="{colour}">'
                   f'<title>{escape(s.name)} ({s.phase}): {fmt_ms(s.duration_s)}</title></rect>')
        label = slice_label(s.name, dx, px_per_char=6.2)
        if label:
            out.append(f'<text x="{X(s.start_s) + 2:.2f}" y="{y + row_h - 9}" font-size="9" fill="#111" '
                       f'pointer-events="none">{escape(label)}</text>')
    fx = X(tl.forward_end_s)
    y_end = top + row_h * len(tl.tracks)
    out.append(f'<line x1="{fx:.1f}" x2="{fx:.1f}" y1="{top}" y2="{y_end}" stroke="#333" stroke-dasharray="3,3"/>'
               f'<text x="{fx - 3:.1f}" y="{top - 1}" fill="#555" text-anchor="end" font-size="9">forward</text>'
               f'<text x="{fx + 3:.1f}" y="{top - 1}" fill="#555" font-size="9">backward</text>')
    out.append(_axes(left, top, w, y_end - top, [(X(v / 1e3), f"{v:.4g}") for v in _ticks(t_max * 1e3)], [],
                     "time in the step (ms)", ""))
    out.append(_legend(legend, left, y_end + 34))
    out.append("</svg>")
    return "".join(out)


def _gantt_legend(tl: Timeline) -> list[tuple[str, str, str]]:
    """The colours a timeline uses: each compute phase present, then each comm stream."""
    phases = [p for p in PHASE_COLOURS if any(s.phase == p and s.track == COMPUTE for s in tl.spans)]
    items = [(("waiting for a collective (exposed comm)" if p == "exposed comm" else p), PHASE_COLOURS[p], "area")
             for p in phases]
    return items + [(t + " (collectives)", stream_colour(t, tl.tracks), "area") for t in tl.tracks if t != COMPUTE]


def slice_label(name: str, width_px: float, *, px_per_char: float) -> str:
    """What of a slice's name fits in `width_px`: the whole name, else its module path cut from the front
    ('mlp.c_fc') with the words around it (a collective's kind, 'wait:', an instance '[3/12]') as long as they
    fit, else the path's tail alone; '' when not even a few characters fit."""
    room = int(width_px / px_per_char) - 1
    if room < 4:
        return ""
    if len(name) <= room:
        return name
    words = name.split(" ")
    k = max(range(len(words)), key=lambda i: words[i].count("."))  # the module path
    before, path, after = " ".join(words[:k]), words[k], " ".join(words[k + 1:])
    parts = path.split(".")
    tails = [".".join(parts[j:]) for j in range(1, len(parts)) if not parts[j].isdigit()]  # 'attn', not '0.attn'
    for pre, post in ((before, after), ("", after), (before, ""), ("", "")):
        for tail in tails:
            text = " ".join(x for x in (pre, tail, post) if x)
            if len(text) <= room and len(tail) >= 4:
                return text
    return ""


def compare_bars(bars: Sequence[tuple[str, str, float]], *, width: int = 780, kind: str = "measured") -> str:
    """Horizontal bars of `bars` ((label, colour, seconds)) on one scale, each labelled with its ms: a predicted
    step beside a measured one."""
    top_s = max([v for _, _, v in bars] + [1e-12])
    left, w = 190, width - 190 - 90
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" data-chart="{kind}" width="{width}" '
           f'height="{10 + 24 * len(bars)}" font-family="sans-serif" font-size="11">']
    for i, (label, colour, v) in enumerate(bars):
        y = 6 + 24 * i
        out.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{escape(label)}</text>'
                   f'<rect data-bar="{escape(label)}" data-bar-seconds="{v:.9g}" x="{left}" y="{y}" '
                   f'width="{w * v / top_s:.2f}" height="18" fill="{colour}"><title>{escape(label)}: {fmt_ms(v)}'
                   f'</title></rect><text x="{left + w * v / top_s + 4:.2f}" y="{y + 13}">{fmt_ms(v)}</text>')
    out.append("</svg>")
    return "".join(out)


def mesh_picture(shape: Sequence[int], names: Sequence[str], link_labels: Sequence[str], *,
                 max_devices: int = 64, cell: int = 34) -> str:
    """The devices of a mesh as a grid (first axis down, the others flattened across; at most `max_devices`
    drawn, the rest elided) with each axis's neighbour links coloured and labelled by `link_labels`."""
    rows = shape[0] if shape else 1
    cols = 1
    for s in shape[1:]:
        cols *= s
    r_draw, c_draw = min(rows, 8), min(cols, max(1, max_devices // min(rows, 8)))
    gap = cell // 2
    legend_h = 18 * len(names) + 10
    width = max(60 + c_draw * (cell + gap), 420)
    height = 20 + r_draw * (cell + gap) + legend_h
    colours = [PALETTE[(4 + i) % len(PALETTE)] for i in range(len(names))]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" data-chart="mesh" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="10">']
    inner = shape[-1] if len(shape) > 1 else 1
    for r in range(r_draw):
        for c in range(c_draw):
            x, y = 20 + c * (cell + gap), 10 + r * (cell + gap)
            if r + 1 < r_draw and len(shape) >= 1:  # link along axis 0
                out.append(f'<line x1="{x + cell / 2}" y1="{y + cell}" x2="{x + cell / 2}" y2="{y + cell + gap}" '
                           f'stroke="{colours[0]}" stroke-width="3"/>')
            if c + 1 < c_draw and len(shape) > 1:  # link along the innermost axis (or an outer one at its boundary)
                ax = len(shape) - 1 if (c + 1) % inner else len(shape) - 2
                out.append(f'<line x1="{x + cell}" y1="{y + cell / 2}" x2="{x + cell + gap}" y2="{y + cell / 2}" '
                           f'stroke="{colours[max(ax, 1)]}" stroke-width="3"/>')
            rank = r * cols + c
            out.append(f'<rect x="{x}" y="{y}" width="{cell}" height="{cell}" rx="4" fill="#fff" stroke="#333">'
                       f'<title>rank {rank}</title></rect><text x="{x + cell / 2}" y="{y + cell / 2 + 4}" '
                       f'text-anchor="middle">{rank}</text>')
    if r_draw < rows or c_draw < cols:
        out.append(f'<text x="20" y="{20 + r_draw * (cell + gap) - 8}" fill="#888">(showing {r_draw} x {c_draw} of '
                   f'{rows} x {cols} devices)</text>')
    y0 = 20 + r_draw * (cell + gap)
    for i, (n, s, lb) in enumerate(zip(names, shape, link_labels)):
        out.append(f'<line x1="20" y1="{y0 + 18 * i + 5}" x2="40" y2="{y0 + 18 * i + 5}" stroke="{colours[i]}" '
                   f'stroke-width="3"/><text x="46" y="{y0 + 18 * i + 9}">axis {escape(n)} = {s}: '
                   f'{escape(lb)}</text>')
    out.append("</svg>")
    return "".join(out)
