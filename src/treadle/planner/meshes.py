"""The logical meshes the planner searches on a physical cluster, and the parameter dtype a device defaults to."""

from __future__ import annotations

import math

from ..cost.cluster import axis_crosses_nodes, enumerate_meshes
from ..errors import PlanError


def default_dtype(cluster) -> str:
    """The CLI's parameter dtype for `cluster`'s device: "fp32" on cpu, else "bf16" (mixed precision: the
    planner counts fp32 master weights and AdamW states, `TrainSpec`), or "fp16" on a device without a
    bf16 peak (V100)."""
    if cluster.is_cpu():
        return "fp32"
    peaks = cluster.hardware().peak_flops_per_s
    return "bf16" if "bfloat16" in peaks else "fp16" if "float16" in peaks else "fp32"


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(x < 1 for x in shape):
        raise PlanError(f"cannot read mesh {text!r}; write sizes joined by 'x', e.g. 8x8, 16x4 or 64")
    return shape


def search_clusters(cluster, *, from_file: bool = False, mesh: str | None = None, max_axes: int = 2) -> list:
    """The logical meshes `treadle plan` searches on a physical `cluster` (`parse_cluster`'s (nodes, devices)
    mesh: axis 0 across nodes, axis 1 inside): every mesh of `treadle.cost.cluster.enumerate_meshes` with up to
    `max_axes` axes whose innermost axis stays inside a node (the fast link on the inner axis) — 8x8 gives
    (64,), (32, 2), (16, 4), (8, 8). `mesh` ("8x8", "16x4", "64") picks one: the physical shape gives `cluster`
    itself (names "dp", "tp"). A cluster read from a file is planned on its own mesh only.
    Raises PlanError for a mesh whose sizes do not multiply to the world size or that the cluster cannot form."""
    if from_file or cluster.mesh.ndim != 2:
        if mesh is not None and _parse_shape(mesh) != tuple(cluster.mesh.shape):
            raise PlanError(f"--mesh {mesh}: a cluster file fixes its mesh {tuple(cluster.mesh.shape)}; "
                            f"write a cluster spec like 8x8:h100 to choose another")
        return [cluster]
    nodes, dpn = cluster.mesh.shape
    world = nodes * dpn
    if mesh is not None:
        shape = _parse_shape(mesh)
        if shape == (nodes, dpn):
            return [cluster]
        if math.prod(shape) != world:
            raise PlanError(f"--mesh {mesh}: {'x'.join(map(str, shape))} = {math.prod(shape)} devices, but the cluster "
                            f"has {world} ({nodes} nodes x {dpn}); use sizes that multiply to {world}")
        max_axes = max(max_axes, len(shape))
    found = enumerate_meshes(nodes, dpn, intra=cluster.links[1], inter=cluster.links[0], device=cluster.device,
                             max_ndim=max_axes)
    if mesh is not None:
        pick = [c for c in found if tuple(c.mesh.shape) == shape]
        if not pick:
            raise PlanError(f"--mesh {mesh}: not a mesh of {world} devices with every axis of size >= 2; "
                            f"meshes: {sorted({'x'.join(map(str, c.mesh.shape)) for c in found})}")
        return pick
    out = [c for c in found if c.mesh.ndim == 1 or not axis_crosses_nodes(c.mesh.shape, c.mesh.ndim - 1, dpn)]
    return out or [cluster]
