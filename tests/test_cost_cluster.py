"""Cluster specs: physical -> logical mesh with per-axis links, parsing, enumeration, JSON."""

import pytest

from treadle.cost.cluster import ClusterSpec, axis_crosses_nodes, enumerate_meshes, parse_cluster
from treadle.cost.links import LINK_PRESETS
from treadle.errors import LayoutError, MeshError
from treadle.mesh import Mesh


def test_from_physical_8x8_h100():
    c = ClusterSpec.from_physical(nodes=8, devices_per_node=8, intra="nvlink4", inter="ib-ndr", device="h100-sxm")
    assert c.mesh.shape == (8, 8) and c.mesh.names == ("dp", "tp")
    assert c.link("dp") is LINK_PRESETS["ib-ndr"] and c.link("tp") is LINK_PRESETS["nvlink4"]
    assert c.link(1) is LINK_PRESETS["nvlink4"] and c.world_size == 64
    with pytest.raises(MeshError, match=r"mesh axis 'pp' does not exist"):
        c.link("pp")
    with pytest.raises(LayoutError, match=r"mesh axis index 2 out of range"):
        c.link(2)


def test_parse_cluster_forms():
    assert parse_cluster("8x8:h100") == ClusterSpec.from_physical(8, 8)
    c = parse_cluster("2x8:a100:pcie4")
    assert c.device == "a100-80gb" and c.link("tp").name == "pcie4" and c.link("dp").name == "ib-hdr"
    one = parse_cluster("4:h200")
    assert one.mesh.shape == (1, 4) and one.device == "h200"
    assert parse_cluster("2x2:cpu").link("tp").name == "loopback"
    assert parse_cluster("2x4:mi300:pcie5:ib-ndr").device == "mi300"


@pytest.mark.parametrize("text, message", [
    ("8x8", r"cannot read '8x8'; write NODESxDEVICES:device"),
    ("8y8:h100", r"'8y8' in '8y8:h100' is not NODESxDEVICES"),
    ("2x2x2:h100", r"must be NODESxDEVICES \(two numbers\)"),
    ("8x8:tpu", r"unknown device 'tpu' in '8x8:tpu'; known: \['a100'"),
    ("8x8:h100:nvlink9", r"unknown link preset 'nvlink9'; known:"),
])
def test_parse_cluster_errors(text, message):
    with pytest.raises(LayoutError, match=message):
        parse_cluster(text)


def test_axis_crossing_and_enumeration():
    # 2 nodes x 4 devices; (4, 2): inner axis (stride 1, span 2) inside a node, outer (stride 2, span 8) across
    assert not axis_crosses_nodes((4, 2), 1, 4) and axis_crosses_nodes((4, 2), 0, 4)
    assert axis_crosses_nodes((2, 4), 0, 4) and not axis_crosses_nodes((2, 4), 1, 4)
    assert axis_crosses_nodes((8,), 0, 4)
    specs = enumerate_meshes(2, 4, intra="nvlink3", inter="ib-hdr", device="a100-80gb")
    got = {s.mesh.shape: tuple(link.name for link in s.links) for s in specs}
    assert got == {(8,): ("ib-hdr",), (2, 4): ("ib-hdr", "nvlink3"), (4, 2): ("ib-hdr", "nvlink3"),
                   (2, 2, 2): ("ib-hdr", "nvlink3", "nvlink3")}
    assert [s.mesh.names for s in specs if s.mesh.ndim == 3] == [("dp", "fsdp", "tp")]
    # (8, 8) world of 64 as 2-D: inner 16 crosses nodes, (16, 4) keeps 4 inside
    shapes = {s.mesh.shape: s for s in enumerate_meshes(8, 8, max_ndim=2)}
    assert shapes[(4, 16)].link(1).name == "ib-ndr" and shapes[(16, 4)].link(1).name == "nvlink4"
    assert len(shapes) == 1 + 5  # 64 and 2x32, 4x16, 8x8, 16x4, 32x2
    with pytest.raises(LayoutError, match=r"enumerate_meshes: counts must be >= 1; got nodes=0"):
        enumerate_meshes(0, 8)


def test_json_round_trip_and_errors():
    c = parse_cluster("8x8:h100")
    assert ClusterSpec.from_json(c.to_json()) == c
    with pytest.raises(LayoutError, match=r"ClusterSpec: 1 links for Mesh\(dp=2, tp=2\) with 2 axes"):
        ClusterSpec(Mesh((2, 2), ("dp", "tp")), (LINK_PRESETS["nvlink4"],))
    with pytest.raises(LayoutError, match=r"from_physical: nodes and devices_per_node must be >= 1; got 0 x 8"):
        ClusterSpec.from_physical(0, 8)
    u = ClusterSpec.uniform(Mesh((2, 2), ("a", "b")), "loopback")
    assert u.links == (LINK_PRESETS["loopback"],) * 2 and "a=2 over loopback" in str(u)


def test_device_may_be_a_hardware_spec():
    from treadle.profile.hardware import hardware_preset

    hw = hardware_preset("h100-sxm")
    c = parse_cluster("2x8:h100")
    assert c.hardware() == hw
    with_spec = ClusterSpec(c.mesh, c.links, hw)
    assert ClusterSpec.from_json(with_spec.to_json()) == with_spec and with_spec.hardware() is hw


def test_restrict_keeps_links_device_and_copy_rate():
    c = parse_cluster("8x8:h100")
    tp = c.restrict(["tp"])
    assert tp.mesh.shape == (8,) and tp.mesh.names == ("tp",) and tp.links == (LINK_PRESETS["nvlink4"],)
    assert tp.device == c.device and tp.copy_bytes_per_s == c.copy_bytes_per_s > 0
    swapped = c.restrict(("tp", "dp"))
    assert swapped.link(0).name == "nvlink4" and swapped.link(1).name == "ib-ndr"
    with pytest.raises(MeshError, match=r"mesh axis 'pp' does not exist"):
        c.restrict(["pp"])
    with pytest.raises(LayoutError, match=r"ClusterSpec.restrict: axes \('tp', 'tp'\) repeat an axis"):
        c.restrict(["tp", "tp"])
