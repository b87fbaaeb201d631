"""Timing collectives as a training step pays them (NOTE [in-step collectives], NOTE [collectives in a chain] in
`calibrate.py`): one collective over a group, after a lead of compute, in chains of (compute, collective) pairs;
and a device's local copy rate. What `calibrate.py` fits links to."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ..errors import LayoutError

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def _collective_call(op: str, nbytes: int, n: int, group):
    """A zero-argument call running `op` on float32 buffers of `nbytes` in collective_cost's convention."""
    numel = nbytes // 4
    if op == "all_gather":
        out, inp = torch.empty(numel), torch.zeros(numel // n)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: fn(out, inp, group=group)
    if op == "reduce_scatter":
        out, inp = torch.empty(numel // n), torch.zeros(numel)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: fn(out, inp, group=group)
    if op == "all_reduce":
        buf = torch.zeros(numel)  # zeros stay finite however often they are summed
        return lambda: dist.all_reduce(buf, group=group)
    if op == "all_to_all":
        out, inp = torch.empty(numel), torch.zeros(numel)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    raise LayoutError(f"calibrate: unknown collective {op!r}; known: {list(COLLECTIVES)}")


def _busy(seconds: float):
    """A zero-argument call that computes (single-threaded 64x64 matmuls) for about `seconds` of this rank's
    CPU time: the product's time is the best of 5 timings of 20 after a warm-up (one timing at a cold start or a
    busy moment read up to 3x slow, and the lead came out a third of what was asked)."""
    if seconds <= 0:
        return lambda: None
    a = torch.randn(64, 64)
    for _ in range(20):
        a @ a
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(20):
            a @ a
        best = min(best, time.thread_time() - t0)
    per = max(best / 20, 1e-7)
    reps = max(1, round(seconds / per))

    def run():
        for _ in range(reps):
            a @ a
    return run


@dataclass(frozen=True)
class CollectiveTimes:
    """What `time_collectives` measured: `times_s[op][k]` seconds of `op` at the k-th size, and
    `lead_wall_s` the wall seconds the lead compute took on each rank (the ranks' mean; 0 without one)."""

    times_s: dict[str, list[float]]
    lead_wall_s: float


def measure_collectives_s(ops: Sequence[str], sizes_bytes: Sequence[int], group: dist.ProcessGroup, *,
                          rounds: int = 15, lead_compute_s: float = 0.0,
                          statistic: str = "median", chain: int = 1) -> dict[str, list[float]]:
    """`time_collectives(...).times_s` (same arguments)."""
    return time_collectives(ops, sizes_bytes, group, rounds=rounds, lead_compute_s=lead_compute_s,
                            statistic=statistic, chain=chain).times_s


def time_collectives(ops: Sequence[str], sizes_bytes: Sequence[int], group: dist.ProcessGroup, *,
                     rounds: int = 15, lead_compute_s: float = 0.0,
                     statistic: str = "median", chain: int = 1) -> CollectiveTimes:
    """Seconds of each collective in `ops` at each of `sizes_bytes` (float32; collective_cost's byte
    convention) on every rank of `group`: the median over rounds, or with ``statistic="mean"`` the mean
    (NOTE [a step pays the mean]).

    Collective: every rank of the world calls it, each with its own group of one partition (an axis' groups
    run at once). Protocol: one warm-up sweep, then `rounds` sweeps over every (op, size), interleaved so
    drift of a busy host hits all alike; a sample is one call after a barrier, timed as the slowest rank's
    (all-reduce MAX); the mean leaves out the largest and the smallest sample (one stall of a busy host
    does not become the figure).

    ``lead_compute_s > 0`` times the collective as a training step issues it (NOTE [in-step collectives]):
    each rank first computes for about that long, then calls the collective; the sample is the slowest
    rank's time for both minus the ranks' mean time for the compute alone (timed in the same sweeps).

    ``chain > 1`` times a collective as a step pays it (NOTE [collectives in a chain]): a sample is `chain`
    (compute, collective) pairs back to back with no barrier between them, timed as the slowest rank's,
    minus the ranks' mean time for the same `chain` computes alone (timed right after, in the same sample),
    divided by `chain`. Raises LayoutError when a size does not split into float32 chunks over the group, for
    an unknown statistic or a `chain` below 1."""
    if statistic not in _STATISTICS:
        raise LayoutError(f"measure_collectives_s: statistic {statistic!r}; use one of {sorted(_STATISTICS)}")
    n = dist.get_world_size(group)
    for nbytes in sizes_bytes:
        if nbytes <= 0 or nbytes % (4 * n):
            raise LayoutError(f"measure_collectives_s: {nbytes} bytes do not split into float32 chunks over {n} "
                              f"ranks; use a positive multiple of {4 * n}")
    if chain < 1:
        raise LayoutError(f"measure_collectives_s: chain must be >= 1; got {chain}")
    calls = [(op, k, _collective_call(op, s, n, group)) for op in ops for k, s in enumerate(sizes_bytes)]
    busy = _busy(lead_compute_s)
    lead: list[float] = []

    def sample(fn) -> float:
        if chain > 1:
            per_call_s, busy_s = _chain_sample(fn, busy, chain)
            lead.append(busy_s)
            return per_call_s
        dist.barrier()
        t0 = time.perf_counter()
        busy()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        total = torch.tensor([t2 - t0], dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)  # the collective is done when its slowest rank is
        if lead_compute_s > 0:
            own = torch.tensor([t1 - t0], dtype=torch.float64)
            dist.all_reduce(own)
            lead.append(own.item() / dist.get_world_size())
        return total.item()

    for _, _, fn in calls:
        sample(fn)
    lead.clear()
    samples: dict[tuple[str, int], list[float]] = {(op, k): [] for op, k, _ in calls}
    for _ in range(rounds):
        for op, k, fn in calls:
            samples[(op, k)].append(sample(fn))
    stat = _STATISTICS[statistic]
    lead_s = stat(lead) if lead_compute_s > 0 else 0.0
    drop = lead_s if chain == 1 else 0.0  # a chain sample has its computes taken out already
    return CollectiveTimes({op: [max(stat(samples[(op, k)]) - drop, 1e-7) for k in range(len(sizes_bytes))]
                            for op in ops}, lead_s)


def _chain_sample(fn, busy, chain: int) -> tuple[float, float]:
    """One sample of NOTE [collectives in a chain]: (seconds per collective of `chain` (busy, fn) pairs, the
    slowest rank's chain minus the ranks' mean time for `chain` busy calls alone; the ranks' mean seconds of
    one busy call alone). Collective over the world."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(chain):
        busy()
        fn()
    t1 = time.perf_counter()
    dist.barrier()
    t2 = time.perf_counter()
    for _ in range(chain):
        busy()
    t3 = time.perf_counter()
    slowest = torch.tensor([t1 - t0], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    alone = torch.tensor([t3 - t2], dtype=torch.float64)
    dist.all_reduce(alone)
    busy_s = alone.item() / dist.get_world_size() / chain
    return slowest.item() / chain - busy_s, busy_s


# NOTE [collectives in a chain]: a step issues its blocking collectives one after another with compute
# between them and no barrier: the ranks a collective synchronises drift apart again only over the compute
# that follows, a rank that waits lends its core to one that computes (ranks sharing cores), and the other
# groups of the axis (the two tp pairs of a 2x2 mesh) run on their own. A sample that starts every collective
# from a world barrier charges each one the whole world's drift over the lead compute and none of the lending.
# Measured inside real steps on this 2-vCPU host (GPT-2 of the benches, 2x2 mesh, 4 gloo ranks; the mean time
# a rank spends inside each collective, against the link fitted on barrier-started samples): tensor parallel's
# 128 KiB all-reduces 2.2-2.3 ms against 3.24 priced; sequence parallel's all-gathers 1.8-2.6 against 3.16,
# reduce-scatters 2.5-2.7 against 4.82 (that fit's reduce-scatter factor was 1.53), its all-reduces with short
# leads 1.3 against 3.05. A chain of `chain` (compute, collective) pairs timed end to end, minus the same
# computes alone, divided by `chain`, is what each collective adds to a step.


# NOTE [a step pays the mean]: a step's time is the sum of its collectives' times, so where a rank waits for
# a collective with its core idle, the step pays their mean, not their median. On a shared host a small gloo
# collective's time is skewed: on 2 ranks of this 2-vCPU host a 256 KiB all-reduce after 2 ms of compute
# took 1.7-2.3 ms at the median and 2.5-2.6 ms on average (a tenth of the calls take several ms more), and
# inside a tensor-parallel LLaMA step its 21 all-reduces averaged 2.8 ms: a link fitted on medians priced
# them at 1.4 ms, and 2-rank tensor-parallel schedules measured 1.8-2.2x their price against 1.3-1.6x for
# DDP. Where ranks share cores, a waiting rank lends its core to another rank that computes, and a
# collective's long tail (a peer that was descheduled) overlaps that compute: the step does not pay it in
# full. `calibrate_cluster(statistic="auto")` therefore takes the mean (of each (op, size)'s samples without
# their largest and smallest one) when every rank of the job can have a core of its own on this host
# (world size <= `os.cpu_count()`), else the median, and says which in its notes. Measured side by side on
# the same steps (bench/bench_calibration.py --compare statistic; time ratio max/min, median -> mean): 2 ranks 1.40 ->
# 1.19 and 1.52 -> 1.34 (and 1.43 -> 1.38, 1.33 -> 1.23 in a second run), 2x2 1.56 -> 1.79 and 1.49 -> 1.68
# (1.58 -> 1.82), 1-D 4 ranks 1.26 -> 1.40 and 1.51 -> 1.40.
def _trimmed_mean(xs: Sequence[float]) -> float:
    xs = sorted(xs)
    return statistics.fmean(xs[1:-1] if len(xs) > 2 else xs)


_STATISTICS = {"mean": _trimmed_mean, "median": statistics.median}


def measure_copy_bytes_per_s(nbytes: int, *, rounds: int = 15) -> float:
    """Bytes per second one rank copies locally (`Tensor.copy_` of `nbytes`), while every rank copies at once
    as they do around collectives; the slowest rank's median. Collective over the world."""
    src, dst = torch.zeros(max(nbytes // 4, 1)), torch.empty(max(nbytes // 4, 1))
    dst.copy_(src)
    samples = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        samples.append(dt.item())
    return src.numel() * 4 / max(statistics.median(samples), 1e-9)


