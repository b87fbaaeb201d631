"""Layouts: construction, parsing, shard order, local shapes and the errors on bad layouts."""

import pytest
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from treadle.cost.layout import Layout, enumerate_layouts, local_shape, shard_slices
from treadle.errors import LayoutError
from treadle.mesh import Mesh

MESH = Mesh((2, 4), ("dp", "tp"))


def test_layout_from_placements_and_strings_agree():
    a = Layout([Shard(0), Replicate()])
    assert a == Layout.parse("S0, R") == Layout("S(0) R")
    assert hash(a) == hash(Layout.parse("S0 R"))
    assert a.placements == (Shard(0), Replicate())
    assert str(a) == "(S(0), R)" and repr(a) == "Layout([Shard(dim=0), Replicate()])"
    p = Layout([Partial(), Shard(2)])
    assert p.partial_axes == (0,) and p.axes_of(2) == (1,) and p.axes_of(0) == ()
    assert Layout.from_json(p.to_json()) == p


def test_shard_order_default_and_explicit():
    default = Layout.parse("S0 S0")
    swapped = Layout([Shard(0), Shard(0)], shard_order={0: (1, 0)})
    assert default.axes_of(0) == (0, 1) and swapped.axes_of(0) == (1, 0)
    assert default != swapped and default.has_default_order and not swapped.has_default_order
    assert Layout.parse("S0 S0 @0:1>0") == swapped
    assert str(swapped) == "(S(0), S(0))@0:1>0"
    assert Layout.from_json(swapped.to_json()) == swapped
    # axis 1 outer: rank 1 = (dp 0, tp 1) holds block 1*2+0 = 2 of 8 rows; with default order block 0*4+1 = 1
    assert shard_slices((16, 3), swapped, MESH, 1)[0] == slice(4, 6)
    assert shard_slices((16, 3), default, MESH, 1)[0] == slice(2, 4)
    assert shard_slices((16, 3), default, MESH, 4)[0] == slice(8, 10)


def test_local_shape_divides_sharded_dims():
    assert local_shape((8, 12, 5), Layout.parse("S1 S0"), MESH) == (2, 6, 5)
    assert local_shape((8, 12, 5), Layout.parse("P S1"), MESH) == (8, 3, 5)
    assert local_shape((8, 16, 5), Layout.parse("S1 S1"), MESH) == (8, 2, 5)
    assert local_shape((8, 16, 5), Layout.parse("R R"), MESH) == (8, 16, 5)


def test_uneven_shard_is_an_error_naming_dim_size_and_axes():
    with pytest.raises(LayoutError, match=r"tensor dim 1 has size 12 \(shape \(8, 12, 5\)\), not divisible by 8 "
                                          r"\(mesh axes dp=2 x tp=4\); uneven shards are not supported"):
        local_shape((8, 12, 5), Layout.parse("S1 S1"), MESH)
    with pytest.raises(LayoutError, match=r"Shard\(3\) on mesh axis 'tp', but the tensor has 3 dims"):
        local_shape((8, 12, 5), Layout.parse("R S3"), MESH)
    with pytest.raises(LayoutError, match=r"has 1 placements but the mesh .* has 2 axes"):
        local_shape((8, 12, 5), Layout.parse("R"), MESH)


def test_bad_layouts_raise():
    with pytest.raises(LayoutError, match=r"only Partial\('sum'\) is supported"):
        Layout([Partial("max"), Replicate()])
    with pytest.raises(LayoutError, match=r"expected Shard\(dim\), Replicate\(\) or Partial\(\); got _StridedShard"):
        Layout([_StridedShard(0, split_factor=2), Replicate()])
    with pytest.raises(LayoutError, match=r"Shard dim must be >= 0"):
        Layout([Shard(-1)])
    with pytest.raises(LayoutError, match=r"cannot parse 'X1'; use R, P or S<dim>"):
        Layout.parse("X1 R")
    with pytest.raises(LayoutError, match=r"shard_order for dim 0 names mesh axes \(0,\), but the axes holding "
                                          r"Shard\(0\) are \(0, 1\)"):
        Layout([Shard(0), Shard(0)], shard_order={0: (0,)})
    with pytest.raises(LayoutError, match=r"cannot read shard order '0-1'"):
        Layout.parse("S0 S0 @0-1")
    with pytest.raises(LayoutError, match=r"expected Shard\(dim\), Replicate\(\) or Partial\(\); got 3"):
        Layout([3])


def test_enumerate_layouts_counts():
    assert len(list(enumerate_layouts(2, 3))) == 25
    assert len(list(enumerate_layouts(2, 3, partial=False))) == 16
    with_orders = list(enumerate_layouts(2, 3, shard_orders=True))
    assert len(with_orders) == 28 and len(set(with_orders)) == 28
    # per dim: 9 layouts shard it on two axes (1 more order each), 1 on three axes (5 more orders)
    assert len(list(enumerate_layouts(3, 2, shard_orders=True))) == 4 ** 3 + 2 * (9 * 1 + 1 * 5)
