"""Collectives as a step pays them: chains of (compute, collective) pairs (NOTE [collectives in a chain]) and the
ranks' drift over the compute since they last synchronised (NOTE [lead-dependent skew])."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch.distributed as dist

import treadle
from treadle import Mesh, testing
from treadle.cost import collective_cost as cc
from treadle.cost.calibrate import _skew_s, calibrate_cluster
from treadle.cost.timing import _chain_sample, measure_collectives_s
from treadle.cost.cluster import ClusterSpec
from treadle.cost.links import LinkSpec
from treadle.cost.overlap import Collective, Segment, simulate
from treadle.errors import LayoutError
from treadle.models.zoo import named_model
from treadle.pricing import price

MS = 1e-3
DRIFT = LinkSpec(name="drift", latency_s=1e-4, bandwidth_bytes_per_s=1e9, skew_s=1 * MS, skew_lead_s=2 * MS)


# ------------------------------------------------------------------------------------------ the link (pure)
def test_a_call_soon_after_the_last_sync_pays_the_undrifted_part_less():
    assert DRIFT.short_lead_saving_s(0.0) == pytest.approx(1 * MS)  # back to back: no drift at all
    assert DRIFT.short_lead_saving_s(0.5 * MS) == pytest.approx(0.75 * MS)  # 1 ms * (1 - 0.5 / 2)
    assert DRIFT.short_lead_saving_s(2 * MS) == 0.0 and DRIFT.short_lead_saving_s(9 * MS) == 0.0
    plain = LinkSpec(latency_s=1e-4, bandwidth_bytes_per_s=1e9)
    assert plain.short_lead_saving_s(0.0) == 0.0  # no measured drift: presets and GPUs are unchanged


def test_drift_is_validated_survives_json_and_flattens_to_the_largest():
    with pytest.raises(LayoutError, match="skew_lead_s > 0 where skew_s > 0"):
        LinkSpec(latency_s=1e-4, bandwidth_bytes_per_s=1e9, skew_s=1e-3)
    with pytest.raises(LayoutError, match="skew_s >= 0"):
        LinkSpec(latency_s=1e-4, bandwidth_bytes_per_s=1e9, skew_s=-1e-3, skew_lead_s=1e-3)
    assert LinkSpec.from_dict(DRIFT.to_dict()) == DRIFT
    old = {k: v for k, v in DRIFT.to_dict().items() if not k.startswith("skew")}  # a file from before
    assert LinkSpec.from_dict(old).skew_s == 0.0
    other = dataclasses.replace(DRIFT, skew_s=3 * MS, skew_lead_s=1 * MS)
    flat = cc.flat_link([DRIFT, other])
    assert (flat.skew_s, flat.skew_lead_s) == (3 * MS, 2 * MS)


# ------------------------------------------------------------------------------------------ the timeline (pure)
def test_timeline_gives_back_the_drift_a_short_lead_did_not_build():
    segs = [Segment("a", "fwd", 0.5 * MS), Segment("b", "fwd", 3 * MS), Segment("c", "fwd", 1 * MS)]
    cs = [Collective("all_reduce", "tp", 1, 2 * MS, m, "fwd", i, link=DRIFT) for i, m in enumerate("abc")]
    tl = simulate(segs, cs)
    # leads since the rank last left a blocking collective: 0.5 ms, 3 ms, 1 ms
    assert [c.time_s for c in cs] == pytest.approx([1.25 * MS, 2 * MS, 1.5 * MS])
    assert tl.step_s == pytest.approx(4.5 * MS + 4.75 * MS) and tl.comm_s == pytest.approx(4.75 * MS)
    # without a link nothing changes; an asynchronous collective keeps its price
    bare = [Collective("all_reduce", "tp", 1, 2 * MS, "a", "fwd", 0)]
    simulate(segs, bare)
    assert bare[0].time_s == 2 * MS
    async_ = [Collective("all_reduce", "dp", 1, 2 * MS, "a", "bwd", 0, blocking=False, link=DRIFT)]
    simulate(segs, async_)
    assert async_[0].time_s == 2 * MS
    # with overlap=False every collective blocks at its issue point and gets the saving too
    serial = [Collective("all_reduce", "dp", 1, 2 * MS, "a", "bwd", 0, blocking=False, link=DRIFT)]
    simulate(segs, serial, overlap=False)
    assert serial[0].time_s == pytest.approx(1.25 * MS)


def test_price_gives_each_blocking_tensor_parallel_collective_its_saving():
    model, inputs = named_model("tiny-gpt2", batch=8, seq=32, dropout=False)
    mesh = Mesh((2,), ("tp",))
    base = ClusterSpec.uniform(mesh, "loopback").with_ranks(threads_per_rank=1, ranks_per_host=2, cores_per_host=2)
    link = base.link("tp")
    # a drift that no lead in this step reaches: every blocking call is given back skew * (1 - lead / 1000 s)
    drifting = base.with_links([dataclasses.replace(link, skew_s=0.2 * MS, skew_lead_s=1000.0)])
    sch = treadle.models.megatron(treadle.create_schedule(model, mesh=mesh), tp="tp")
    plain_p = price(sch, inputs, base)
    model, inputs = named_model("tiny-gpt2", batch=8, seq=32, dropout=False)
    drift_p = price(treadle.models.megatron(treadle.create_schedule(model, mesh=mesh), tp="tp"), inputs, drifting)
    n = sum(1 for c in plain_p.collectives if c["blocking"])
    assert n >= 8
    assert plain_p.comm_s - drift_p.comm_s == pytest.approx(n * 0.2 * MS, rel=1e-4)
    assert plain_p.step_s - drift_p.step_s == pytest.approx(n * 0.2 * MS, rel=1e-4)
    assert drift_p.compute_s == pytest.approx(plain_p.compute_s)


# ------------------------------------------------------------------------------------------ calibration
def test_skew_is_the_median_difference_clipped_to_the_smallest_time():
    long = {"all_gather": [3e-3, 4e-3, 9e-3], "all_reduce": [3e-3, 5e-3, 9e-3]}
    short = {"all_gather": [1e-3, 2e-3, 1e-3], "all_reduce": [2e-3, 3e-3, 8e-3]}
    assert _skew_s(long, short, fitted=1) == pytest.approx(1.5e-3)  # median of 2 and 1 ms
    assert _skew_s(long, short, fitted=3) == pytest.approx(2e-3)  # median of 2, 2, 8, 1, 2, 1 ms
    assert _skew_s(short, long, fitted=3) == 0.0  # never negative
    assert _skew_s({"x": [1e-3, 1e-3]}, {"x": [-5e-3, -5e-3]}, fitted=2) == 1e-3  # at most the smallest time


def _sleep_chain(rank, world):
    # a "collective" that sleeps 3 ms after a barrier-free 2 ms "compute": a chain pays 3 ms per call and the
    # lead's 2 ms come back as the busy time
    samples = [_chain_sample(lambda: time.sleep(3e-3), lambda: time.sleep(2e-3), 5) for _ in range(3)]
    bad = ""
    try:
        measure_collectives_s(["all_gather"], [1024], dist.group.WORLD, chain=0)
    except LayoutError as exc:
        bad = str(exc)
    return samples, bad


def test_a_chain_sample_is_the_collective_alone_per_call():
    samples, bad = testing.spawn(_sleep_chain, 2, timeout_s=120)[0]
    per_call = sorted(s for s, _ in samples)[1]
    busy = sorted(b for _, b in samples)[1]
    assert 2.5e-3 <= per_call <= 8e-3, samples  # sleeps overshoot on a busy host; never the 5 ms of both
    assert 1.8e-3 <= busy <= 6e-3, samples
    assert "measure_collectives_s: chain must be >= 1; got 0" in bad


def _chain_calibration(rank, world):
    mesh = Mesh((2,), ("x",))
    return calibrate_cluster(mesh, sizes_bytes=(1 << 12, 1 << 16), held_out_bytes=(), rounds=3, chain=4,
                             ops=("all_gather", "all_reduce"), host_overheads=False)


@pytest.mark.slow
def test_a_chain_calibration_records_its_protocol_and_the_drift():
    cal = testing.spawn(_chain_calibration, 2, timeout_s=240)[0]
    link = cal.cluster.link("x")
    assert link.skew_s >= 0 and link.skew_lead_s > 0 and link.bandwidth_bytes_per_s > 0
    assert link.skew_s <= min(cal.fits[0].times_s)
    assert any("in chains of 4 (compute, collective) pairs, 2.0 ms of compute before each" in n
               for n in cal.notes), cal.notes
    assert any("drift (skew_s) measured" in n for n in cal.notes), cal.notes
    back = ClusterSpec.from_json(cal.cluster.to_json()).link("x")
    assert (back.skew_s, back.skew_lead_s) == (link.skew_s, link.skew_lead_s)


def test_the_lead_compute_takes_about_the_cpu_time_asked():
    # the lead was a third of what was asked when its rate came from one cold timing (NOTE [in-step collectives])
    import torch

    from treadle.cost.timing import _busy

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = _busy(4e-3)
        run()
        took = []
        for _ in range(5):
            t0 = time.thread_time()
            run()
            took.append(time.thread_time() - t0)
    finally:
        torch.set_num_threads(before)
    assert 2e-3 <= sorted(took)[2] <= 16e-3, took
    assert _busy(0.0)() is None
