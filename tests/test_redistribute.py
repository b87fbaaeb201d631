"""Every layout pair of a 3-D tensor on a 2x2 mesh (world 4) and a 1-D mesh (world 2), run on gloo.

For each pair (per axis R, S0, S1, S2, P; on 2x2 also both shard orders of a dim sharded twice): the local
result equals the expected slice of the global tensor (summed over the Partial axes), and the gradient
through the conversion equals the slice of the output gradient. The reference slicing is written here,
independently of treadle.cost.layout. In the same ranks DTensor.redistribute runs every pair it supports,
its collectives recorded (op, group, bytes), and its planners' intended steps (greedy and graph-based), so the
planner's price can be compared with both (on gloo DTensor swaps all-to-all for all-gather + chunk).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Partial, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from treadle import testing
from treadle.cost import collective_cost as cc
from treadle.cost.cluster import ClusterSpec
from treadle.cost.convert import plan_conversion
from treadle.cost.layout import Layout, enumerate_layouts
from treadle.cost.links import LinkSpec
from treadle.errors import LayoutError
from treadle.mesh import Mesh
from treadle.runtime.redistribute import redistribute

SHAPE = (8, 4, 12)
# pure bandwidth, a slow and a fast axis: the planner reorders shards with all-to-alls to spare the slow axis
BANDWIDTH_ONLY = (LinkSpec(name="slow", latency_s=0.0, bandwidth_bytes_per_s=1e3),
                  LinkSpec(name="fast", latency_s=0.0, bandwidth_bytes_per_s=1e5))
MESHES = {4: ((2, 2), ("a", "b")), 2: ((2,), ("x",))}


# ------------------------------------------------------------------------- independent reference
def _coord(rank: int, mesh_shape) -> list[int]:
    out = []
    for s in reversed(mesh_shape):
        out.append(rank % s)
        rank //= s
    return out[::-1]


def _ref_slices(layout: Layout, mesh_shape, coord, shape=SHAPE) -> tuple[slice, ...]:
    """Rows of the global tensor a rank holds: dim d is cut by its axes in shard order, outer first."""
    out = []
    for d, size in enumerate(shape):
        axes = [a for a, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == d]
        axes = list(layout.shard_order.get(d, axes))
        block, parts = 0, 1
        for a in axes:
            block = block * mesh_shape[a] + coord[a]
            parts *= mesh_shape[a]
        step = size // parts
        out.append(slice(block * step, (block + 1) * step))
    return tuple(out)


def _partial_axes(layout: Layout) -> list[int]:
    return [a for a, p in enumerate(layout.placements) if isinstance(p, Partial)]


def _summand(x: torch.Tensor, layout: Layout, mesh_shape, coord) -> torch.Tensor:
    """This rank's summand of `x` over the Partial axes: random parts, the last one making up the sum."""
    axes = _partial_axes(layout)
    count = math.prod(mesh_shape[a] for a in axes)
    index = 0
    for a in axes:
        index = index * mesh_shape[a] + coord[a]
    parts = [torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(100 + i))
             for i in range(count - 1)]
    return parts[index] if index < count - 1 else x - sum(parts, torch.zeros_like(x))


def _globals():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    w = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    return x, w


# ----------------------------------------------------------------------- DTensor collective recorder
class _CollectiveLog(TorchDispatchMode):
    """Records each c10d functional collective DTensor issues: (op, input bytes, group ranks)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        name = func._schema.name.split("::")[-1]
        arg_names = [a.name for a in func._schema.arguments]
        if ns == "_c10d_functional" and "group_name" in arg_names:  # a collective (not wait_tensor etc.)
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = kwargs.get("group_name", args[arg_names.index("group_name")])
            group = group if isinstance(group, dist.ProcessGroup) else _resolve_process_group(group)
            ranks = tuple(dist.get_process_group_ranks(group))
            inp = args[0]
            self.calls.append((name, inp.numel() * inp.element_size(), ranks))
        return func(*args, **kwargs)


def _dtensor_transforms(dt, mesh: Mesh, dst: Layout) -> dict[str, list[tuple[int, str, str]]]:
    """DTensor's own plans for the pair, as (mesh dim, src, dst placement) steps: its default (greedy)
    planner and its graph-based min-cost planner. Their collectives are what it runs on NCCL; on gloo it
    swaps all-to-all for all-gather + chunk, so these are priced too."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

    dst_spec = DTensorSpec(mesh.device_mesh, tuple(dst.placements), tensor_meta=dt._spec.tensor_meta)
    return {mode: [(i.mesh_dim, str(i.src_dst_placements[0]), str(i.src_dst_placements[1]))
                   for i in _gen_transform_infos_non_cached(dt._spec, dst_spec, use_graph_based_transform=graph)]
            for mode, graph in (("greedy", False), ("graph", True))}


def _run_dtensor(mesh: Mesh, x_local, src: Layout, dst: Layout, *, plans: bool):
    """DTensor's result, its collectives and, when `plans`, its planners' intended steps (`_plan_rank`)."""
    from torch.distributed.tensor import DTensor

    dt = DTensor.from_local(x_local.detach(), mesh.device_mesh, list(src.placements), run_check=False,
                            shape=torch.Size(SHAPE), stride=torch.empty(SHAPE).stride())
    log = _CollectiveLog()
    try:
        with log:
            out = dt.redistribute(mesh.device_mesh, list(dst.placements)).to_local()
    except Exception as exc:  # DTensor does not support every pair (e.g. Shard -> Partial): recorded as such
        return None, f"{type(exc).__name__}: {exc}", None
    return out, log.calls, _dtensor_transforms(dt, mesh, dst) if plans else None


# ----------------------------------------------------------------------------------- rank function
def _plan_rank(k: int, world: int) -> int:
    """The rank that computes DTensor's planned steps for pair `k`. The plans are the same on every rank (SHAPE
    divides evenly on both meshes, so no rank's local shape differs) and the graph-based planner is most of the
    spawn's time: each pair's is computed once, the pairs dealt round-robin over the ranks."""
    return k % world


def _rank_all_pairs(rank: int, world: int, mesh_shape, names, pairs):
    mesh = Mesh(mesh_shape, names).bind()
    coord = _coord(rank, mesh_shape)
    x_glob, w_glob = _globals()
    # the default (loopback) prices pick flattened collectives; bandwidth-only prices pick all-to-all detours
    clusters = {"default": None, "bandwidth": ClusterSpec(mesh, BANDWIDTH_ONLY[:len(mesh_shape)])}
    results = []
    for src, dst in pairs:
        runs = {}
        for label, cluster in clusters.items():
            x = _summand(x_glob, src, mesh_shape, coord)[_ref_slices(src, mesh_shape, coord)].clone()
            x.requires_grad_()
            y = redistribute(x, src, dst, mesh=mesh, global_shape=SHAPE, cluster=cluster)
            # NOTE [grad layouts]: the gradient arriving at the output is complete for its layout
            y.backward(w_glob[_ref_slices(dst, mesh_shape, coord)].clone())
            runs[label] = (y.detach(), x.grad.detach())
        dtensor = (_run_dtensor(mesh, x, src, dst, plans=rank == _plan_rank(len(results), world))
                   if src.has_default_order and dst.has_default_order else None)
        results.append((runs, dtensor))
    return results


def _all_pairs(mesh_ndim: int):
    layouts = list(enumerate_layouts(mesh_ndim, 3, shard_orders=True))
    return [(a, b) for a in layouts for b in layouts]


_RUNS: dict[int, tuple] = {}


def _conversions(world: int):
    """One spawn per mesh runs every pair (each spawn costs seconds); shared by the tests below."""
    if world not in _RUNS:
        mesh_shape, names = MESHES[world]
        pairs = _all_pairs(len(mesh_shape))
        per_rank = testing.spawn(_rank_all_pairs, world, mesh_shape, names, pairs, timeout_s=240)
        _RUNS[world] = (world, mesh_shape, names, pairs, per_rank)
    return _RUNS[world]


@pytest.fixture(params=[4, 2], ids=["2x2", "1d-2"])
def conversions(request):
    return _conversions(request.param)


@pytest.mark.slow
def test_every_pair_gives_expected_slices_and_gradients(conversions):
    world, mesh_shape, names, pairs, per_rank = conversions
    assert len(pairs) == (784 if world == 4 else 25)
    x_glob, w_glob = _globals()
    for k, (src, dst) in enumerate(pairs):
        p_axes = _partial_axes(dst)
        for label in ("default", "bandwidth"):
            sums: dict[tuple, torch.Tensor] = {}
            for rank in range(world):
                y, x_grad = per_rank[rank][k][0][label]
                coord = _coord(rank, mesh_shape)
                key = tuple(c for a, c in enumerate(coord) if a not in p_axes)
                sums[key] = sums[key] + y if key in sums else y.clone()
                torch.testing.assert_close(x_grad, w_glob[_ref_slices(src, mesh_shape, coord)],
                                           msg=lambda m: f"grad {src} -> {dst} ({label}) rank {rank}: {m}")
            for rank in range(world):
                coord = _coord(rank, mesh_shape)
                key = tuple(c for a, c in enumerate(coord) if a not in p_axes)
                torch.testing.assert_close(sums[key], x_glob[_ref_slices(dst, mesh_shape, coord)],
                                           msg=lambda m: f"value {src} -> {dst} ({label}) rank {rank}: {m}")


def _dtensor_time_s(calls, cluster: ClusterSpec, mesh: Mesh, itemsize: int = 8) -> float:
    total = 0.0
    for name, in_bytes, ranks in calls:
        n = len(ranks)
        axes = [a for a in mesh.names if sorted(mesh.ranks_along(a, ranks[0])) == sorted(ranks)]
        assert axes, f"DTensor used a group {ranks} that is no single mesh axis"
        link = cluster.link(axes[0])
        if name.startswith("all_gather"):
            total += cc.all_gather_time_s(in_bytes * n, n, link)
        elif name.startswith("reduce_scatter"):
            total += cc.reduce_scatter_time_s(in_bytes, n, link)
        elif name.startswith("all_reduce"):
            total += cc.all_reduce_time_s(in_bytes, n, link)
        elif name.startswith("all_to_all"):
            total += cc.all_to_all_time_s(in_bytes, n, link)
        else:
            raise AssertionError(f"unpriced DTensor collective {name}")
    return total


def _transforms_time_s(steps, src: Layout, cluster: ClusterSpec, mesh: Mesh, itemsize: int = 8) -> float:
    """Price DTensor's placement steps with treadle's collective costs; local bytes before each step follow
    from which axes shard (the shard order does not change a rank's byte count)."""
    placements = [str(p) for p in src.placements]
    total = 0.0
    for mesh_dim, before, after in steps:
        assert placements[mesh_dim] == before, f"DTensor step {before} -> {after} on {placements}"
        n = mesh.shape[mesh_dim]
        link = cluster.link(mesh_dim)
        factor = math.prod(mesh.shape[a] for a, p in enumerate(placements) if p.startswith("S"))
        local_bytes = math.prod(SHAPE) * itemsize // factor
        kind = (before[0], after[0])
        if kind == ("S", "R"):
            total += cc.all_gather_time_s(local_bytes * n, n, link)
        elif kind == ("P", "R"):
            total += cc.all_reduce_time_s(local_bytes, n, link)
        elif kind == ("P", "S"):
            total += cc.reduce_scatter_time_s(local_bytes, n, link)
        elif kind == ("S", "S"):
            total += cc.all_to_all_time_s(local_bytes, n, link)
        elif kind not in (("R", "S"), ("R", "P")):  # local moves cost nothing
            raise AssertionError(f"unpriced DTensor step {before} -> {after}")
        placements[mesh_dim] = after
    return total


HETERO = (LinkSpec(name="slow", latency_s=10e-6, bandwidth_bytes_per_s=1e9, launch_s=5e-6),
          LinkSpec(name="fast", latency_s=1e-6, bandwidth_bytes_per_s=2e10, launch_s=5e-6))


@pytest.mark.slow
def test_planner_never_costlier_than_dtensor(conversions):
    world, mesh_shape, names, pairs, per_rank = conversions
    mesh = Mesh(mesh_shape, names)
    clusters = [ClusterSpec.uniform(mesh, "loopback"), ClusterSpec.uniform(mesh, "nvlink4")]
    if len(mesh_shape) == 2:
        clusters.append(ClusterSpec(mesh, HETERO))
    compared = 0
    for k, (src, dst) in enumerate(pairs):
        dtensor = per_rank[0][k][1]
        if dtensor is None or dtensor[0] is None:
            continue
        out, calls, _ = dtensor
        transforms = per_rank[_plan_rank(k, world)][k][1][2]
        if not _partial_axes(dst):  # DTensor's own result is one more independent check
            torch.testing.assert_close(out, per_rank[0][k][0]["default"][0],
                                       msg=lambda m: f"DTensor {src} -> {dst}: {m}")
        compared += 1
        for cluster in clusters:
            plan = plan_conversion(src, dst, global_shape=SHAPE, itemsize=8, cluster=cluster)
            theirs = _dtensor_time_s(calls, cluster, mesh)
            assert plan.time_s <= theirs * (1 + 1e-9) + 1e-15, (
                f"{src} -> {dst} on {cluster}: planner {plan.time_s:.3e} s > DTensor {theirs:.3e} s\n{plan}\n{calls}")
            for mode, steps in transforms.items():
                intended = _transforms_time_s(steps, src, cluster, mesh)
                assert plan.time_s <= intended * (1 + 1e-9) + 1e-15, (
                    f"{src} -> {dst} on {cluster}: planner {plan.time_s:.3e} s > DTensor {mode} plan "
                    f"{intended:.3e} s\n{plan}\n{steps}")
    # DTensor supports all but the pairs it rejects (Shard/Partial -> Partial need a Replicate first)
    assert compared >= (400 if world == 4 else 20)


@pytest.mark.slow
def test_s0s0_to_rr_strictly_cheaper_than_dtensor():
    world, mesh_shape, names, pairs, per_rank = _conversions(4)
    mesh = Mesh(mesh_shape, names)
    src, dst = Layout.parse("S0 S0"), Layout.parse("R R")
    out, calls, _ = per_rank[0][pairs.index((src, dst))][1]
    assert [c[0] for c in calls] == ["all_gather_into_tensor"] * 2  # DTensor: one gather per axis
    for cluster in (ClusterSpec.uniform(mesh, "loopback"), ClusterSpec.uniform(mesh, "nvlink4")):
        plan = plan_conversion(src, dst, global_shape=SHAPE, itemsize=8, cluster=cluster)
        assert [(s.op, s.axes) for s in plan.steps] == [("all_gather", ("a", "b"))]
        assert plan.num_collectives == 1 < len(calls)
        theirs_sent = sum(b * (len(r) - 1) for _, b, r in calls)  # ring all-gather: n-1 input chunks each
        assert plan.sent_bytes == pytest.approx(theirs_sent)
        assert plan.time_s < _dtensor_time_s(calls, cluster, mesh)


# ------------------------------------------------------------------------- errors before collectives
def test_wrong_local_shape_and_uneven_layout_raise_before_any_collective():
    mesh = Mesh((2, 2), ("a", "b"))  # not bound: the checks must fire before any process group is needed
    with pytest.raises(LayoutError, match=r"redistribute: local tensor has shape \(8, 4, 12\), but \(S\(0\), R\) "
                                          r"of global shape \(8, 4, 12\) on Mesh\(a=2, b=2\) gives local shape "
                                          r"\(4, 4, 12\)"):
        redistribute(torch.zeros(SHAPE), Layout.parse("S0 R"), Layout.parse("R R"), mesh=mesh, global_shape=SHAPE)
    with pytest.raises(LayoutError, match=r"target layout \(S\(2\), S\(2\)\): tensor dim 2 has size 6 .* "
                                          r"not divisible by 4 \(mesh axes a=2 x b=2\)"):
        redistribute(torch.zeros((8, 4, 6)), Layout.parse("R R"), Layout.parse("S2 S2"), mesh=mesh,
                     global_shape=(8, 4, 6))
    with pytest.raises(LayoutError, match=r"does not describe mesh"):
        redistribute(torch.zeros(SHAPE), Layout.parse("R R"), Layout.parse("R R"), mesh=mesh, global_shape=SHAPE,
                     cluster=ClusterSpec.uniform(Mesh((4,), ("x",)), "loopback"))



# ------------------------------------------------------------------------------ a 2x2x2 mesh (world 8)
SHAPE_3D = (8, 16)
LAUNCH_BOUND = LinkSpec(name="launch-bound", latency_s=10e-6, bandwidth_bytes_per_s=1e9, launch_s=1e-3)
PAIRS_3D = [("S0 S0 S0", "R R R"), ("S0 S0 S0 @0:2>0>1", "R R R"), ("P P P", "S0 S0 S0"), ("P R P", "R R R"),
            ("S1 R S1", "R R R"), ("S1 R S1 @1:2>0", "R S1 R"), ("P S0 P", "S1 S0 S1"), ("S0 S1 S0", "S1 S0 P"),
            ("R R R", "S1 S1 S0"), ("P P R", "S0 R S0")]


def _rank_3d(rank: int, world: int, pairs):
    mesh_shape = (2, 2, 2)
    mesh = Mesh(mesh_shape, ("x", "y", "z")).bind()
    cluster = ClusterSpec.uniform(mesh, LAUNCH_BOUND)
    coord = _coord(rank, mesh_shape)
    g = torch.Generator().manual_seed(1)
    x_glob, w_glob = torch.randn(SHAPE_3D, generator=g), torch.randn(SHAPE_3D, generator=g)
    out = []
    for src, dst in pairs:
        part = _summand(x_glob, src, mesh_shape, coord)
        x = part[_ref_slices(src, mesh_shape, coord, SHAPE_3D)].clone().requires_grad_()
        y = redistribute(x, src, dst, mesh=mesh, global_shape=SHAPE_3D, cluster=cluster)
        y.backward(w_glob[_ref_slices(dst, mesh_shape, coord, SHAPE_3D)].clone())
        out.append((y.detach(), x.grad.detach()))
    return out


@pytest.mark.slow
def test_three_axis_mesh_flattened_groups_on_world_8():
    pairs = [(Layout.parse(a), Layout.parse(b)) for a, b in PAIRS_3D]
    mesh_shape = (2, 2, 2)
    cluster = ClusterSpec.uniform(Mesh(mesh_shape, ("x", "y", "z")), LAUNCH_BOUND)
    flat_axes = {s.axes for src, dst in pairs for s in plan_conversion(
        src, dst, global_shape=SHAPE_3D, itemsize=4, cluster=cluster).steps if len(s.axes) > 1}
    # one collective over all three axes, over two non-adjacent axes, and in a non-ascending shard order
    assert {("x", "y", "z"), ("x", "z"), ("z", "x")} <= flat_axes
    per_rank = testing.spawn(_rank_3d, 8, pairs, timeout_s=180)
    g = torch.Generator().manual_seed(1)
    x_glob, w_glob = torch.randn(SHAPE_3D, generator=g), torch.randn(SHAPE_3D, generator=g)
    for k, (src, dst) in enumerate(pairs):
        p_axes = _partial_axes(dst)
        sums: dict[tuple, torch.Tensor] = {}
        for rank in range(8):
            y, x_grad = per_rank[rank][k]
            coord = _coord(rank, mesh_shape)
            key = tuple(c for a, c in enumerate(coord) if a not in p_axes)
            sums[key] = sums[key] + y if key in sums else y.clone()
            torch.testing.assert_close(x_grad, w_glob[_ref_slices(src, mesh_shape, coord, SHAPE_3D)],
                                       msg=lambda m: f"grad {src} -> {dst} rank {rank}: {m}")
        for rank in range(8):
            coord = _coord(rank, mesh_shape)
            key = tuple(c for a, c in enumerate(coord) if a not in p_axes)
            torch.testing.assert_close(sums[key], x_glob[_ref_slices(dst, mesh_shape, coord, SHAPE_3D)],
                                       msg=lambda m: f"value {src} -> {dst} rank {rank}: {m}")
