"""Collective cost formulas against values worked out by hand (alpha-beta, seconds)."""

import pytest

from treadle.cost import collective_cost as cc
from treadle.cost.cluster import ClusterSpec
from treadle.cost.links import LinkSpec
from treadle.errors import LayoutError
from treadle.mesh import Mesh

# effective bandwidth 5e8 B/s, 1 us per step, 2 us per call
LINK = LinkSpec(name="t", latency_s=1e-6, bandwidth_bytes_per_s=1e9, efficiency=0.5, launch_s=2e-6)
MB8 = 8e6


def test_ring_and_tree_all_reduce_by_hand():
    # ring: 2 + 6 steps x (1 us + 2e6 B / 5e8 B/s)
    assert cc.ring_all_reduce_time_s(MB8, 4, LINK) == pytest.approx(2e-6 + 6 * (1e-6 + 4e-3))
    # tree: 2 + 2*log2(4)=4 steps x (1 us + 8e6 / 5e8)
    assert cc.tree_all_reduce_time_s(MB8, 4, LINK) == pytest.approx(2e-6 + 4 * (1e-6 + 16e-3))
    assert cc.all_reduce_time_s(MB8, 4, LINK) == pytest.approx(0.024008)  # ring is cheaper for big buffers


def test_all_reduce_takes_tree_for_small_buffers():
    ring = 2e-6 + 30 * (1e-6 + 62.5 / 5e8)
    tree = 2e-6 + 8 * (1e-6 + 1000 / 5e8)
    assert cc.ring_all_reduce_time_s(1000, 16, LINK) == pytest.approx(ring)
    assert cc.all_reduce_time_s(1000, 16, LINK) == pytest.approx(tree)
    assert tree < ring


def test_gather_scatter_all_to_all_broadcast_send_by_hand():
    three_steps = 2e-6 + 3 * (1e-6 + 2e6 / 5e8)
    assert cc.all_gather_time_s(MB8, 4, LINK) == pytest.approx(three_steps)
    assert cc.reduce_scatter_time_s(MB8, 4, LINK) == pytest.approx(three_steps)
    assert cc.all_to_all_time_s(MB8, 4, LINK) == pytest.approx(three_steps)
    # scatter (2 latencies + 3/4 of the buffer) + ring all-gather beats 2 tree steps of the whole buffer
    assert cc.broadcast_time_s(MB8, 4, LINK) == pytest.approx(2e-6 + 2e-6 + 0.012 + 3 * (1e-6 + 4e-3))
    assert cc.send_recv_time_s(MB8, LINK) == pytest.approx(2e-6 + 1e-6 + 16e-3)


def test_one_rank_costs_nothing_and_bad_sizes_raise():
    for f in (cc.all_reduce_time_s, cc.all_gather_time_s, cc.reduce_scatter_time_s, cc.all_to_all_time_s,
              cc.broadcast_time_s):
        assert f(MB8, 1, LINK) == 0.0
    with pytest.raises(LayoutError, match=r"all_gather_time_s: needs nbytes >= 0 and n_ranks >= 1; got nbytes=-1"):
        cc.all_gather_time_s(-1, 4, LINK)


SLOW = LinkSpec(name="slow", latency_s=10e-6, bandwidth_bytes_per_s=1e9, launch_s=5e-6)
FAST = LinkSpec(name="fast", latency_s=1e-6, bandwidth_bytes_per_s=1e10, launch_s=5e-6)


def test_multi_axis_gather_hierarchical_beats_flat_on_mixed_links():
    cl = ClusterSpec(Mesh((2, 4), ("dp", "tp")), (SLOW, FAST))
    flat = 5e-6 + 7 * (10e-6 + 1e6 / 1e9)  # 8 ranks, slowest latency and bandwidth
    hier = (5e-6 + 3 * (1e-6 + 1e6 / 1e10)) + (5e-6 + (10e-6 + 4e6 / 1e9))  # tp first (4 MB out), then dp
    assert cc.all_gather_axes_time_s(MB8, cluster=cl, axes=("dp", "tp"), algorithm="flat") == pytest.approx(flat)
    assert cc.all_gather_axes_time_s(MB8, cluster=cl, axes=("dp", "tp"),
                                     algorithm="hierarchical") == pytest.approx(hier)
    assert cc.all_gather_axes_time_s(MB8, cluster=cl, axes=("dp", "tp")) == pytest.approx(hier)
    # reduce-scatter is the adjoint: dp first on the whole buffer, then tp
    assert cc.reduce_scatter_axes_time_s(MB8, cluster=cl, axes=("dp", "tp")) == pytest.approx(hier)


def test_multi_axis_flat_wins_when_launch_dominates():
    link = LinkSpec(name="u", latency_s=1e-6, bandwidth_bytes_per_s=1e9, launch_s=10e-6)
    cl = ClusterSpec.uniform(Mesh((2, 2), ("a", "b")), link)
    flat = 10e-6 + 3 * (1e-6 + 200 / 1e9)
    hier = (10e-6 + 1e-6 + 200 / 1e9) + (10e-6 + 1e-6 + 400 / 1e9)
    assert cc.all_gather_axes_time_s(800, cluster=cl, axes=("a", "b")) == pytest.approx(flat)
    assert cc.all_gather_axes_time_s(800, cluster=cl, axes=("a", "b"), algorithm="hierarchical") == pytest.approx(hier)


def test_multi_axis_all_reduce_two_level():
    cl = ClusterSpec(Mesh((2, 4), ("dp", "tp")), (SLOW, FAST))
    # reduce-scatter over tp, ring all-reduce of a quarter over dp, all-gather over tp
    rs = 5e-6 + 3 * (1e-6 + 2e6 / 1e10)
    ar = 5e-6 + 2 * (10e-6 + 1e6 / 1e9)
    two_level = rs + ar + rs
    assert cc.all_reduce_axes_time_s(MB8, cluster=cl, axes=("dp", "tp")) == pytest.approx(two_level)
    assert cc.all_reduce_axes_time_s(MB8, cluster=cl, axes=("dp", "tp"), algorithm="flat") == pytest.approx(
        5e-6 + 14 * (10e-6 + 1e6 / 1e9))
    assert cc.broadcast_axes_time_s(MB8, cluster=cl, axes=("tp",)) == pytest.approx(cc.broadcast_time_s(MB8, 4, FAST))
    assert cc.all_to_all_axes_time_s(MB8, cluster=cl, axes=("dp", "tp")) == pytest.approx(5e-6 + 7 * (10e-6 + 1e-3))


def test_multi_axis_errors_name_the_axes():
    cl = ClusterSpec(Mesh((2, 4), ("dp", "tp")), (SLOW, FAST))
    with pytest.raises(LayoutError, match=r"axes \('tp', 'tp'\): an axis appears twice"):
        cc.all_gather_axes_time_s(MB8, cluster=cl, axes=("tp", "tp"))
    with pytest.raises(Exception, match=r"mesh axis 'pp' does not exist; this mesh has axes \['dp', 'tp'\]"):
        cc.all_gather_axes_time_s(MB8, cluster=cl, axes=("pp",))
    with pytest.raises(LayoutError, match=r"algorithm must be 'best', 'flat' or 'hierarchical'; got 'ring'"):
        cc.all_gather_axes_time_s(MB8, cluster=cl, axes=("dp", "tp"), algorithm="ring")


def test_op_scale_multiplies_the_named_collective_only():
    scaled = LinkSpec(name="g", latency_s=1e-6, bandwidth_bytes_per_s=1e9, efficiency=0.5, launch_s=2e-6,
                      op_scale=(("reduce_scatter", 1.5), ("all_reduce", 0.5)))
    assert cc.reduce_scatter_time_s(MB8, 4, scaled) == pytest.approx(1.5 * cc.reduce_scatter_time_s(MB8, 4, LINK))
    assert cc.all_reduce_time_s(MB8, 4, scaled) == pytest.approx(0.5 * cc.all_reduce_time_s(MB8, 4, LINK))
    assert cc.all_gather_time_s(MB8, 4, scaled) == cc.all_gather_time_s(MB8, 4, LINK)
    assert LinkSpec.from_dict(scaled.to_dict()) == scaled
    # a flattened group takes the worst factor of its axes
    assert cc.flat_link([scaled, LINK]).scale("reduce_scatter") == 1.5
    with pytest.raises(LayoutError, match=r"op_scale factors must be > 0; got \(\('all_to_all', 0.0\),\)"):
        LinkSpec(latency_s=0, bandwidth_bytes_per_s=1, op_scale=(("all_to_all", 0),))
