"""The timeline of a step exactly as `treadle.pricing` models it (NOTE [overlap model] in
`treadle.cost.overlap`): no attribution, no re-layout — the price's own segments and collectives.

    tl = timeline_from_price(price(sch, inputs, cluster))     # a Price, or its to_dict() (plan.price)

Tracks: 'compute' holds every compute segment at its `start_s` (phases forward, backward, recompute and
the optimizer step), and, in the gaps where compute waits, one 'exposed comm' slice per collective waited
on (its `exposed_s` is its whole duration, the collective's exposed part; `Timeline.breakdown` counts that
time once, on the collective's stream): collective c delays compute over [end_s - exposed_s, end_s] (the
simulation advances the critical path to each awaited collective's end in turn), so the compute track covers
the step end to end and its slices add up to ``step_s = compute_s + recompute_s + exposed_comm_s``. Each
collective is a slice on its mesh axis's stream ('comm tp', 'comm dp') from `start_s` to `end_s`; one axis
runs its collectives in order (disjoint slices), different axes and compute run in parallel, so an overlapped
collective shows beside the compute it hides behind. Args: module, phase, FLOPs / bytes / ops of a segment; kind, axis,
nbytes, source (tp, ddp, fsdp), blocking and exposed seconds of a collective.

Memory (NOTE [price memory over the step]): the price gives totals, not times. Static bytes (parameters,
optimizer state, buffers, inputs, DDP buckets) are held all step; saved activations grow linearly over
the forward to `activation_bytes` and fall linearly over the backward; `transient_bytes` (gradients as
they appear, temporaries, a recomputed block, FSDP2's gathered units) are held from the end of the forward
to the end of the backward. The curve's maximum, at the end of the forward, is the price's `peak_bytes`.
"""

from __future__ import annotations

from typing import Any

from .timeline import COMPUTE, MemoryPoint, Span, Timeline

WAIT = "exposed comm"  # phase of the compute track's waiting slices (their time is the collective's exposed part)
_PHASES = {"fwd": "forward", "bwd": "backward", "recompute": "recompute", "optim": "optimizer"}
PRICE_NOTE = ("drawn from treadle.price: compute segments and collectives at the times its overlap model gives; "
              "'exposed comm' slices on the compute track are where compute waits for a collective")


def _as_dict(price: Any) -> dict:
    if isinstance(price, dict):
        return price
    if hasattr(price, "to_dict"):
        return price.to_dict()
    raise TypeError(f"timeline_from_price needs a treadle.pricing.Price or its to_dict(), got "
                    f"{type(price).__name__}")


def _stream(axis: str) -> str:
    return "comm " + axis.replace(",", "+")


def _memory(p: dict, fwd_end: float, bwd_end: float, step: float) -> list[MemoryPoint]:
    static, act, tr = float(p["static_bytes"]), float(p["activation_bytes"]), float(p["transient_bytes"])

    def act_at(t: float) -> float:
        if t <= fwd_end:
            return act * (t / fwd_end if fwd_end > 0 else 1.0)
        span = bwd_end - fwd_end
        return act * max(0.0, 1.0 - (t - fwd_end) / span) if span > 0 else 0.0

    pts = [MemoryPoint(0.0, static, 0.0, 0.0, 0.0), MemoryPoint(fwd_end, static, 0.0, act, 0.0),
           MemoryPoint(fwd_end, static, 0.0, act, tr), MemoryPoint(bwd_end, static, 0.0, act_at(bwd_end), tr),
           MemoryPoint(bwd_end, static, 0.0, act_at(bwd_end), 0.0)]
    if step > bwd_end:
        pts.append(MemoryPoint(step, static, 0.0, 0.0, 0.0))
    return pts


def timeline_from_price(price: Any, *, title: str | None = None, world_size: int | None = None,
                        budget_bytes: float | None = None) -> Timeline:
    """The step of `price` (a `Price` or `Price.to_dict()`, e.g. `plan.price`) as a Timeline (module doc).
    `title` defaults to the price's data parallelism and device; `world_size` to 1 (the price is one
    device's). Raises ValueError when the price holds no segments (a price dict of another format) or its
    slices do not add up to its `step_s` (within 1e-6 relative: a hand-edited price)."""
    p = _as_dict(price)
    if p.get("pipeline"):  # one track per pp rank (NOTE [pipeline timeline])
        from .pipeline_timeline import timeline_from_pipeline

        return timeline_from_pipeline(p, title=title, budget_bytes=budget_bytes)
    segs = p.get("segments")
    if not segs:
        raise ValueError("timeline_from_price: the price holds no 'segments' (write it with "
                         "treadle.pricing.price(...).to_dict())")
    spans: list[Span] = []
    fwd_end = 0.0
    bwd_end = 0.0
    for s in segs:
        phase = _PHASES.get(s["phase"], s["phase"])
        if s["compute_s"] <= 0:
            continue
        args = {"module": s["module"] or "<root>", "phase": phase}
        for k in ("flops", "bytes", "ops"):
            if s.get(k) is not None:
                args[k] = s[k]
        spans.append(Span(COMPUTE, s["module"] or "<root>", s["start_s"], s["compute_s"], phase, s["compute_s"], args))
        end = s["start_s"] + s["compute_s"]
        if phase == "forward":
            fwd_end = max(fwd_end, end)
        elif phase in ("backward", "recompute"):
            bwd_end = max(bwd_end, end)
    streams: list[str] = []
    for c in sorted(p.get("collectives") or [], key=lambda c: (c["start_s"], c["end_s"])):
        stream = _stream(c["axis"])
        if stream not in streams:
            streams.append(stream)
        phase = _PHASES.get(c["phase"], c["phase"])
        name = f"{c['kind']} {c['module'] or '<root>'}"
        args = {"module": c["module"] or "<root>", "phase": phase, "kind": c["kind"], "axis": c["axis"],
                "nbytes": c["nbytes"], "source": c.get("source"), "blocking": c.get("blocking"),
                "exposed_s": c["exposed_s"], "time_s": c.get("time_s", c["end_s"] - c["start_s"])}
        dur = c["end_s"] - c["start_s"]
        if dur > 0:
            spans.append(Span(stream, name, c["start_s"], dur, phase, min(c["exposed_s"], dur), args))
        if c["exposed_s"] > 0:  # the wait it causes on the critical path
            spans.append(Span(COMPUTE, f"wait: {name}", c["end_s"] - c["exposed_s"], c["exposed_s"], WAIT,
                              c["exposed_s"], dict(args, stream=stream)))  # all of a wait is on the critical path
    step = float(p["step_s"])
    on_path = sum(s.duration_s for s in spans if s.track == COMPUTE)
    if abs(on_path - step) > 1e-6 * max(step, 1e-12) + 1e-12:
        raise ValueError(f"timeline_from_price: the compute track adds up to {on_path:.6g} s but the price's step is "
                         f"{step:.6g} s; the price is inconsistent")
    streams.sort(key=lambda s: (s.count("+"), s))
    device = p.get("device") or {}
    dev_name = device.get("name", "device") if isinstance(device, dict) else str(device)
    totals = {"step_s": step, "compute_s": float(p["compute_s"]), "comm_s": float(p["exposed_comm_s"]),
              "recompute_s": float(p["recompute_s"]), "all_comm_s": float(p["comm_s"]),
              "overlapped_comm_s": float(p.get("overlapped_comm_s", 0.0))}
    memory = _memory(p, fwd_end, max(bwd_end, fwd_end), step)
    return Timeline(title or f"{p.get('data_parallel', '')} on {dev_name}".strip(), spans, [COMPUTE] + streams, step,
                    fwd_end, memory, float(p["peak_bytes"]), budget_bytes, world_size or 1, totals, [PRICE_NOTE])


def mesh_roles_text(names: list[str] | tuple[str, ...], shape: list[int] | tuple[int, ...], *,
                    data_axes: set[str] | frozenset[str] = frozenset(), tensor_axes: set[str] | frozenset[str] =
                    frozenset(), pipeline_axes: set[str] | frozenset[str] = frozenset()) -> str:
    """Every axis of a mesh with what it does: 'dp=2 data-parallel x tp=2 tensor', 'pp=2 pipeline' (an axis
    with none of these roles is 'replicated'; a size-1 axis just its size)."""
    def role(a: str, n: int) -> str:
        if n == 1:
            return f"{a}=1"
        kind = ("pipeline" if a in pipeline_axes else
                "data-parallel" + (" + tensor" if a in tensor_axes else "") if a in data_axes else
                "tensor" if a in tensor_axes else "replicated")
        return f"{a}={n} {kind}"
    return " x ".join(role(a, n) for a, n in zip(names, shape))


__all__ = ["timeline_from_price", "mesh_roles_text", "WAIT", "PRICE_NOTE"]
