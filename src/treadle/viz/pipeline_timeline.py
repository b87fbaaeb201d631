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


MEASURED_NOTE = ("measured by treadle.run --trace: each pp rank's actions as its stages ran them (perf_counter "
                 "around each, after a barrier; gaps are waits: a receive, the bubble, the schedule's own work); "
                 "'sync' is the tied gradients' and the replicas' all-reduce, 'optimizer' the norm, clip and AdamW")


def timeline_from_measured_pipeline(doc: dict) -> Timeline:
    """The Timeline of a measured pipelined step (`doc`: what `measured_pipeline_doc` wrote: per pp rank its
    stages, its actions (stage, kind, micro-batch, start, end) in seconds from the step's start, and its step
    end), drawn as the predicted one is: a track per pp rank, F/B/I/W slices per micro-batch, 'bubble' where it
    waits. Its bubble fraction is the price's measure (idle over the makespan of the actions, summed over ranks)."""
    ranks = sorted(doc["ranks"], key=lambda d: d["pp"])
    track = {d["pp"]: f"pp rank {d['pp']} (stage{'s' if len(d['stages']) > 1 else ''} "
                      f"{', '.join(map(str, d['stages']))})" for d in ranks}
    step = max(float(d["end_s"]) for d in ranks)
    makespan = max((a[4] for d in ranks for a in d["actions"] if a[1] != "sync"), default=0.0)
    spans: list[Span] = []
    idle = 0.0
    fwd_end = 0.0
    for d in ranks:
        r, t = d["pp"], 0.0
        for stage, kind, mb, start, end in sorted(d["actions"], key=lambda a: a[3]):
            if start > t:
                spans.append(Span(track[r], BUBBLE, t, start - t, BUBBLE, start - t, {"rank": r}))
            dur = end - start
            phase = "sync" if kind == "sync" else ("forward" if kind == "loss" else _KIND.get(kind, kind))
            name = ("grad sync" if kind == "sync" else f"loss{mb} s{stage}" if kind == "loss"
                    else f"{kind}{mb} s{stage}")
            spans.append(Span(track[r], name, start, dur, phase, dur,
                              {"stage": stage, "micro_batch": mb, "action": kind, "rank": r}))
            t = max(t, end)
            if kind == "F":
                fwd_end = max(fwd_end, end)
        idle += makespan - busy_s(d["actions"])
        if float(d["end_s"]) > t:
            spans.append(Span(track[r], "optimizer", t, float(d["end_s"]) - t, "optimizer", float(d["end_s"]) - t,
                              {"rank": r}))
            t = float(d["end_s"])
        if step > t:
            spans.append(Span(track[r], BUBBLE, t, step - t, BUBBLE, step - t, {"rank": r}))
    bubble = idle / (makespan * len(ranks)) if makespan > 0 else 0.0
    mem = max(int(d.get("mem_bytes", 0)) for d in ranks)
    memory = [MemoryPoint(0.0, float(mem), 0.0, 0.0, 0.0), MemoryPoint(step, float(mem), 0.0, 0.0, 0.0)]
    totals = {"step_s": step, "makespan_s": makespan, "bubble_fraction": bubble}
    name = (f"measured {doc.get('schedule', 'pipeline')} over {doc.get('axis', 'pp')}={len(ranks)}: "
            f"{doc.get('n_stages', '?')} stages, {doc.get('n_microbatches', '?')} micro-batches, "
            f"bubble {bubble * 100:.1f}%")
    return Timeline(name, spans, [track[d["pp"]] for d in ranks], step, fwd_end, memory, float(mem), None,
                    int(doc.get("world_size", len(ranks))), totals, [MEASURED_NOTE])

def busy_s(actions: list) -> float:
    """Seconds a pp rank computed in its measured `actions` (its stages' actions and the loss; not the syncs)."""
    return sum(end - start for _, kind, _, start, end in actions if kind != "sync")


def pipeline_compare_rows(price: dict, measured: dict) -> list[list[str]]:
    """Predicted (`price`: `Price.to_dict()` of a pipeline) beside measured (`measured_pipeline` document): a row
    per pp rank (its stages, busy ms predicted / measured and their ratio), then the step and the bubble fraction.
    Raises ValueError when the two are not the same pipeline (pp ranks, stages)."""
    pi = price.get("pipeline")
    if not pi:
        raise ValueError("the price holds no 'pipeline' entry: --measured compares pipelines")
    pred = {int(r): d for r, d in pi["ranks"].items()}
    meas = {d["pp"]: d for d in measured["ranks"]}
    if {r: list(d["stages"]) for r, d in pred.items()} != {r: list(d["stages"]) for r, d in meas.items()}:
        raise ValueError(f"the measured pipeline holds stages {[meas[r]['stages'] for r in sorted(meas)]} per pp "
                         f"rank, the priced one {[pred[r]['stages'] for r in sorted(pred)]}: not the same pipeline")
    mtl = timeline_from_measured_pipeline(measured)

    def ratio(a: float, b: float) -> str:
        return f"{b / a:.2f}" if a > 0 else "-"

    rows = []
    for r in sorted(pred):
        busy = busy_s(meas[r]["actions"])
        rows.append([f"pp rank {r}", ", ".join(map(str, pred[r]["stages"])), f"{pred[r]['busy_s'] * 1e3:.2f}",
                     f"{busy * 1e3:.2f}", ratio(pred[r]["busy_s"], busy)])
    rows.append(["step", "", f"{price['step_s'] * 1e3:.2f}", f"{mtl.step_s * 1e3:.2f}",
                 ratio(price["step_s"], mtl.step_s)])
    rows.append(["bubble fraction", "", f"{pi['bubble_fraction'] * 100:.1f}%",
                 f"{mtl.totals['bubble_fraction'] * 100:.1f}%", ""])
    return rows


COMPARE_HEAD = ("", "stages", "predicted ms", "measured ms", "measured / predicted")
