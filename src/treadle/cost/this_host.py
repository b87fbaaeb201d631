"""Measure the host a plan is made on: one CPU core, then the gloo links of its ranks, in about a minute.

A CPU cluster preset (``"2x2:cpu"``) describes a nominal core and loopback links; on a small shared host the
ranks share cores and gloo's collectives cost milliseconds, so a plan made on the preset may rank its
candidates in the wrong order (issue 32: data x tensor parallelism chosen, measured 1.32x DDP's step).
`calibrate_this_host(mesh)` measures what the planner needs instead: one core (`calibrate_cpu`), then each
mesh axis' link, the world group's link and FSDP2's host costs on `mesh.world_size` spawned gloo ranks
(`calibrate_cluster`, NOTE [calibration rounds]), and records the ranks' placement on this host's cores. The
result is returned, never cached (NOTE [no hidden state]): `treadle plan` records it in the plan it writes,
`treadle calibrate -o` in a file. Inside a launched job (`python -m treadle.run --plan auto`) every rank calls
`calibrate_cluster` itself; `host_clusters` turns either calibration into the meshes the planner searches.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

from ..errors import LayoutError
from ..mesh import Mesh
from .calibrate import (DEFAULT_CHAIN, DEFAULT_HELD_OUT_BYTES, DEFAULT_LEAD_COMPUTE_S, DEFAULT_ROUNDS, Calibration,
                        calibrate_cluster)
from .cluster import ClusterSpec, axis_crosses_nodes, default_axis_names, device_copy_bytes_per_s
from .links import LinkSpec, link_preset


def measures_this_host(cluster: ClusterSpec, spec: str, *, nominal: bool = False) -> bool:
    """Whether a plan on `cluster` (parsed from `spec`) measures this host first: a cpu preset does, unless
    `nominal`; a cluster file (written by `treadle calibrate`, or by hand) and a GPU preset are taken as they
    are (NOTE [plan for this host] in treadle.cli.plan)."""
    return cluster.is_cpu() and not spec.strip().endswith(".json") and not nominal


def calibration_mesh(world: int, shape: tuple[int, ...] | None = None) -> Mesh:
    """The mesh a host of `world` ranks is calibrated on: `shape` when given (default axis names), else the
    squarest two axes (4 -> 2x2, 8 -> 2x4, 6 -> 2x3) whose groups and world group give every link a 1-D or 2-D
    plan uses, else one axis (a prime world). Raises LayoutError when `shape` does not multiply to `world`."""
    if shape is not None:
        if math.prod(shape) != world:
            raise LayoutError(f"calibration_mesh: mesh {'x'.join(map(str, shape))} has {math.prod(shape)} ranks, "
                              f"not {world}")
        return Mesh(tuple(shape), default_axis_names(len(shape)))
    outer = max((a for a in range(2, math.isqrt(world) + 1) if world % a == 0), default=None)
    dims = (outer, world // outer) if outer else (world,)
    return Mesh(dims, default_axis_names(len(dims)))


def host_clusters(cluster: ClusterSpec) -> list[ClusterSpec]:
    """The clusters a plan for this host searches, from one calibration: the calibrated cluster itself and,
    on a mesh of two or more axes, the 1-D mesh over every rank on the measured world-group link (data or
    tensor parallelism over all ranks runs on that group), first."""
    if cluster.mesh.ndim < 2:
        return [cluster]
    live = tuple(a for a, n in zip(cluster.mesh.names, cluster.mesh.shape) if n > 1)
    world_link = cluster.group_link(live)
    flat = ClusterSpec(Mesh((cluster.world_size,), default_axis_names(1)), (world_link,), cluster.device,
                       cluster.copy_bytes_per_s, cluster.threads_per_rank, cluster.ranks_per_host,
                       cluster.cores_per_host)
    return [flat, cluster]


def calibrate_group(mesh: Mesh, device, *, threads_per_rank: int, ranks_per_host: int,
                    links: tuple | None = None, **kwargs) -> Calibration:
    """Every rank of the running gloo group (`mesh.world_size` ranks): `calibrate_cluster(mesh, **kwargs)` on
    `device` (a measured core, or "cpu"), the result placed as these ranks run: `threads_per_rank` threads,
    `ranks_per_host` ranks on this host's `os.cpu_count()` cores. `links`: the stated link of each axis before
    measuring (default: loopback for all, one channel: NOTE [one channel, one link]). `calibrate_this_host`
    spawns ranks for it; `python -m treadle.run --plan auto` calls it on its launched group."""
    base = (ClusterSpec.uniform(mesh, "loopback", device=device) if links is None
            else ClusterSpec(mesh, tuple(links), device, device_copy_bytes_per_s(device)))
    cal = calibrate_cluster(mesh, base=base, **kwargs)
    cluster = cal.cluster.with_ranks(threads_per_rank=threads_per_rank, ranks_per_host=ranks_per_host,
                                     cores_per_host=os.cpu_count() or 1)
    return dataclasses.replace(cal, cluster=cluster)


def _calibrate_rank(rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...], device, kwargs: dict,
                    links: tuple | None = None) -> str:
    import torch

    torch.set_num_threads(1)  # a rank of a training job here computes on one thread (NOTE [rank device])
    return calibrate_group(Mesh(shape, names), device, threads_per_rank=1, ranks_per_host=world, links=links,
                           **kwargs).to_json()


def emulated_links(mesh: Mesh, nodes) -> tuple[LinkSpec, ...]:
    """The link each axis of `mesh` is stated to have on emulated nodes (`treadle.emulated_nodes`, ranks
    node-major) before it is measured: loopback for an axis whose groups stay inside a node, the rate limit
    between nodes for one that crosses them (named after it, so the two are never one channel)."""
    if mesh.world_size != nodes.world_size:
        raise LayoutError(f"calibrate: mesh {mesh} has {mesh.world_size} ranks but {nodes} has {nodes.world_size}")
    inter = LinkSpec(name=f"emulated {nodes.rate}", latency_s=100e-6, bandwidth_bytes_per_s=nodes.rate_bytes_per_s)
    loop = link_preset("loopback")
    return tuple(inter if axis_crosses_nodes(mesh.shape, i, nodes.ranks_per_node) else loop
                 for i in range(mesh.ndim))


def calibrate_this_host(mesh: Mesh, *, rounds: int = DEFAULT_ROUNDS, held_out: bool = False,
                        lead_compute_s: float = DEFAULT_LEAD_COMPUTE_S, chain: int = DEFAULT_CHAIN,
                        cpu: bool = True, timeout_s: float = 300.0, nodes=None) -> Calibration:
    """Measure this host for a job of `mesh.world_size` gloo ranks, one thread each: one core first
    (`calibrate_cpu(threads=1)`, with no rank running; `cpu=False` keeps the nominal "cpu" device), then
    `calibrate_cluster(mesh)` on spawned ranks (`rounds` sweeps, the held-out sizes only with `held_out`).
    The returned Calibration's cluster states the placement (1 thread per rank, every rank on this host's
    `os.cpu_count()` cores) and its notes say what was measured, when and in how long. Raises SpawnError
    (treadle.testing.spawn) when the ranks fail or pass `timeout_s`; a mesh of one rank measures the core
    alone. `nodes`: running emulated nodes (`treadle.emulated_nodes`) the ranks run on, node-major: an axis
    that crosses nodes is measured over their rate-limited link (`emulated_links`), and the notes say so."""
    from ..testing import spawn

    t0 = time.perf_counter()
    device: object = "cpu"
    if cpu:
        from ..profile.hardware import calibrate_cpu

        device = calibrate_cpu(threads=1)
    cores = os.cpu_count() or 1
    if mesh.world_size < 2:  # one rank: no link to measure, the core is all there is
        cluster = ClusterSpec.uniform(mesh, "loopback", device=device).with_ranks(
            threads_per_rank=1, ranks_per_host=1, cores_per_host=cores)
        return Calibration(cluster, (), notes=(f"measured on this host ({cores} cores, one rank of 1 thread) at "
                                               f"{time.strftime('%Y-%m-%dT%H:%M:%S')}: "
                                               + ("the core only, no link" if cpu else "nothing: no link, the "
                                                  "nominal 'cpu' core"),))
    kwargs = {"rounds": rounds, "lead_compute_s": lead_compute_s, "chain": chain,
              "held_out_bytes": DEFAULT_HELD_OUT_BYTES if held_out else ()}
    links = emulated_links(mesh, nodes) if nodes is not None else None
    text = spawn(_calibrate_rank, mesh.world_size, tuple(mesh.shape), tuple(mesh.names), device, kwargs, links,
                 timeout_s=timeout_s, nodes=nodes)[0]
    cal = Calibration.from_json(text)
    across = [a for i, a in enumerate(mesh.names) if nodes is not None
              and axis_crosses_nodes(mesh.shape, i, nodes.ranks_per_node)]
    where = "" if nodes is None else f" as {nodes} (axes across nodes: {', '.join(across) or 'none'})"
    note = (f"measured on this host ({cores} cores, {mesh.world_size} gloo ranks of 1 thread{where}) at "
            f"{time.strftime('%Y-%m-%dT%H:%M:%S')} in {time.perf_counter() - t0:.0f} s"
            + ("" if cpu else "; the core is the nominal 'cpu' preset, not measured"))
    return dataclasses.replace(cal, notes=(note, *cal.notes))
