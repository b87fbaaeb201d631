"""A timeline of one predicted training step: slices on tracks (compute, one per communication stream) and
the per-device memory over the step. Seconds and bytes; drawn by `chrome.py`, `html.py` and `png.py`.

    tl = timeline_from_plan(plan)          # or timeline_from_costs(StepCosts(...)) from any pricing
    tl.spans[0]    # Span(track='compute', name='transformer.wte', start_s=0.0, duration_s=..., phase='forward')

Order: the forward runs the modules in order (repeated blocks expanded to their `count` instances); the
backward runs them in reverse, and a checkpointed block instance is recomputed (its modules' forwards, on the
compute track) right before its backward. A collective starts on its stream when the compute that produced
its data ends (or when the stream is free) and advances the critical path by its exposed part only, so the
part the source says is hidden runs in parallel with the compute that follows. The critical path — the end
of the last slice — is the step time.

Memory (NOTE [memory over the step]): static bytes (parameters, gradients, optimizer states) and other bytes
(buffers, inputs) are held all step; saved activations grow linearly in time over the forward to their total
and fall linearly over the backward (the sources give totals, not when each module's activations are freed);
the recomputed block's activations are held while a checkpointed instance is recomputed and back-propagated.
The source's peak (e.g. the planner's, which adds every term at once) is an upper bound of this curve.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .costs import ModuleCosts, StepCosts

COMPUTE = "compute"
MEMORY_CATEGORIES = ("static", "other", "activations", "recomputed block")


@dataclass(frozen=True, slots=True)
class Span:
    """One slice: `track` ('compute' or a comm stream such as 'comm tp'), `name` (module path, '[k/n]' for
    instance k of a repeated block), `start_s` and `duration_s` from the step start, `phase` in
    {'forward', 'backward', 'recompute'}, `exposed_s` of the duration on the critical path, and `args`
    (FLOPs, bytes, axes, layout: whatever the source knows)."""

    track: str
    name: str
    start_s: float
    duration_s: float
    phase: str
    exposed_s: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True, slots=True)
class MemoryPoint:
    """Per-device bytes at time `t_s`, by category (MEMORY_CATEGORIES)."""

    t_s: float
    static_bytes: float
    other_bytes: float
    activation_bytes: float
    transient_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.static_bytes + self.other_bytes + self.activation_bytes + self.transient_bytes

    def by_category(self) -> dict[str, float]:
        return dict(zip(MEMORY_CATEGORIES, (self.static_bytes, self.other_bytes, self.activation_bytes,
                                            self.transient_bytes)))


@dataclass(slots=True)
class Timeline:
    """Slices and memory of one step. `tracks` in display order; `totals` are the source's own figures
    (step_s, compute_s, comm_s, recompute_s) for comparison; `peak_bytes` is the source's peak and
    `budget_bytes` the memory budget (None: unlimited); `forward_end_s` splits the step."""

    title: str
    spans: list[Span]
    tracks: list[str]
    step_s: float
    forward_end_s: float
    memory: list[MemoryPoint]
    peak_bytes: float
    budget_bytes: float | None
    world_size: int
    totals: dict[str, float]
    notes: list[str] = field(default_factory=list)

    def breakdown(self) -> dict[str, float]:
        """Seconds on the critical path by kind: 'forward', 'backward', 'recompute', 'optimizer' (compute
        track) and 'comm <axes>' per stream (exposed part only)."""
        out: dict[str, float] = {}
        for s in self.spans:
            if s.phase == "exposed comm":  # a wait on the compute track: counted on its comm stream
                continue
            key = s.phase if s.track == COMPUTE else s.track
            out[key] = out.get(key, 0.0) + s.exposed_s
        return out

    def hidden_comm_s(self) -> float:
        """Communication seconds running in parallel with compute (not on the critical path)."""
        return sum(s.duration_s - s.exposed_s for s in self.spans if s.track != COMPUTE)


# ----------------------------------------------------------------------------- layout
def _segments(modules: list[ModuleCosts]) -> list[list[ModuleCosts]]:
    """Consecutive modules of the same repeated block form one segment; every other module is its own."""
    segs: list[list[ModuleCosts]] = []
    for m in modules:
        if m.block is not None and segs and segs[-1][0].block == m.block and segs[-1][0].count == m.count:
            segs[-1].append(m)
        else:
            segs.append([m])
    return segs


def recomputed_instances(count: int, recomputed: int) -> set[int]:
    """Which of `count` block instances are recomputed: `recomputed` of them evenly spaced, the first
    included (as the planner spreads checkpoints over a block's instances)."""
    if recomputed <= 0:
        return set()
    if recomputed >= count:
        return set(range(count))
    return {int(i * count / recomputed) for i in range(recomputed)}


class _Layout:
    def __init__(self) -> None:
        self.t = 0.0
        self.spans: list[Span] = []
        self.track_end: dict[str, float] = {}

    def compute(self, name: str, seconds: float, phase: str, args: dict) -> None:
        if seconds <= 0:
            return
        self.spans.append(Span(COMPUTE, name, self.t, seconds, phase, seconds, args))
        self.t += seconds

    def comm(self, name: str, stream: str, seconds: float, exposed_s: float, phase: str, args: dict) -> None:
        if seconds <= 0:
            return
        start = max(self.t, self.track_end.get(stream, 0.0))  # streams run their collectives in order
        self.spans.append(Span(stream, name, start, seconds, phase, exposed_s, args))
        self.track_end[stream] = start + seconds
        self.t += exposed_s


def _instance_name(m: ModuleCosts, k: int | None) -> str:
    return m.path if k is None else f"{m.path} [{k + 1}/{m.count}]"


def _forward(lay: _Layout, m: ModuleCosts, k: int | None, n: int, phase: str = "forward") -> None:
    name = _instance_name(m, k)
    args = dict(m.args, module=m.path, executions=m.count)
    if phase == "recompute":
        lay.compute(name, m.recompute_s / max(m.recomputed, 1), "recompute", args)
        return
    lay.compute(name, m.forward_s / n, "forward", args)
    for c in m.comm:
        if c.phase == "forward":
            lay.comm(name, c.stream, c.seconds / n, c.exposed_s / n, "forward", _comm_args(args, c))


def _comm_args(args: dict, c) -> dict:
    out = dict(args, axes=list(c.axes))
    if c.collectives:
        out["collectives"] = list(c.collectives)
    return out


def _backward(lay: _Layout, m: ModuleCosts, k: int | None, n: int) -> None:
    name = _instance_name(m, k)
    args = dict(m.args, module=m.path, executions=m.count)
    lay.compute(name, m.backward_s / n, "backward", args)
    for c in m.comm:
        if c.phase == "backward":
            lay.comm(name, c.stream, c.seconds / n, c.exposed_s / n, "backward", _comm_args(args, c))


def _memory(costs: StepCosts, fwd_end: float, step: float, ckpt_windows: list[tuple[float, float]],
            times: list[float]) -> list[MemoryPoint]:
    mem = costs.memory
    A, T = mem.activation_bytes, mem.transient_bytes

    def act(t: float) -> float:
        if t <= fwd_end:
            return A * (t / fwd_end if fwd_end > 0 else 1.0)
        return A * max(0.0, 1.0 - (t - fwd_end) / (step - fwd_end)) if step > fwd_end else 0.0

    edges = sorted(set([0.0, fwd_end, step] + times + [t for w in ckpt_windows for t in w]))
    out: list[MemoryPoint] = []
    for t in edges:
        before = T if any(a < t <= b for a, b in ckpt_windows) else 0.0
        after = T if any(a <= t < b for a, b in ckpt_windows) else 0.0
        if before != after:  # a step: the value just before, then the value from t on
            out.append(MemoryPoint(t, mem.static_bytes, mem.other_bytes, act(t), before))
        out.append(MemoryPoint(t, mem.static_bytes, mem.other_bytes, act(t), after))
    return out


def timeline_from_costs(costs: StepCosts) -> Timeline:
    """Lay out `costs` (see the module doc). The step ends at `costs.step_s` when the costs are consistent:
    compute, recompute and exposed communication add up to it, and no hidden collective outlasts the compute
    after it."""
    lay = _Layout()
    segs = _segments(costs.modules)
    for seg in segs:
        n = seg[0].count if seg[0].block is not None else 1
        for k in range(n):
            for m in seg:
                _forward(lay, m, k if n > 1 else None, n)
    fwd_end = lay.t
    windows: list[tuple[float, float]] = []
    for seg in reversed(segs):
        n = seg[0].count if seg[0].block is not None else 1
        again = recomputed_instances(n, seg[0].recomputed) if seg[0].block is not None else set()
        for k in reversed(range(n)):
            start = lay.t
            if k in again:
                for m in seg:
                    _forward(lay, m, k if n > 1 else None, n, phase="recompute")
            for m in reversed(seg):
                _backward(lay, m, k if n > 1 else None, n)
            if k in again:
                windows.append((start, lay.t))
    step = max([lay.t] + [s.end_s for s in lay.spans])  # a collective still running ends the step
    times = [s.end_s for s in lay.spans if s.track == COMPUTE]
    tracks = [COMPUTE] + [s for s in costs.streams if any(x.track == s for x in lay.spans)]
    tracks += sorted({s.track for s in lay.spans} - set(tracks))
    totals = {"step_s": costs.step_s, "compute_s": costs.compute_s, "comm_s": costs.comm_s,
              "recompute_s": costs.recompute_s}
    return Timeline(costs.title, lay.spans, tracks, step, fwd_end, _memory(costs, fwd_end, step, windows, times),
                    costs.memory.peak_bytes, costs.memory.budget_bytes, costs.world_size, totals, list(costs.notes))


