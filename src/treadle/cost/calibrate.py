"""Measure each mesh axis' link on a live process group and fit its alpha-beta figures (gloo here, NCCL on GPUs).

Call `calibrate_cluster(mesh)` on every rank of a launched job (torchrun, `treadle.testing.spawn`). For each
axis it times a ring all-gather over the axis' groups (all groups at once, as conversions run them) at
several sizes, and fits ``t = c + (n-1)/n * nbytes / bandwidth`` by least squares on relative error (each
point weighted by 1/t, so small and large sizes count alike). The intercept is ``c = launch_s + (n-1) *
latency_s``; on a mesh of two or more axes the flattened group of all axes is timed too, and its intercept
``launch_s + (N-1) * max(latency_s)`` separates the per-call launch cost (shared by all groups: it is the
software stack) from the per-step latency. On a 1-D mesh the launch cost is 0 and the whole intercept is
latency. Reduce-scatter, all-reduce and all-to-all are timed in the same sweeps and get a time factor each
against their model on the fitted link (`LinkSpec.op_scale`). Timing (`time_collectives`): a warm-up
sweep, then interleaved sweeps over all sizes, the mean or the median of the slowest rank's time (NOTE [a step
pays the mean]), each call after a short compute as a step issues it (NOTE [in-step collectives]), in chains of
(compute, collective) pairs with no barrier between them, as a step pays them (NOTE [collectives in a chain]);
the chains timed again without the compute give each link's drift (`LinkSpec.skew_s`: NOTE [lead-dependent
skew]).
Held-out sizes are measured in the same sweeps and reported next to the model's prediction.
"""

from __future__ import annotations

import dataclasses

import json
import logging
import os
import statistics
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from ..errors import LayoutError, MeshError
from ..mesh import Mesh
from .cluster import ClusterSpec
from .collective_cost import (all_gather_time_s, all_reduce_time_s, all_to_all_time_s,
                              reduce_scatter_time_s)
from .links import LinkSpec
from .timing import COLLECTIVES, _STATISTICS, measure_copy_bytes_per_s, time_collectives

logger = logging.getLogger(__name__)

# Fitted and held-out sizes, interleaved over 4 KiB .. 8 MiB. Larger gloo buffers on a small host leave the
# linear regime (memory bandwidth falls with buffer size past the caches), which alpha-beta cannot follow.
DEFAULT_SIZES_BYTES = (4 << 10, 64 << 10, 2 << 20, 8 << 20)
DEFAULT_HELD_OUT_BYTES = (16 << 10, 256 << 10, 4 << 20)
DEFAULT_LEAD_COMPUTE_S = 2e-3  # NOTE [in-step collectives]: about one block's forward of the tiny models here
DEFAULT_CHAIN = 8  # NOTE [collectives in a chain]: (compute, collective) pairs per sample
DEFAULT_ROUNDS = 5  # NOTE [calibration rounds]

# NOTE [calibration rounds]. Each timed point is the mean (or median) of `rounds` interleaved sweeps, each sample
# a chain of 8 (compute, collective) pairs, so a point already averages 8 calls per round. On this 2-vCPU host, a
# 2x2 mesh (three groups: dp, tp, the world), 4 collectives x 4 fitted sizes, the chains timed with and without
# their lead: 15 rounds with the 3 held-out sizes took 487 s under load (the CLI's old default); 5 rounds without
# held-out sizes 53 s under a load of 2.2, the figure `treadle calibrate`'s 90 s target is checked by. The
# accuracy of both, priced against the same measured steps: `bench/bench_calibration.py --compare rounds`.

# NOTE [in-step collectives]. A training step issues each collective after some compute: the ranks arrive
# apart (their compute drifts; ranks sharing cores are time-sliced) and gloo's threads have gone to sleep.
# Timed right after a barrier (ranks aligned, threads awake) a small gloo all-reduce on 2 ranks of this 2-core
# host took ~0.9 ms; after ~3 ms of compute, ~4 ms more than the compute alone. A model fitted on the first
# under-prices every blocking collective of a step (tensor parallelism issues tens of them), so the default
# protocol computes first: each sample is ``max over ranks (compute + collective) - mean over ranks (compute)``,
# the wait for the last rank and the wake-up included, as the step pays them.


@dataclass(frozen=True)
class HeldOut:
    """A size measured but not fitted: the model's prediction next to the measurement."""

    axis: str
    nbytes: int
    measured_s: float
    predicted_s: float
    op: str = "all_gather"

    @property
    def rel_error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


@dataclass(frozen=True)
class AxisFit:
    """Fit of one group: sizes (gathered bytes), times (s; the calibration's statistic), the intercept and
    bandwidth found."""

    axes: tuple[str, ...]
    n_ranks: int
    sizes_bytes: tuple[int, ...]
    times_s: tuple[float, ...]
    intercept_s: float
    bandwidth_bytes_per_s: float

    def predict_s(self, nbytes: float) -> float:
        return self.intercept_s + (self.n_ranks - 1) / self.n_ranks * nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Calibration:
    """The calibrated cluster and the fits behind it (per axis, and of the flattened group when measured)."""

    cluster: ClusterSpec
    fits: tuple[AxisFit, ...]
    flat_fit: AxisFit | None = None
    launch_s: float = 0.0
    held_out: tuple[HeldOut, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> str:
        return json.dumps({"cluster": self.cluster.to_dict(), "launch_s": self.launch_s, "notes": list(self.notes),
                           "held_out": [h.__dict__ for h in self.held_out],
                           "fits": [f.__dict__ for f in self.fits],
                           "flat_fit": self.flat_fit.__dict__ if self.flat_fit else None}, indent=2, default=list)

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        """The Calibration `to_json` wrote (plain data: numbers, names, the cluster's dict)."""
        d = json.loads(text)

        def fit(f: dict) -> AxisFit:
            return AxisFit(tuple(f["axes"]), int(f["n_ranks"]), tuple(f["sizes_bytes"]), tuple(f["times_s"]),
                           float(f["intercept_s"]), float(f["bandwidth_bytes_per_s"]))

        return cls(ClusterSpec.from_dict(d["cluster"]), tuple(fit(f) for f in d.get("fits", ())),
                   fit(d["flat_fit"]) if d.get("flat_fit") else None, float(d.get("launch_s", 0.0)),
                   tuple(HeldOut(**h) for h in d.get("held_out", ())), tuple(d.get("notes", ())))


def fit_axis(axes: tuple[str, ...], n_ranks: int, sizes_bytes: Sequence[int], times_s: Sequence[float]) -> AxisFit:
    """Least squares on relative error of t = c + (n-1)/n * s / bw over the sizes. Raises LayoutError with
    fewer than two sizes; a negative intercept is clipped to 0 and the slope refitted through the origin."""
    if len(sizes_bytes) < 2 or len(sizes_bytes) != len(times_s):
        raise LayoutError(f"fit_axis {axes}: needs two or more (size, time) pairs; got {len(sizes_bytes)} sizes "
                          f"and {len(times_s)} times")
    xs = [(n_ranks - 1) / n_ranks * s for s in sizes_bytes]
    a = torch.tensor([[1.0 / t, x / t] for x, t in zip(xs, times_s)], dtype=torch.float64)
    b = torch.ones(len(xs), dtype=torch.float64)
    c, inv_bw = torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1).tolist()
    if c < 0 or inv_bw <= 0:
        c = max(c, 0.0)
        inv_bw = (sum(x * (t - c) / t ** 2 for x, t in zip(xs, times_s))
                  / sum(x * x / t ** 2 for x, t in zip(xs, times_s)))
        inv_bw = max(inv_bw, 1e-15)
    return AxisFit(axes, n_ranks, tuple(int(s) for s in sizes_bytes), tuple(times_s), c, 1.0 / inv_bw)


def _solve_launch(fits: Sequence[AxisFit], flat: AxisFit) -> float:
    """Launch cost L with c_i = L + (n_i-1) a_i and c_flat = L + (N-1) max_i a_i (bisection; the right side
    minus c_flat falls as L grows). Clipped to [0, min c_i]."""
    lo, hi = 0.0, min(f.intercept_s for f in fits)

    def excess(launch: float) -> float:
        alpha = max((f.intercept_s - launch) / (f.n_ranks - 1) for f in fits)
        return launch + (flat.n_ranks - 1) * alpha - flat.intercept_s

    if excess(lo) <= 0:  # the flattened group is no slower than its latency model at L = 0
        return 0.0
    if excess(hi) >= 0:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def calibrate_cluster(mesh: Mesh, *, sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
                      held_out_bytes: Sequence[int] = DEFAULT_HELD_OUT_BYTES, rounds: int = DEFAULT_ROUNDS,
                      ops: Sequence[str] = COLLECTIVES, base: ClusterSpec | None = None,
                      name: str = "gloo", lead_compute_s: float = DEFAULT_LEAD_COMPUTE_S,
                      host_overheads: bool = True, statistic: str = "auto",
                      chain: int = DEFAULT_CHAIN) -> Calibration:
    """Time and fit every axis of `mesh` (size > 1) on the running process groups; all ranks return the same.

    `sizes_bytes` are fitted; `held_out_bytes` are measured in the same sweeps but not fitted, and the
    Calibration reports the model's error on them. The all-gather fits the link (alpha, beta, launch); each
    other collective of `ops` gets a time factor against its model on that link (`LinkSpec.op_scale`: gloo's
    reduce-scatter, for one, is far slower than a ring). With two or more axes the world group (every axis
    flattened) is fitted the same way and kept as `ClusterSpec.group_links` (data parallelism over all ranks
    runs on it). Collectives are timed after `lead_compute_s` of compute on every rank, as a step issues them
    (NOTE [in-step collectives]; 0: right after a barrier), in chains of `chain` (compute, collective) pairs
    with no barrier between them (NOTE [collectives in a chain]; 1: each call alone after a barrier); with a
    chain and a lead the chains are timed once more without the lead, and the difference is each link's drift
    (`LinkSpec.skew_s` after `skew_lead_s`: NOTE [lead-dependent skew]); each time is the mean or the median of its rounds
    (`statistic`: "mean", "median", or "auto": the mean when every rank can have a core of its own on this
    host, else the median; NOTE [a step pays the mean]). The local copy rate (`ClusterSpec.copy_bytes_per_s`)
    is measured too, and with `host_overheads` FSDP2's host cost per unit and per parameter on the world group
    (`treadle.profile.overheads.fsdp_overheads_s`, the ranks' mean; a fake group misses gloo's issue and
    completion path), written into the returned cluster's device (`base`'s device, e.g. `calibrate_cpu()`'s,
    with `fsdp_unit_s` / `fsdp_param_s` replaced and its source saying so). Axes of size 1 keep `base`'s link;
    axes that `base` gives one link and one size are one channel, fitted once on their pooled timings (NOTE
    [one channel, one link] at `_same_channel`).
    Returns a Calibration
    whose `.cluster` is `base` (default: the mesh on device "cpu") with the fitted links. Raises MeshError
    when torch.distributed is not initialised or the world does not match the mesh; LayoutError on bad sizes
    or when no axis has more than one rank."""
    if not dist.is_initialized():
        raise MeshError(f"calibrate_cluster: torch.distributed is not initialised; run it on every rank of a "
                        f"launched job of {mesh.world_size} ranks (torchrun or treadle.testing.spawn)")
    if all(n == 1 for n in mesh.shape):
        raise LayoutError(f"calibrate_cluster: every axis of {mesh} has size 1; there is no link to measure")
    if base is not None and (base.mesh.shape != mesh.shape or base.mesh.names != mesh.names):
        raise LayoutError(f"calibrate_cluster: base cluster {base} does not describe {mesh}")
    mesh.bind()
    why = ""
    if statistic == "auto":  # NOTE [a step pays the mean]
        cores = os.cpu_count() or 1
        own = mesh.world_size <= cores
        statistic = "mean" if own else "median"
        why = (f" ({mesh.world_size} ranks on {cores} cores: "
               + ("each rank has a core of its own, a wait leaves it idle)" if own else
                  "ranks share cores, a waiting rank lends its core)"))
    if statistic not in _STATISTICS:
        raise LayoutError(f"calibrate_cluster: statistic {statistic!r}; use 'auto' or one of {sorted(_STATISTICS)}")
    all_sizes = list(sizes_bytes) + list(held_out_bytes)
    fitted = len(sizes_bytes)
    groups = [((axis,), n, mesh.group(axis)) for axis, n in zip(mesh.names, mesh.shape) if n > 1]
    fits, measured, skews = [], [], []
    skewed = chain > 1 and lead_compute_s > 0  # NOTE [lead-dependent skew]: chains without a lead too

    def timed(group) -> tuple[dict[str, list[float]], tuple[float, float]]:
        long = time_collectives(ops, all_sizes, group, rounds=rounds, lead_compute_s=lead_compute_s,
                                statistic=statistic, chain=chain)
        if not skewed:
            return long.times_s, (0.0, 0.0)
        short = time_collectives(ops, all_sizes[:fitted], group, rounds=rounds, lead_compute_s=0.0,
                                 statistic=statistic, chain=chain)  # the fitted sizes are what _skew_s reads
        return long.times_s, (_skew_s(long.times_s, short.times_s, fitted), long.lead_wall_s)

    for axes, n, group in groups:
        times, skew = timed(group)
        measured.append(times)
        skews.append(skew)
        fits.append(fit_axis(axes, n, all_sizes[:fitted], times["all_gather"][:fitted]))
        logger.info("calibrate %s: n=%d, intercept %.1f us, %.2f GB/s", "+".join(axes), n,
                    fits[-1].intercept_s * 1e6, fits[-1].bandwidth_bytes_per_s / 1e9)
    if chain > 1:
        protocol = (f"collectives timed in chains of {chain} (compute, collective) pairs, "
                    + (f"{lead_compute_s * 1e3:.1f} ms of compute before each (in-step)" if lead_compute_s > 0
                       else "back to back"))
    else:
        protocol = (f"collectives timed after {lead_compute_s * 1e3:.1f} ms of compute on every rank (in-step)"
                    if lead_compute_s > 0 else "collectives timed right after a barrier")
    notes: list[str] = [protocol + f"; the {statistic} of {rounds} rounds{why}"]
    if skewed:
        notes.append("drift (skew_s) measured as the chains with that lead minus chains without compute")
    for members in _same_channel(groups, base):
        pooled = {op: [statistics.fmean(measured[i][op][k] for i in members) for k in range(len(all_sizes))]
                  for op in ops}
        lead = groups[members[0]]
        one = fit_axis(lead[0], lead[1], all_sizes[:fitted], pooled["all_gather"][:fitted])
        skew = (statistics.fmean(skews[i][0] for i in members), statistics.fmean(skews[i][1] for i in members))
        for i in members:  # one fit, shared (fitted apart, LAPACK's last bits may differ with memory alignment)
            measured[i] = pooled
            fits[i] = dataclasses.replace(one, axes=groups[i][0])
            skews[i] = skew
        notes.append(f"axes {', '.join(groups[i][0][0] for i in members)} share the link "
                     f"{base.link(groups[members[0]][0][0]).name!r} in the base cluster: their timings are pooled")
    flat_fit, launch = None, 0.0
    flat_all: dict[str, list[float]] = {}
    flat_skew = (0.0, 0.0)
    if len(groups) >= 2:
        flat_all, flat_skew = timed(dist.group.WORLD)
        flat_times = flat_all["all_gather"]
        flat_fit = fit_axis(tuple(mesh.names), mesh.world_size, all_sizes[:fitted], flat_times[:fitted])
        launch = _solve_launch(fits, flat_fit)
    else:
        notes.append("one axis of size > 1: launch cost not separable from latency; launch_s = 0")
    links = {}
    for f, times, (skew_s, skew_lead_s) in zip(fits, measured, skews):
        latency = max(f.intercept_s - launch, 0.0) / (f.n_ranks - 1)
        plain = LinkSpec(name=f"{name}-{f.axes[0]}", latency_s=latency,
                         bandwidth_bytes_per_s=f.bandwidth_bytes_per_s, efficiency=1.0, launch_s=launch)
        scales = tuple((op, _scale(op, f.n_ranks, plain, all_sizes[:fitted], times[op][:fitted]))
                       for op in ops if op != "all_gather")
        links[f.axes[0]] = LinkSpec(name=plain.name, latency_s=latency,
                                    bandwidth_bytes_per_s=f.bandwidth_bytes_per_s, efficiency=1.0,
                                    launch_s=launch, op_scale=scales, skew_s=skew_s, skew_lead_s=skew_lead_s)
    group_links = ()
    if flat_fit is not None:  # the world group, flattening every axis: e.g. data parallelism over all ranks
        live = tuple(a for a, n in zip(mesh.names, mesh.shape) if n > 1)
        latency = max(flat_fit.intercept_s - launch, 0.0) / (flat_fit.n_ranks - 1)
        plain = LinkSpec(name=f"{name}-{'+'.join(live)}", latency_s=latency,
                         bandwidth_bytes_per_s=flat_fit.bandwidth_bytes_per_s, efficiency=1.0, launch_s=launch)
        scales = tuple((op, _scale(op, flat_fit.n_ranks, plain, all_sizes[:fitted], flat_all[op][:fitted]))
                       for op in ops if op != "all_gather")
        group_links = ((live, dataclasses.replace(plain, op_scale=scales, skew_s=flat_skew[0],
                                                  skew_lead_s=flat_skew[1])),)
    copy_rate = measure_copy_bytes_per_s(max(all_sizes), rounds=rounds)
    base = base or ClusterSpec.uniform(mesh, next(iter(links.values())), device="cpu")
    cluster = base.with_links([links.get(a, base.link(a)) for a in mesh.names], copy_bytes_per_s=copy_rate)
    cluster = dataclasses.replace(cluster, group_links=group_links)
    if host_overheads:
        cluster = dataclasses.replace(cluster, device=_with_group_fsdp_overheads(cluster, rounds))
        notes.append(f"FSDP2 host costs measured on the world group of {mesh.world_size} ranks")
    held_out = tuple(HeldOut(f.axes[0], size, t, _model_s(op, size, f.n_ranks, cluster.link(f.axes[0])), op)
                     for f, times in zip(fits, measured) for op in ops
                     for size, t in zip(all_sizes[fitted:], times[op][fitted:]))
    return Calibration(cluster, tuple(fits), flat_fit, launch, held_out, tuple(notes))


# NOTE [lead-dependent skew]: a blocking collective waits for the last rank of its group to arrive, and the
# ranks drift apart over the compute since they last synchronised (time-sliced ranks sharing cores, a rank's
# gloo threads gone to sleep, the host's other work), so the same collective costs more after a long compute
# than right after another collective. Inside real steps on this 2-vCPU host (GPT-2 of the benches, 2x2 mesh,
# sequence parallelism): all-reduces issued 0.1-0.3 ms after the previous collective averaged 1.3 ms, those
# after 1-5 ms of compute 2.2-3.3 ms; chains of 8 timed on the tp axis: 1.6-2.0 ms without compute between
# the calls, 3.5 ms after 3 ms of compute, for 16 KiB to 1 MiB alike. Calibration therefore times the chains
# twice, with the lead compute and without it: the link is fitted on the first (what the cost functions
# price: a collective after a long compute, as tensor parallelism issues them), and `LinkSpec.skew_s` is the
# median over collectives and sizes of the difference, reached after `skew_lead_s` (the lead's wall time on
# the loaded host). `treadle.price`'s timeline gives a blocking collective issued after a shorter lead back
# the undrifted part, linearly (`LinkSpec.short_lead_saving_s`); the planner's cost graph, which has no
# timeline, keeps the full price (conservative for back-to-back collectives, e.g. sequence parallelism).
def _skew_s(long: dict[str, list[float]], short: dict[str, list[float]], fitted: int) -> float:
    """NOTE [lead-dependent skew]: the median over collectives and fitted sizes of (with lead - without),
    clipped to [0, the smallest time with the lead]."""
    pairs = [(long[op][k], short[op][k]) for op in long for k in range(fitted)]
    diff = statistics.median(a - b for a, b in pairs)
    return min(max(diff, 0.0), min(a for a, _ in pairs))


def _same_channel(groups: list, base: ClusterSpec | None) -> list[list[int]]:
    """NOTE [one channel, one link]: indices of the measured axes (size > 1) that `base` states are one channel
    (the same LinkSpec and the same number of ranks, e.g. both axes of ``ClusterSpec.uniform(mesh,
    "loopback")`` on one host), in groups of two or more. Fitted apart, run-to-run noise makes one look faster
    than the other, and the planner would pick layouts for a difference the hardware does not have; their
    timings are averaged and fitted once. Without `base`, nothing is stated and every axis is fitted alone."""
    if base is None:
        return []
    by: dict[tuple, list[int]] = {}
    for i, (axes, n, _) in enumerate(groups):
        by.setdefault((base.link(axes[0]), n), []).append(i)
    return [m for m in by.values() if len(m) > 1]


def _with_group_fsdp_overheads(cluster: ClusterSpec, rounds: int):
    """`cluster`'s HardwareSpec with FSDP2's per-unit and per-parameter host seconds measured on the world group
    (the ranks' mean). Collective over the world."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..profile.overheads import fsdp_kept_unit_s, fsdp_overheads_s

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    unit_s, param_s = fsdp_overheads_s(mesh, reps=max(5, min(rounds, 9)))
    kept_s = fsdp_kept_unit_s(mesh, reps=max(5, min(rounds, 9)))
    mean = torch.tensor([unit_s, param_s, kept_s], dtype=torch.float64)
    dist.all_reduce(mean)
    unit_s, param_s, kept_s = (mean / world).tolist()
    hw = cluster.hardware()
    return dataclasses.replace(hw, fsdp_unit_s=max(unit_s, 0.0), fsdp_param_s=max(param_s, 0.0),
                               fsdp_kept_unit_s=max(kept_s, 0.0),
                               source=f"{hw.source}; FSDP2 host costs measured on {world} gloo ranks")


_MODELS = {"all_gather": all_gather_time_s, "reduce_scatter": reduce_scatter_time_s,
           "all_reduce": all_reduce_time_s, "all_to_all": all_to_all_time_s}


def _model_s(op: str, nbytes: float, n: int, link: LinkSpec) -> float:
    return _MODELS[op](nbytes, n, link)


def _scale(op: str, n: int, link: LinkSpec, sizes: Sequence[int], times: Sequence[float]) -> float:
    """Time factor of `op` against its model on `link`: the median ratio measured / modelled over the sizes."""
    return statistics.median(t / _model_s(op, s, n, link) for s, t in zip(sizes, times))


def predicted_all_gather_s(cluster: ClusterSpec, axis: str, nbytes: float) -> float:
    """The calibrated model's all-gather time on one axis (for held-out checks)."""
    return all_gather_time_s(nbytes, cluster.mesh.size(axis), cluster.link(axis))

