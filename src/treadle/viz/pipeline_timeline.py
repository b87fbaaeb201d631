"""The timeline of a pipelined step as `treadle.price` models it (NOTE [pipeline timeline] in
`treadle.forms.pipeline.timeline`): one track per pp rank, its stages' actions at the times the price gives.

    tl = timeline_from_price(price(pipelined_sch, inputs, cluster))   # dispatches here when price.pipeline is set

Tracks: 'pp rank r (stages ...)' holds every action of rank r — 'F3 s0' is the forward of micro-batch 3 on stage
0 (phases forward, backward, and 'weight grad' for a zero-bubble schedule's W) — then its optimizer step, and
'bubble' slices where the rank waits (for another stage's output, or for the slowest rank's end); a track per
direction of each boundary between ranks ('send s0->s1') draws its sends, each from the sending action's end
for the send's time (one after another where two would overlap: the price does not queue them).
Each rank track covers the step end to end: its slices add up to the price's step. Memory is the largest rank's
static bytes all step and its peak (static + activations in flight + transient) from the first forward to the
last backward.
"""

from __future__ import annotations

from .timeline import MemoryPoint, Span, Timeline

BUBBLE = "bubble"
SENDS = "send"  # a track per direction of each boundary: 'send s0->s1', 'send s1->s0'
_KIND = {"F": "forward", "B": "backward", "I": "backward", "W": "weight grad"}
PIPELINE_NOTE = ("drawn from treadle.price's pipeline timeline: each pp rank runs its actions in the schedule's "
                 "order; 'bubble' slices are where a rank waits for another stage")


def timeline_from_pipeline(p: dict, *, title: str | None = None, budget_bytes: float | None = None) -> Timeline:
    """The Timeline of a priced pipeline (`p`: `Price.to_dict()` with a `pipeline` entry; module doc). Raises
    ValueError for a price without one."""
    pi = p.get("pipeline")
    if not pi:
        raise ValueError("timeline_from_pipeline: the price holds no 'pipeline' entry")
    step = float(p["step_s"])
    ranks = {int(r): d for r, d in pi["ranks"].items()}
    track = {r: f"pp rank {r} (stage{'s' if len(d['stages']) > 1 else ''} {', '.join(map(str, d['stages']))})"
             for r, d in sorted(ranks.items())}
    spans: list[Span] = []
    by_rank: dict[int, list[dict]] = {}
    for sl in pi["slots"]:
        by_rank.setdefault(int(sl["rank"]), []).append(sl)
    stage_rank = {s["stage"]: s["rank"] for s in pi["stages"]}
    sends = {s["stage"]: s for s in pi["stages"]}
    fwd_end = 0.0
    first_f, last_b = step, 0.0
    link_free: dict[str, float] = {}
    for r, slots in by_rank.items():
        slots.sort(key=lambda s: s["start_s"])
        t = 0.0
        for sl in slots:
            if sl["start_s"] > t:
                spans.append(Span(track[r], BUBBLE, t, sl["start_s"] - t, BUBBLE, sl["start_s"] - t, {"rank": r}))
            phase = _KIND.get(sl["kind"], sl["kind"])
            dur = sl["end_s"] - sl["start_s"]
            args = {"stage": sl["stage"], "micro_batch": sl["mb"], "action": sl["kind"], "rank": r}
            spans.append(Span(track[r], f"{sl['kind']}{sl['mb']} s{sl['stage']}", sl["start_s"], dur, phase, dur, args))
            t = sl["end_s"]
            if sl["kind"] == "F":
                fwd_end = max(fwd_end, sl["end_s"])
                first_f = min(first_f, sl["start_s"])
            else:
                last_b = max(last_b, sl["end_s"])
            s = sl["stage"]
            # the send this action issues: an activation forward to s+1, a gradient back to s-1
            if sl["kind"] == "F" and s + 1 in stage_rank and stage_rank[s + 1] != r:
                _send(spans, link_free, sends[s], sl, f"{SENDS} s{s}->s{s + 1}", f"activation mb{sl['mb']}")
            elif sl["kind"] in ("B", "I") and s - 1 in stage_rank and stage_rank[s - 1] != r:
                _send(spans, link_free, sends[s - 1], sl, f"{SENDS} s{s}->s{s - 1}", f"gradient mb{sl['mb']}")
        opt = float(ranks[r]["optimizer_s"])
        if opt > 0:
            spans.append(Span(track[r], "optimizer", t, opt, "optimizer", opt, {"rank": r}))
            t += opt
        if step > t:  # waits for the slowest rank (and the tied gradients' all-reduce)
            spans.append(Span(track[r], BUBBLE, t, step - t, BUBBLE, step - t, {"rank": r}))
    tracks = [track[r] for r in sorted(track)] + sorted({s.track for s in spans if s.track.startswith(SENDS)})
    big = ranks[int(pi["largest_rank"])]
    static = float(big["static_bytes"])
    memory = [MemoryPoint(0.0, static, 0.0, 0.0, 0.0),
              MemoryPoint(first_f, static, 0.0, float(big["activation_bytes"]), float(big["transient_bytes"])),
              MemoryPoint(max(last_b, first_f), static, 0.0, 0.0, 0.0), MemoryPoint(step, static, 0.0, 0.0, 0.0)]
    totals = {"step_s": step, "compute_s": float(p["compute_s"]), "comm_s": float(p["exposed_comm_s"]),
              "recompute_s": float(p["recompute_s"]), "bubble_s": float(pi["bubble_s"]),
              "bubble_fraction": float(pi["bubble_fraction"])}
    name = title or (f"{pi['schedule']} over {pi['axis']}={len(ranks)}: {pi['n_stages']} stages, "
                     f"{pi['n_microbatches']} micro-batches, bubble {pi['bubble_fraction'] * 100:.1f}%")
    notes = [PIPELINE_NOTE, "critical path: " + " ".join(pi.get("critical_path", []))]
    return Timeline(name, spans, tracks, step, fwd_end, memory, float(p["peak_bytes"]), budget_bytes,
                    len(ranks), totals, notes)


def _send(spans: list[Span], link_free: dict[str, float], boundary: dict, sl: dict, track: str, name: str) -> None:
    dur = float(boundary.get("send_s", 0.0))
    if dur > 0:
        start = max(float(sl["end_s"]), link_free.get(track, 0.0))
        link_free[track] = start + dur
        spans.append(Span(track, name, start, dur, "send", 0.0,
                          {"nbytes": boundary.get("send_bytes", 0), "stage": sl["stage"], "micro_batch": sl["mb"]}))
