"""When communication overlaps compute: a one-step timeline of compute segments and collectives. Pure functions.

NOTE [overlap model]. A training step on one rank is a sequence of compute *segments* (module, phase,
seconds) run back to back, and a set of collectives. Each collective runs on the channel of its mesh
axis; collectives on one axis run one after another (FIFO, as a process group does), different axes
run concurrently. A collective is either

- *blocking* (``issue_after = i``, ``blocking=True``): issued after segment i and waited on at once —
  tensor-parallel collectives inside a module's forward or backward (the runtime calls them
  synchronously), so their whole time is on the critical path; or
- *asynchronous* (``blocking=False``): issued at the end of segment ``issue_after`` (-1: at the start of
  the step) and waited on before segment ``needed_before`` starts (None: at the end of the step, before
  the optimizer) — DDP buckets, FSDP2 gathers (prefetched) and reduce-scatters.

With ``t_c`` the collective's alpha-beta time and ``free[axis]`` when its channel is next idle:

    start_c = max(issue time of c, free[axis_c]);   end_c = start_c + t_c;   free[axis_c] = end_c
    a segment i starts at max(end of segment i-1, end_c for every c with needed_before = i)
    step_s = max(end of the last segment, end_c for every c)
    exposed_s = step_s - compute_s            (the part of communication compute waited for)

A collective may also wait for another one issued before it (``follows``: HSDP's all-reduce of a gradient
shard starts once its reduce-scatter ends): ``start_c = max(..., end_follows)``.

A blocking collective issued soon after the previous one pays less of its link's drift (NOTE [lead-dependent
skew] in `treadle.cost.calibrate`): with ``lead = issue time - sync`` (``sync``: when the rank last left a
blocking collective, 0 at the step's start) its time is ``t_c - skew_s * max(0, 1 - lead / skew_lead_s)``
(`LinkSpec.short_lead_saving_s`; ``skew_s = 0`` on links without measured drift, e.g. every GPU preset).

Each wait is split exactly among the collectives waited on, in order of their end times, so the
per-collective ``exposed_s`` sum to the step's exposed communication. With ``overlap=False`` (a device
whose ranks have no core to spare for communication threads, e.g. gloo ranks sharing CPU cores) every
collective is blocking at its issue point: ``step_s = compute_s + sum t_c``.

How data parallelism fills the timeline (DDP's buckets, FSDP2's gathers) is the data-parallel form's
(`treadle.forms.data`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .links import LinkSpec

@dataclass(frozen=True, slots=True)
class Segment:
    """Compute run back to back: `module` path, `phase` ("fwd", "bwd", "recompute", "optim"), seconds."""

    module: str
    phase: str
    compute_s: float


@dataclass(slots=True)
class Collective:
    """One collective of the step. `kind`: "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
    "broadcast"; `axis`: the mesh axis (or axes joined by ","); `nbytes` as the cost function takes it;
    `time_s` its alpha-beta time. Timing follows NOTE [overlap model]; `start_s`, `end_s` and
    `exposed_s` are filled in by `simulate`. `source`: "tp" (inside a module), "ep" (an experts module's
    exchanges), "ddp", "fsdp"."""

    kind: str
    axis: str
    nbytes: float
    time_s: float
    module: str
    phase: str
    issue_after: int
    blocking: bool = True
    needed_before: int | None = None
    source: str = "tp"
    follows: "Collective | None" = None  # starts once this one ends (HSDP: all-reduce after reduce-scatter)
    link: "LinkSpec | None" = None  # its link, for the short-lead saving of a blocking call (None: no saving)
    start_s: float = 0.0
    end_s: float = 0.0
    exposed_s: float = 0.0


@dataclass(slots=True)
class Timeline:
    """The simulated step: per-segment start times, the collectives with their times, and totals (s)."""

    segment_start_s: list[float]
    collectives: list[Collective]
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    overlapped_comm_s: float = field(default=0.0)


def simulate(segments: list[Segment], collectives: list[Collective], *, overlap: bool = True) -> Timeline:
    """The step's timeline under NOTE [overlap model]. `collectives` are updated in place (start, end,
    exposed) and returned in the Timeline. Raises ValueError for an `issue_after` / `needed_before` outside
    the segments or a collective needed before it is issued."""
    n = len(segments)
    for c in collectives:
        if not -1 <= c.issue_after < n:
            raise ValueError(f"collective {c.kind} on {c.axis} at {c.module!r}: issue_after {c.issue_after} "
                             f"outside the {n} segments")
        if c.needed_before is not None and not c.issue_after < c.needed_before <= n:
            raise ValueError(f"collective {c.kind} on {c.axis} at {c.module!r}: needed before segment "
                             f"{c.needed_before}, issued after segment {c.issue_after}")
    if not overlap:
        for c in collectives:
            c.blocking = True
    issued: dict[int, list[Collective]] = {}
    for c in collectives:
        issued.setdefault(c.issue_after, []).append(c)
    waits: dict[int, list[Collective]] = {}
    for c in collectives:
        if not c.blocking:
            waits.setdefault(n if c.needed_before is None else c.needed_before, []).append(c)
    free: dict[str, float] = {}
    now = 0.0
    sync = 0.0  # when the rank last left a blocking collective (its group's ranks were together then)
    starts: list[float] = []

    def issue(after: int) -> None:
        nonlocal sync
        for c in issued.get(after, []):
            if c.blocking and c.link is not None:  # NOTE [lead-dependent skew]
                c.time_s = max(c.time_s - c.link.short_lead_saving_s(now - sync), 0.0)
            c.start_s = max(now, free.get(c.axis, 0.0), c.follows.end_s if c.follows is not None else 0.0)
            c.end_s = c.start_s + c.time_s
            free[c.axis] = c.end_s
            if c.blocking:
                _wait([c])
                sync = now

    def _wait(cs: list[Collective]) -> None:
        nonlocal now
        for c in sorted(cs, key=lambda x: x.end_s):
            if c.end_s > now:
                c.exposed_s += c.end_s - now
                now = c.end_s

    issue(-1)
    for i, seg in enumerate(segments):
        _wait(waits.get(i, []))
        starts.append(now)
        now += seg.compute_s
        issue(i)
    _wait(waits.get(n, []))
    compute = math.fsum(s.compute_s for s in segments)
    comm = math.fsum(c.time_s for c in collectives)
    exposed = max(0.0, now - compute)
    return Timeline(starts, collectives, now, compute, comm, exposed, max(0.0, comm - exposed))


__all__ = ["Segment", "Collective", "Timeline", "simulate"]
