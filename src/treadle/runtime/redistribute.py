"""Execute a layout conversion on the running process groups, with the right backward.

`redistribute(x_local, src, dst, mesh=..., global_shape=...)` asks `treadle.cost.convert.plan_conversion`
for the cheapest path and runs its steps with the autograd collectives of `treadle.runtime.collectives`
(one mesh axis: the axis' group; several axes: a flattened group made once per mesh with
`torch.distributed.new_group`). Each step's backward is its adjoint (NOTE [grad layouts]: the gradient
arriving at the output is complete for its layout, and the one leaving is complete for the input's layout),
so the conversion is autograd-correct end to end. Shapes: `x_local` is this rank's local tensor,
`global_shape` the logical whole.

Every rank must call `redistribute` with the same layouts and shape (SPMD), as with any collective.
"""

from __future__ import annotations

import itertools
import logging
from typing import Sequence

import torch
import torch.distributed as dist

from ..cost.cluster import ClusterSpec
from ..cost.convert import ConversionPlan, ConversionStep, plan_conversion
from ..cost.layout import Layout, local_shape
from ..cost.links import link_preset
from ..errors import LayoutError
from ..mesh import Mesh
from . import collectives as C

logger = logging.getLogger(__name__)

# (world group id, mesh shape, mesh names, axis indices) -> (this rank's group, its ranks in group-rank order)
_FLAT_GROUPS: dict[tuple, tuple[dist.ProcessGroup, list[int]]] = {}


def default_cluster(mesh: Mesh) -> ClusterSpec:
    """The cluster that prices conversions when none is given: every axis on one host's loopback (gloo),
    or NVLink 4 when the job runs NCCL. Pass a calibrated ClusterSpec for better choices."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return ClusterSpec.uniform(mesh, link_preset("nvlink4" if nccl else "loopback"),
                               device="h100-sxm" if nccl else "cpu")


def flat_group(mesh: Mesh, axis_indices: Sequence[int]) -> tuple[dist.ProcessGroup, list[int]]:
    """The process group over several mesh axes at once that contains this rank, and its global ranks in
    group-rank order (torch orders a new group by global rank). Created on first use for all groups of
    that axis set at once, on every rank (new_group is collective over the world), then cached per mesh."""
    axes = tuple(axis_indices)
    key = (id(dist.group.WORLD), mesh.shape, mesh.names, axes)  # a re-initialised world gets new groups
    if key in _FLAT_GROUPS:
        return _FLAT_GROUPS[key]
    me = dist.get_rank()
    mine = None
    others = [i for i in range(mesh.ndim) if i not in axes]
    for rest in itertools.product(*[range(mesh.shape[i]) for i in others]):
        ranks = []
        for sub in itertools.product(*[range(mesh.shape[a]) for a in axes]):
            coord = [0] * mesh.ndim
            for i, c in zip(others, rest):
                coord[i] = c
            for a, c in zip(axes, sub):
                coord[a] = c
            ranks.append(_rank_of(coord, mesh.shape))
        ranks.sort()
        group = dist.new_group(ranks=ranks)
        if me in ranks:
            mine = (group, ranks)
    assert mine is not None  # every rank lies in exactly one group of a partition
    _FLAT_GROUPS[key] = mine
    logger.debug("flat group over axes %s of %s: ranks %s", [mesh.names[a] for a in axes], mesh, mine[1])
    return mine


def _rank_of(coord: Sequence[int], shape: Sequence[int]) -> int:
    r = 0
    for c, s in zip(coord, shape):
        r = r * s + c
    return r


class _ToPartial(torch.autograd.Function):
    """Replicate -> Partial on one axis: coordinate 0 keeps the value, the others hold zeros (the sum is
    unchanged). Backward: identity (the complete gradient of a Partial is the gradient of each summand)."""

    @staticmethod
    def forward(ctx, x, keep: bool):
        return x.clone() if keep else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _group_position(step: ConversionStep, mesh: Mesh, ranks: list[int]) -> list[int]:
    """For each group rank j, the block index (mixed radix over `step.axis_indices`, outer first) of ranks[j]."""
    out = []
    for r in ranks:
        coord = mesh.coordinate(r)
        pos = 0
        for a in step.axis_indices:
            pos = pos * mesh.shape[a] + coord[mesh.names[a]]
        out.append(pos)
    return out


def _run_step(x: torch.Tensor, step: ConversionStep, mesh: Mesh) -> torch.Tensor:
    if len(step.axis_indices) == 1:
        axis = step.axes[0]
        if step.op == "to_partial":
            return _ToPartial.apply(x, mesh.local_rank(axis) == 0)
        group = mesh.group(axis)
        if step.op == "all_reduce":
            return C.all_reduce(x, group)
        if step.op == "reduce_scatter":
            return C.reduce_scatter(x, step.dim, group)
        if step.op == "all_gather":
            return C.all_gather(x, step.dim, group)
        if step.op == "split":
            return C.split(x, step.dim, group)
        if step.op == "all_to_all":
            return C.all_to_all(x, step.dim, step.src_dim, group)
        raise LayoutError(f"redistribute: unknown step {step.op!r}")
    group, ranks = flat_group(mesh, step.axis_indices)
    if step.op == "all_reduce":
        return C.all_reduce(x, group)
    pos = _group_position(step, mesh, ranks)
    if step.op == "reduce_scatter":
        if pos != sorted(pos):  # the planner scatters in ascending axis order, which is group-rank order
            raise LayoutError(f"redistribute: flattened reduce_scatter over {step.axes} needs ascending axis order")
        return C.reduce_scatter(x, step.dim, group)
    if step.op == "all_gather":
        y = C.all_gather(x, step.dim, group)
        if pos == list(range(len(pos))):
            return y
        chunks = y.chunk(len(pos), dim=step.dim)  # chunk j came from group rank j, i.e. block pos[j]
        by_block = [None] * len(pos)
        for j, p in enumerate(pos):
            by_block[p] = chunks[j]
        return torch.cat(by_block, dim=step.dim)
    raise LayoutError(f"redistribute: step {step.op!r} over several axes {step.axes} is not executable")


def run_conversion(x_local: torch.Tensor, plan: ConversionPlan, *, mesh: Mesh) -> torch.Tensor:
    """Run the steps of `plan` on this rank's local tensor (shapes checked first). Returns the local tensor
    in `plan.dst`. Raises LayoutError when `x_local` does not have the local shape of `plan.src`."""
    expected = local_shape(plan.global_shape, plan.src, mesh)
    if tuple(x_local.shape) != expected:
        raise LayoutError(f"redistribute: local tensor has shape {tuple(x_local.shape)}, but {plan.src} of global "
                          f"shape {plan.global_shape} on {mesh} gives local shape {expected}")
    mesh.bind()
    for step in plan.steps:
        x_local = _run_step(x_local, step, mesh)
    return x_local


def redistribute(x_local: torch.Tensor, src: Layout, dst: Layout, *, mesh: Mesh,
                 global_shape: Sequence[int], cluster: ClusterSpec | None = None) -> torch.Tensor:
    """Convert this rank's local tensor from layout `src` to `dst` by the cheapest plan on `cluster`
    (default: `default_cluster(mesh)`), with an autograd-correct backward.

    `x_local` has the local shape of `src` for `global_shape`; the result has the local shape of `dst`.
    Raises LayoutError, before any collective runs, when a layout does not fit the mesh, does not divide
    `global_shape` (uneven shards are not supported), or `x_local` has the wrong local shape; MeshError when
    the mesh does not match the launched world."""
    src = src if isinstance(src, Layout) else Layout(src)
    dst = dst if isinstance(dst, Layout) else Layout(dst)
    if cluster is None:
        cluster = default_cluster(mesh)
    elif cluster.mesh.shape != mesh.shape:
        raise LayoutError(f"redistribute: cluster {cluster} does not describe mesh {mesh}")
    plan = plan_conversion(src, dst, global_shape=global_shape, itemsize=x_local.element_size(), cluster=cluster)
    logger.debug("redistribute %s -> %s: %d steps, %.1f us predicted", src, dst, len(plan.steps), plan.time_s * 1e6)
    return run_conversion(x_local, plan, mesh=mesh)

