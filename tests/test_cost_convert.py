"""Layout conversion planner: chosen collectives, hand-priced paths, optimality, memoisation, errors."""

import itertools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from treadle.cost import collective_cost as cc
from treadle.cost.cluster import ClusterSpec, parse_cluster
from treadle.cost.convert import _edges, plan_conversion
from treadle.cost.layout import Layout, enumerate_layouts
from treadle.cost.links import LINK_PRESETS, LinkSpec
from treadle.errors import LayoutError
from treadle.mesh import Mesh

MESH = Mesh((2, 2), ("a", "b"))
LOOP = ClusterSpec.uniform(MESH, "loopback")
SHAPE = (8, 4, 12)
HETERO = ClusterSpec(MESH, (LinkSpec(name="slow", latency_s=10e-6, bandwidth_bytes_per_s=1e9, launch_s=5e-6),
                            LinkSpec(name="fast", latency_s=1e-6, bandwidth_bytes_per_s=2e10, launch_s=5e-6)))


HETERO_COPY = HETERO.with_links(HETERO.links, copy_bytes_per_s=1e10)


def _ops(plan):
    return [(s.op, s.axes, s.dim) for s in plan.steps]


def test_partial_to_shard_goes_by_reduce_scatter():
    plan = plan_conversion(Layout.parse("P R"), Layout.parse("S1 R"), global_shape=SHAPE, itemsize=4, cluster=LOOP)
    assert _ops(plan) == [("reduce_scatter", ("a",), 1)]
    nbytes = math.prod(SHAPE) * 4
    assert plan.time_s == pytest.approx(cc.reduce_scatter_time_s(nbytes, 2, LINK_PRESETS["loopback"]))
    assert plan.backward_time_s == pytest.approx(cc.all_gather_time_s(nbytes, 2, LINK_PRESETS["loopback"]))


def test_shard_to_shard_goes_by_all_to_all():
    plan = plan_conversion(Layout.parse("R S0"), Layout.parse("R S2"), global_shape=SHAPE, itemsize=4, cluster=LOOP)
    assert [(s.op, s.axes, s.src_dim, s.dim) for s in plan.steps] == [("all_to_all", ("b",), 0, 2)]
    local_bytes = math.prod(SHAPE) * 4 // 2
    assert plan.steps[0].nbytes == local_bytes
    assert plan.time_s == pytest.approx(cc.all_to_all_time_s(local_bytes, 2, LINK_PRESETS["loopback"]))


def test_local_copies_priced_when_the_cluster_has_a_copy_rate():
    rate = 1e11  # fast enough that the all-to-all stays cheaper than gather + split
    cl = LOOP.with_links(LOOP.links, copy_bytes_per_s=rate)
    local_bytes = math.prod(SHAPE) * 4 // 2
    a2a = plan_conversion("R S0", "R S2", global_shape=SHAPE, itemsize=4, cluster=cl)
    free = plan_conversion("R S0", "R S2", global_shape=SHAPE, itemsize=4, cluster=LOOP)
    assert a2a.steps[0].copy_bytes == 2 * local_bytes and free.steps[0].copy_bytes == 2 * local_bytes
    assert a2a.time_s == pytest.approx(free.time_s + 2 * local_bytes / rate)
    # NOTE [copies], as the runtime runs them: a gather on dim 0 packs nothing; on dim 2 it concatenates its
    # gathered chunks (its output), and its backward (a split of the complete gradient) clones its chunk
    g0 = plan_conversion("S0 R", "R R", global_shape=SHAPE, itemsize=4, cluster=cl)
    g2 = plan_conversion("S2 R", "R R", global_shape=SHAPE, itemsize=4, cluster=cl)
    assert g0.local_ops == g0.backward_local_ops == (0,) and g2.local_ops == (0, 0, 2 * local_bytes)
    assert g2.backward_local_ops == (0, local_bytes) and g2.steps[0].copy_bytes == 2 * local_bytes
    assert g2.time_s == pytest.approx(g0.time_s + 2 * local_bytes / rate)
    assert g2.backward_time_s == pytest.approx(g0.backward_time_s + local_bytes / rate)
    # a sum: the all-reduce clones its buffer; a reduce-scatter on dim 2 concatenates its input's chunks, and
    # its backward (a gather) its output
    ar = plan_conversion("P R", "R R", global_shape=SHAPE, itemsize=4, cluster=cl)
    rs = plan_conversion("P R", "S2 R", global_shape=SHAPE, itemsize=4, cluster=cl)
    full = 2 * local_bytes
    assert (ar.local_ops, ar.backward_local_ops) == ((full,), ())
    assert [s.op for s in rs.steps] == ["reduce_scatter"]
    assert (rs.local_ops, rs.backward_local_ops) == ((0, full, 0), (0, 0, full))
    with pytest.raises(LayoutError, match=r"copy_bytes_per_s must be > 0 or None; got 0"):
        LOOP.with_links(LOOP.links, copy_bytes_per_s=0)


def test_partial_to_replicate_priced_by_hand():
    plan = plan_conversion(Layout.parse("P R"), Layout.parse("R R"), global_shape=SHAPE, itemsize=8, cluster=LOOP)
    link = LINK_PRESETS["loopback"]
    b = math.prod(SHAPE) * 8
    ring = link.launch_s + 2 * (link.latency_s + b / 2 / link.bandwidth_bytes_per_s)
    tree = link.launch_s + 2 * (link.latency_s + b / link.bandwidth_bytes_per_s)
    assert _ops(plan) == [("all_reduce", ("a",), None)] and plan.time_s == pytest.approx(min(ring, tree))
    assert plan.backward_time_s == 0.0 and plan.num_collectives == 1


def test_double_shard_gather_flat_or_hierarchical_by_cost():
    src, dst = Layout.parse("S0 S0"), Layout.parse("R R")
    flat = plan_conversion(src, dst, global_shape=SHAPE, itemsize=4, cluster=LOOP)
    assert _ops(flat) == [("all_gather", ("a", "b"), 0)]  # launch cost dominates a small tensor
    big = (1 << 14, 64, 64)
    nbytes = math.prod(big) * 4
    hier_s = cc.all_gather_axes_time_s(nbytes, cluster=HETERO, axes=("a", "b"), algorithm="hierarchical")
    # reversed shard order: axis a is innermost, so the slow axis gathers first, on half the data
    rev = plan_conversion(Layout.parse("S0 S0 @0:1>0"), dst, global_shape=big, itemsize=4, cluster=HETERO)
    assert _ops(rev) == [("all_gather", ("a",), 0), ("all_gather", ("b",), 0)]
    slow, fast = HETERO.links
    assert rev.time_s == pytest.approx(cc.all_gather_time_s(nbytes / 2, 2, slow)
                                       + cc.all_gather_time_s(nbytes, 2, fast))
    # default order: gathering b then a moves all the data over the slow axis; a cheap all-to-all on the
    # fast axis first moves b's shard to dim 1, so the slow axis again gathers only half the data
    plan = plan_conversion(src, dst, global_shape=big, itemsize=4, cluster=HETERO)
    assert _ops(plan) == [("all_to_all", ("b",), 1), ("all_gather", ("a",), 0), ("all_gather", ("b",), 1)]
    assert plan.time_s == pytest.approx(cc.all_to_all_time_s(nbytes / 4, 2, fast) + rev.time_s)
    assert plan.time_s < 0.6 * hier_s


def test_three_axis_mesh_flattened_gather_and_reduce():
    mesh = Mesh((2, 2, 2), ("x", "y", "z"))
    # a flat ring of 8 takes 7 steps against 1 + 1 + 1 for three gathers: it wins once launch > 2 x latency
    cl = ClusterSpec.uniform(mesh, LinkSpec(name="l", latency_s=10e-6, bandwidth_bytes_per_s=1e9, launch_s=100e-6))
    plan = plan_conversion(Layout.parse("S1 S1 S1"), Layout.parse("R R R"), global_shape=(4, 16), itemsize=4,
                           cluster=cl)
    assert _ops(plan) == [("all_gather", ("x", "y", "z"), 1)]
    plan = plan_conversion(Layout.parse("P P P"), Layout.parse("S0 S0 S0"), global_shape=(4096, 64), itemsize=4,
                           cluster=cl)
    assert _ops(plan) == [("reduce_scatter", ("x", "y", "z"), 0)]


def test_search_is_optimal_against_brute_force():
    """Every path of up to 4 moves, enumerated: none beats the planner's."""
    shape = (8, 4, 12)
    layouts = list(enumerate_layouts(2, 3, shard_orders=True))
    start_states = [(lay.codes, lay.order) for lay in layouts]
    links = HETERO.links
    best: dict = {}
    frontier = {s: 0.0 for s in start_states[:6]}
    for src in list(frontier):
        reach = {src: 0.0}
        layer = {src: 0.0}
        for _ in range(4):
            nxt = {}
            for state, cost in layer.items():
                for to, edge in _edges(state, shape, math.prod(shape) * 4, (2, 2), links, 1e-10):
                    c = cost + edge[5]
                    if c < min(reach.get(to, math.inf), nxt.get(to, math.inf)):
                        nxt[to] = c
            for k, v in nxt.items():
                reach[k] = min(reach.get(k, math.inf), v)
            layer = nxt
        best[src] = reach
    for src, reach in best.items():
        for dst, cost in reach.items():
            plan = plan_conversion(Layout._from_codes(*src), Layout._from_codes(*dst), global_shape=shape,
                                   itemsize=4, cluster=HETERO_COPY)
            assert plan.time_s <= cost + 1e-15, f"{plan}\nbrute force: {cost}"


def test_total_objective_trades_forward_for_backward_consistently():
    layouts = list(enumerate_layouts(2, 3))
    for src, dst in itertools.product(layouts[::3], layouts[::2]):
        fwd = plan_conversion(src, dst, global_shape=SHAPE, itemsize=4, cluster=HETERO)
        tot = plan_conversion(src, dst, global_shape=SHAPE, itemsize=4, cluster=HETERO, objective="total")
        assert fwd.time_s <= tot.time_s + 1e-15 and tot.total_time_s <= fwd.total_time_s + 1e-15
        assert fwd.steps[-1].after == dst if fwd.steps else src == dst


def test_plans_are_memoised_and_printable():
    a = plan_conversion(Layout.parse("S0 R"), Layout.parse("R S1"), global_shape=SHAPE, itemsize=4, cluster=LOOP)
    b = plan_conversion("S0 R", "R S1", global_shape=list(SHAPE), itemsize=4, cluster=LOOP)
    assert a is b
    text = str(a)
    assert text.splitlines()[0].startswith("(S(0), R) -> (R, S(1)) of (8, 4, 12) x 4 B:")
    assert len(text.splitlines()) == 1 + len(a.steps) and str(a.steps[0]) in text
    assert str(plan_conversion("R R", "R R", global_shape=SHAPE, itemsize=4, cluster=LOOP)).endswith("(no-op)")


def test_presets_cluster_and_errors():
    cl = parse_cluster("8x8:h100")
    plan = plan_conversion("S0 S0", "R R", global_shape=(4096, 4096), itemsize=2, cluster=cl)
    assert plan.time_s > 0 and plan.steps[-1].after == Layout.parse("R R")
    with pytest.raises(LayoutError, match=r"plan_conversion: target layout \(S\(1\), S\(1\)\): tensor dim 1 has size "
                                          r"4 \(shape \(8, 4, 12\)\), not divisible by 64 \(mesh axes dp=8 x tp=8\)"):
        plan_conversion("R R", "S1 S1", global_shape=SHAPE, itemsize=4, cluster=cl)
    with pytest.raises(LayoutError, match=r"objective must be 'forward' or 'total'; got 'fast'"):
        plan_conversion("R R", "R R", global_shape=SHAPE, itemsize=4, cluster=cl, objective="fast")
    with pytest.raises(LayoutError, match=r"itemsize must be a positive byte count; got 0"):
        plan_conversion("R R", "R R", global_shape=SHAPE, itemsize=0, cluster=cl)
    with pytest.raises(LayoutError, match=r"source layout \(R\): has 1 placements but the mesh"):
        plan_conversion("R", "R R", global_shape=SHAPE, itemsize=4, cluster=cl)


_COLLECTIVE_OPS = {"_allgather_base_", "_reduce_scatter_base_", "allreduce_", "alltoall_base_"}
_COPYING_OPS = {"cat", "clone", "stack", "copy_", "zeros_like"}


class _Seen(TorchDispatchMode):
    """The local ops dispatched inside it, each by the bytes it copies (0: an allocation or a view)."""

    def __init__(self):
        super().__init__()
        self.ops: list[float] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name not in _COLLECTIVE_OPS:
            self.ops.append(out.numel() * out.element_size() if name in _COPYING_OPS else 0)
        return out


@pytest.mark.parametrize("op,dim", [("all_reduce", None), ("reduce_scatter", 0), ("reduce_scatter", 1),
                                    ("all_gather", 0), ("all_gather", 1), ("split", 0), ("split", 1),
                                    ("all_to_all", 1)])
def test_runtime_ops_are_what_the_runtime_dispatches(op, dim):
    """NOTE [copies]: `runtime_ops` lists the local ops `treadle.runtime.collectives` dispatches around each step,
    forward and backward, with the bytes each copies, as a dispatch mode sees them on a fake group of 2."""
    import treadle.runtime.collectives as C
    from treadle.cost.convert import runtime_ops
    from treadle.profile.fake_group import fake_process_group

    run = {"all_reduce": lambda x, g: C.all_reduce(x, g), "reduce_scatter": lambda x, g: C.reduce_scatter(x, dim, g),
           "all_gather": lambda x, g: C.all_gather(x, dim, g), "split": lambda x, g: C.split(x, dim, g),
           "all_to_all": lambda x, g: C.all_to_all(x, 0, dim, g)}[op]
    x = torch.randn(4, 6, 2, requires_grad=True)
    with fake_process_group(2):
        with _Seen() as fwd:
            y = run(x, torch.distributed.group.WORLD)
        gy = torch.randn_like(y)
        with _Seen() as bwd:
            torch.autograd.grad(y, x, gy)
    want_f, want_b = runtime_ops(op, dim, x.numel() * x.element_size(), 2)
    assert (fwd.ops, bwd.ops) == (list(want_f), list(want_b))


@pytest.mark.parametrize("n_params", [0, 1, 2])
def test_grad_sum_ops_are_what_the_runtime_dispatches(n_params):
    """NOTE [copies]: `grad_sum_ops` lists the local ops of Megatron's "f" (`grad_all_reduce`, and
    `grad_all_reduce_many` over a norm's parameters), forward and backward, as a dispatch mode sees them."""
    import treadle.runtime.collectives as C
    from treadle.cost.convert import grad_sum_ops
    from treadle.profile.fake_group import fake_process_group

    xs = [torch.randn(6 + i, requires_grad=True) for i in range(max(n_params, 1))]
    with fake_process_group(2):
        g = torch.distributed.group.WORLD
        with _Seen() as fwd:
            ys = C.grad_all_reduce_many(xs, g) if n_params else [C.grad_all_reduce(xs[0], g)]
        gys = [torch.randn_like(y) for y in ys]
        with _Seen() as bwd:
            torch.autograd.grad(ys, xs, gys)
    want_f, want_b = grad_sum_ops(sum(x.numel() * 4 for x in xs), n_params)
    assert (fwd.ops, bwd.ops) == (list(want_f), list(want_b))
