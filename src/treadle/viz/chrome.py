"""Chrome Trace Event Format export of a Timeline, and a validator of that format (for predicted and measured
traces alike). Opens in https://ui.perfetto.dev and chrome://tracing.

The format (Chrome "Trace Event Format" document): a JSON object whose "traceEvents" list holds events with
`ph` (phase), `pid`, `tid`, `ts` (microseconds) and `name`; "X" (complete) events also have `dur`
(microseconds); "M" (metadata) events name processes and threads (`args.name`); "C" (counter) events carry
numeric `args`. One process is the predicted step of one device; each track is a thread (compute first, then
one per communication stream); memory is a counter; the `cat` of a slice is its phase.
"""

from __future__ import annotations

import json
from typing import Any

from .timeline import Timeline

PID = 1
EXPOSED_MS = ("args.exposed_ms of a slice: its time on the critical path (a compute slice: all of it; a collective: "
              "its exposed part; a wait on the compute track: the exposed part of the collective it waits for, "
              "counted once in breakdown_ms, on the collective's stream)")
_US = 1e6
_REQUIRED = {"X": ("name", "ph", "ts", "dur", "pid", "tid"), "M": ("name", "ph", "pid", "args"),
             "C": ("name", "ph", "ts", "pid", "args"), "B": ("name", "ph", "ts", "pid", "tid"),
             "E": ("ph", "ts", "pid", "tid"), "i": ("name", "ph", "ts", "pid"), "I": ("name", "ph", "ts", "pid")}


def _clean(v: Any) -> Any:
    """JSON-safe args: numbers, strings, lists and dicts of them."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return str(v)


def chrome_trace(tl: Timeline, *, process: str = "treadle predicted step") -> dict:
    """The trace of `tl` as a dict ready for `json.dump`: ts and dur in microseconds (floats, ns resolution);
    `process` opens its process name ('treadle measured step' for a measured timeline)."""
    tid = {t: i + 1 for i, t in enumerate(tl.tracks)}
    ev: list[dict] = [{"name": "process_name", "ph": "M", "pid": PID, "tid": 0,
                       "args": {"name": f"{process}: {tl.title} (one of {tl.world_size} devices)"}}]
    for t, i in tid.items():
        ev.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": i, "args": {"name": t}})
        ev.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": i, "args": {"sort_index": i}})
    for s in sorted(tl.spans, key=lambda s: (tid[s.track], s.start_s)):
        args = dict(s.args, phase=s.phase, exposed_ms=round(s.exposed_s * 1e3, 6))
        ts, end = round(s.start_s * _US, 3), round(s.end_s * _US, 3)  # dur from rounded ends: no overlap
        ev.append({"name": s.name, "cat": s.phase, "ph": "X", "pid": PID, "tid": tid[s.track],
                   "ts": ts, "dur": round(end - ts, 3), "args": _clean(args)})
    for p in tl.memory:
        ev.append({"name": "memory bytes", "ph": "C", "pid": PID, "ts": round(p.t_s * _US, 3),
                   "args": {k: int(v) for k, v in p.by_category().items()}})
    meta = {"tool": "treadle", "title": tl.title, "step_ms": tl.step_s * 1e3, "forward_end_ms": tl.forward_end_s * 1e3,
            "totals_ms": {k: v * 1e3 for k, v in tl.totals.items()},
            "breakdown_ms": {k: v * 1e3 for k, v in tl.breakdown().items()},
            "peak_bytes": tl.peak_bytes, "budget_bytes": tl.budget_bytes, "notes": tl.notes,
            "exposed_ms": EXPOSED_MS}
    return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": _clean(meta)}


def write_chrome_trace(tl: Timeline, path: str) -> str:
    """Write `chrome_trace(tl)` to `path` (JSON) and return the path."""
    with open(path, "w") as f:
        json.dump(chrome_trace(tl), f)
    return path


def validate_chrome_trace(doc: dict, *, tol_us: float = 1e-3) -> list[str]:
    """Problems of a Chrome trace (empty when valid): a missing "traceEvents" list, events without the keys
    their `ph` requires, non-numeric or negative ts/dur, process/thread names that are not strings, and "X"
    slices of one (pid, tid) that overlap without nesting (each track's slices, sorted by ts, must be disjoint
    or nested)."""
    errs: list[str] = []
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        return ["no 'traceEvents' list"]
    per_track: dict[tuple, list[tuple[float, float, str]]] = {}
    for i, e in enumerate(events):
        ph = e.get("ph") if isinstance(e, dict) else None
        if ph is None:
            errs.append(f"event {i}: no 'ph'")
            continue
        for k in _REQUIRED.get(ph, ("ph",)):
            if k not in e:
                errs.append(f"event {i} (ph {ph!r}, name {e.get('name')!r}): missing {k!r}")
        for k in ("ts", "dur"):
            if k in e and (not isinstance(e[k], (int, float)) or e[k] < 0):
                errs.append(f"event {i} ({e.get('name')!r}): {k} must be a number >= 0, got {e[k]!r}")
        if ph == "M" and e.get("name") in ("process_name", "thread_name") and \
                not isinstance(e.get("args", {}).get("name"), str):
            errs.append(f"event {i}: metadata {e.get('name')!r} without a string args.name")
        if ph == "X" and all(k in e for k in ("ts", "dur", "pid", "tid")):
            per_track.setdefault((e["pid"], e["tid"]), []).append((float(e["ts"]), float(e["dur"]), str(e.get("name"))))
    for key, xs in per_track.items():
        xs.sort(key=lambda x: (x[0], -x[1]))
        stack: list[float] = []  # ends of the open enclosing slices
        for ts, dur, name in xs:
            while stack and ts >= stack[-1] - tol_us:
                stack.pop()
            if stack and ts + dur > stack[-1] + tol_us:
                errs.append(f"track {key}: slice {name!r} at {ts} us overlaps the slice before it without nesting")
            stack.append(ts + dur)
    return errs


def track_names(doc: dict) -> dict[tuple, str]:
    """{(pid, tid): thread name} from the "M" thread_name events of a trace."""
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in doc.get("traceEvents", [])
            if e.get("ph") == "M" and e.get("name") == "thread_name"}


def merge_chrome_traces(docs: list[dict]) -> dict:
    """Several traces in one document, each its own process (pid 1, 2, ... in order: e.g. the predicted step and
    the measured one, side by side in Perfetto); the first's otherData, the others' under otherData.merged."""
    events: list[dict] = []
    for i, doc in enumerate(docs, start=1):
        for e in doc.get("traceEvents", []):
            events.append(dict(e, pid=i))
    other = dict(docs[0].get("otherData", {})) if docs else {}
    if len(docs) > 1:
        other["merged"] = [d.get("otherData", {}) for d in docs[1:]]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
