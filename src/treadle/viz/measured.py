"""A measured step as a Chrome trace (torch.profiler), to open beside the predicted one.

    def step():                                   # one training step of the built model, on this rank
        loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()
    measured_trace(step, f"measured-rank{rank}.json", steps=2)   # then: treadle explain plan.json --trace ...

Each measured step is wrapped in a `record_function("treadle step <i>")` range, so `step_times_s` reads the
step times back from the file. Under torchrun call it on every rank with a per-rank path. Warm-up steps run
before the profiler starts (first-call allocations and lazy initialisation stay out of the trace).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Callable, Iterator

import torch

STEP_PREFIX = "treadle step "


def measured_trace(step: Callable[[], Any], path: str, *, steps: int = 1, warmup: int = 1,
                   record_shapes: bool = False) -> str:
    """Run `step()` `warmup` times, then `steps` times under torch.profiler (CPU, plus CUDA when available),
    and write the Chrome trace to `path`. Returns `path`. Raises ValueError for steps < 1 or warmup < 0."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"measured_trace: needs steps >= 1 and warmup >= 0; got steps={steps}, warmup={warmup}")
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        for i in range(steps):
            with record_function(f"{STEP_PREFIX}{i}"):
                step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    return path


@contextlib.contextmanager
def profiled_step(path: str, index: int = 0) -> Iterator[None]:
    """A context manager around one step already running in a loop (e.g. `treadle.run --trace`): the code
    inside runs under torch.profiler as range ``treadle step <index>``; the Chrome trace goes to `path` on exit."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        with record_function(f"{STEP_PREFIX}{index}"):
            yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def step_times_s(doc: dict) -> list[float]:
    """Durations (s) of the "treadle step <i>" ranges of a trace written by `measured_trace`, in step order."""
    steps = [(e["name"], e["dur"]) for e in doc.get("traceEvents", []) if e.get("ph") == "X"
             and str(e.get("name", "")).startswith(STEP_PREFIX) and e.get("cat") == "user_annotation"]
    steps.sort(key=lambda x: int(x[0][len(STEP_PREFIX):]))
    return [float(d) / 1e6 for _, d in steps]


def load_trace(path: str) -> dict:
    """A Chrome trace file as a dict."""
    with open(path) as f:
        return json.load(f)
