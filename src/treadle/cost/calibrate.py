"""Measure each mesh axis' link on a live process group and fit its alpha-beta figures (gloo here, NCCL on GPUs).

Call `calibrate_cluster(mesh)` on every rank of a launched job (torchrun, `treadle.testing.spawn`). For each
axis it times a ring all-gather over the axis' groups (all groups at once, as conversions run them) at
several sizes, and fits ``t = c + (n-1)/n * nbytes / bandwidth`` by least squares on relative error (each
point weighted by 1/t, so small and large sizes count alike). The intercept is ``c = launch_s + (n-1) *
latency_s``; on a mesh of two or more axes the flattened group of all axes is timed too, and its intercept
``launch_s + (N-1) * max(latency_s)`` separates the per-call launch cost (shared by all groups: it is the
software stack) from the per-step latency. On a 1-D mesh the launch cost is 0 and the whole intercept is
latency. Timing (`measure_all_gather_s`): a warm-up sweep, then interleaved sweeps over all sizes, medians
of the slowest rank's time (robust to a busy host). Held-out sizes are measured in the same sweeps and
reported next to the model's prediction.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from ..errors import LayoutError, MeshError
from ..mesh import Mesh
from .cluster import ClusterSpec
from .collective_cost import all_gather_time_s
from .links import LinkSpec

logger = logging.getLogger(__name__)

# Fitted and held-out sizes, interleaved over 4 KiB .. 8 MiB. Larger gloo buffers on a small host leave the
# linear regime (memory bandwidth falls with buffer size past the caches), which alpha-beta cannot follow.
DEFAULT_SIZES_BYTES = (4 << 10, 64 << 10, 2 << 20, 8 << 20)
DEFAULT_HELD_OUT_BYTES = (16 << 10, 256 << 10, 4 << 20)


@dataclass(frozen=True)
class HeldOut:
    """A size measured but not fitted: the model's prediction next to the measurement."""

    axis: str
    nbytes: int
    measured_s: float
    predicted_s: float

    @property
    def rel_error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


@dataclass(frozen=True)
class AxisFit:
    """Fit of one group: sizes (gathered bytes), median times (s), the intercept and bandwidth found."""

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
                           "fits": [f.__dict__ for f in (*self.fits, *([self.flat_fit] if self.flat_fit else []))]},
                          indent=2, default=list)


# ------------------------------------------------------------------------------------------- timing
def measure_all_gather_s(sizes_bytes: Sequence[int], group: dist.ProcessGroup, *, rounds: int = 15,
                         min_sample_s: float = 0.0) -> list[float]:
    """Median seconds of one all-gather producing each of `sizes_bytes` (float32) on every rank of `group`.

    Collective: every rank of the world calls it, each with its own group of one partition (an axis' groups
    run at once). Protocol: one warm-up sweep, then `rounds` sweeps over all sizes (interleaved, so drift of a
    busy host hits every size alike); a sample is `inner` back-to-back calls after a barrier, `inner` chosen
    from the warm-up so a sample lasts about `min_sample_s` (default: single calls, whose median shrugs off the
    spikes of a busy host best); its time is the slowest rank's (all-reduce MAX).
    Raises LayoutError when a size does not split into float32 chunks over the group."""
    n = dist.get_world_size(group)
    for nbytes in sizes_bytes:
        if nbytes <= 0 or nbytes % (4 * n):
            raise LayoutError(f"measure_all_gather_s: {nbytes} bytes do not split into float32 chunks over {n} "
                              f"ranks; use a positive multiple of {4 * n}")
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    bufs = [(torch.empty(s // 4), torch.ones(s // 4 // n)) for s in sizes_bytes]

    def sample(k: int, inner: int) -> float:
        out, inp = bufs[k]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(inner):
            gather(out, inp, group=group)
        dt = torch.tensor([(time.perf_counter() - t0) / inner], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the collective is done when its slowest rank is
        return dt.item()

    inners = []
    for k in range(len(sizes_bytes)):  # warm-up, and the calls per sample
        sample(k, 2)
        inners.append(max(1, min(64, math.ceil(min_sample_s / max(sample(k, 2), 1e-6)))))
    samples: list[list[float]] = [[] for _ in sizes_bytes]
    for _ in range(rounds):
        for k in range(len(sizes_bytes)):
            samples[k].append(sample(k, inners[k]))
    return [statistics.median(x) for x in samples]


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
                      held_out_bytes: Sequence[int] = DEFAULT_HELD_OUT_BYTES, rounds: int = 15,
                      base: ClusterSpec | None = None, name: str = "gloo") -> Calibration:
    """Time and fit every axis of `mesh` (size > 1) on the running process groups; all ranks return the same.

    `sizes_bytes` are fitted; `held_out_bytes` are measured in the same sweeps but not fitted, and the
    Calibration reports the model's error on them. Axes of size 1 keep `base`'s link. Returns a Calibration
    whose `.cluster` is `base` (default: the mesh on device "cpu") with the fitted links. Raises MeshError
    when torch.distributed is not initialised or the world does not match the mesh; LayoutError on bad sizes
    or when no axis has more than one rank."""
    if not dist.is_initialized():
        raise MeshError(f"calibrate_cluster: torch.distributed is not initialised; run it on every rank of a "
                        f"launched job of {mesh.world_size} ranks (torchrun or treadle.testing.spawn)")
    if all(n == 1 for n in mesh.shape):
        raise LayoutError(f"calibrate_cluster: every axis of {mesh} has size 1; there is no link to measure")
    mesh.bind()
    all_sizes = list(sizes_bytes) + list(held_out_bytes)
    fitted = len(sizes_bytes)
    groups = [((axis,), n, mesh.group(axis)) for axis, n in zip(mesh.names, mesh.shape) if n > 1]
    if len(groups) >= 2:
        groups.append((tuple(mesh.names), mesh.world_size, dist.group.WORLD))
    fits, measured = [], []
    for axes, n, group in groups:
        times = measure_all_gather_s(all_sizes, group, rounds=rounds)
        measured.append(times)
        fits.append(fit_axis(axes, n, all_sizes[:fitted], times[:fitted]))
        logger.info("calibrate %s: n=%d, intercept %.1f us, %.2f GB/s", "+".join(axes), n,
                    fits[-1].intercept_s * 1e6, fits[-1].bandwidth_bytes_per_s / 1e9)
    notes: list[str] = []
    flat_fit, launch = None, 0.0
    if len(groups) > 2:
        flat_fit = fits.pop()
        measured.pop()
        launch = _solve_launch(fits, flat_fit)
    else:
        notes.append("one axis of size > 1: launch cost not separable from latency; launch_s = 0")
    links = {}
    for f in fits:
        latency = max(f.intercept_s - launch, 0.0) / (f.n_ranks - 1)
        links[f.axes[0]] = LinkSpec(name=f"{name}-{f.axes[0]}", latency_s=latency,
                                    bandwidth_bytes_per_s=f.bandwidth_bytes_per_s, efficiency=1.0, launch_s=launch)
    base = base or ClusterSpec.uniform(mesh, next(iter(links.values())), device="cpu")
    if base.mesh.shape != mesh.shape:
        raise LayoutError(f"calibrate_cluster: base cluster {base} does not describe {mesh}")
    cluster = base.with_links([links.get(a, base.link(a)) for a in mesh.names])
    held_out = tuple(HeldOut(f.axes[0], size, t, predicted_all_gather_s(cluster, f.axes[0], size))
                     for f, times in zip(fits, measured) for size, t in zip(all_sizes[fitted:], times[fitted:]))
    return Calibration(cluster, tuple(fits), flat_fit, launch, held_out, tuple(notes))


def predicted_all_gather_s(cluster: ClusterSpec, axis: str, nbytes: float) -> float:
    """The calibrated model's all-gather time on one axis (for held-out checks)."""
    return all_gather_time_s(nbytes, cluster.mesh.size(axis), cluster.link(axis))

