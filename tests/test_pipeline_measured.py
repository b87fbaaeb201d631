"""A pipeline's measured actions (`PipelineModel.recording()`, what `treadle.run --trace` draws): on 2 gloo ranks,
each rank runs its compute actions in exactly the order the price lays out (`facts.action_order`, read off the
schedule classes or derived for GPipe / 1F1B), a stage's forward starts after the one before it ends and its
backward after the one after it, and the measured timeline draws them as the predicted one is drawn."""

from __future__ import annotations

import time

import pytest
import torch

import treadle
from treadle import Mesh, create_schedule
from treadle.forms.pipeline.facts import COMPUTE, action_order
from treadle.testing import spawn
from treadle.viz.chrome import chrome_trace, validate_chrome_trace
from treadle.viz.pipeline_timeline import BUBBLE, pipeline_compare_rows, timeline_from_measured_pipeline
from tiny_models import lm_inputs, tiny_llama

KINDS = [("gpipe", [1], 4), ("1f1b", [1], 4), ("interleaved_1f1b", [0, 1, 2], 4), ("interleaved_zb", [0, 1, 2], 4),
         ("zbv", [0, 1, 2], 4)]


def _inputs() -> dict:
    return {**lm_inputs(8, 16, seed=3), "use_cache": False}


def _rank(rank: int, world: int) -> list[dict]:
    out = []
    for kind, cuts, mb in KINDS:
        sch = create_schedule(tiny_llama(4), mesh=Mesh((2,), ("pp",)))
        for c in cuts:
            sch[f"model.layers.{c}"].cut_pipeline_stage()
        sch.pipeline(axis="pp", schedule=kind, n_microbatches=mb, example_inputs=_inputs())
        pipe = treadle.build(sch)
        pipe.step(**_inputs())  # warm
        torch.distributed.barrier()
        t0 = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process of this host
        with pipe.recording() as log:
            pipe.step(**_inputs())
        end = time.perf_counter()
        out.append({"pp": rank, "stages": list(pipe.local_stage_indices), "end_s": end - t0, "mem_bytes": 1,
                    "actions": [(s, k, m, a - t0, b - t0) for s, k, m, a, b in log.actions],
                    "n_stages": pipe.n_stages, "t0": t0})
    return out


@pytest.fixture(scope="module")
def measured():
    return spawn(_rank, 2, timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(KINDS)), ids=[k for k, _, _ in KINDS])
def test_measured_actions_run_in_the_priced_order(measured, i):
    kind, cuts, mb = KINDS[i]
    n_stages = len(cuts) + 1
    want = action_order(kind, n_stages, 2, mb)
    for r in range(2):
        got = [(s, k, m) for s, k, m, _, _ in measured[r][i]["actions"] if k in COMPUTE]
        assert got == [(a.stage, a.kind, a.mb) for a in want[r]], (kind, r)
    # across ranks (one host clock): a forward after the upstream forward, a backward after the downstream one
    t0 = {r: measured[r][i]["t0"] for r in range(2)}
    when = {(s, k, m): (a + t0[r], b + t0[r]) for r in range(2)
            for s, k, m, a, b in measured[r][i]["actions"] if k in COMPUTE}
    for (s, k, m), (start, _) in when.items():
        if k == "F" and s > 0:
            assert start >= when[(s - 1, "F", m)][1], (kind, s, m)
        if k in ("B", "I") and s < n_stages - 1:
            up = when.get((s + 1, "B", m)) or when[(s + 1, "I", m)]
            assert start >= up[1], (kind, s, m)
    assert [a[1] for a in measured[1 if kind != "zbv" else 0][i]["actions"]].count("loss") == mb  # the last stage's


@pytest.mark.slow
def test_measured_timeline_draws_a_track_per_pp_rank(measured):
    i = 1  # 1f1b
    doc = {"axis": "pp", "n_stages": 2, "schedule": "1f1b", "n_microbatches": 4, "world_size": 2,
           "ranks": [{k: v for k, v in measured[r][i].items() if k not in ("n_stages", "t0")} for r in range(2)]}
    tl = timeline_from_measured_pipeline(doc)
    assert tl.tracks == ["pp rank 0 (stage 0)", "pp rank 1 (stage 1)"]
    names = {s.name for s in tl.spans}
    assert {f"F{m} s0" for m in range(4)} | {f"B{m} s1" for m in range(4)} <= names
    assert 0.0 < tl.totals["bubble_fraction"] < 1.0 and BUBBLE in names  # rank 1 waits for its first input
    for track in tl.tracks:  # each track covers the step end to end
        spans = sorted((s for s in tl.spans if s.track == track), key=lambda s: s.start_s)
        assert spans[0].start_s == 0.0 and spans[-1].end_s == pytest.approx(tl.step_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(spans, spans[1:]))
    assert validate_chrome_trace(chrome_trace(tl, process="treadle measured step")) == []
    price = {"step_s": 0.01, "pipeline": {"bubble_fraction": 0.2, "ranks": {
        "0": {"stages": [0], "busy_s": 0.004}, "1": {"stages": [1], "busy_s": 0.005}}}}
    rows = pipeline_compare_rows(price, doc)
    assert [r[0] for r in rows] == ["pp rank 0", "pp rank 1", "step", "bubble fraction"]
    price["pipeline"]["ranks"] = {"0": {"stages": [0, 2], "busy_s": 0.004}, "1": {"stages": [1, 3], "busy_s": 0.005}}
    with pytest.raises(ValueError, match=r"the measured pipeline holds stages \[\[0\], \[1\]\] per pp rank, the "
                                         r"priced one \[\[0, 2\], \[1, 3\]\]: not the same pipeline"):
        pipeline_compare_rows(price, doc)
