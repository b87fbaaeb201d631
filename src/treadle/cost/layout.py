"""Layout of a tensor on an N-d mesh: one placement per mesh axis, plus the order of axes sharding one dim.

Placements are PyTorch's (`torch.distributed.tensor.placement_types`): `Shard(dim)`, `Replicate()` and
`Partial()` (a pending sum; only the "sum" reduction). Shapes are *global* unless a name says local.

NOTE [shard order]: when several mesh axes shard the same tensor dim, the dim is cut by the first axis of
its order into n_a blocks, each block by the next axis, and so on (outer to inner). A rank's block index on
the dim is the mixed-radix number of its coordinates in that order. The default order is ascending mesh
axis (what DTensor does); `shard_order` gives another, e.g. ``{0: (1, 0)}``: axis 1 outer, axis 0 inner.
Only the innermost axis of a dim can gather or all-to-all on its own (its blocks are contiguous).

Uneven sizes are an error, never padded: a dim of size 10 sharded over 4 ranks raises LayoutError naming
the dim, its size, the axes and the sizes that would work.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

from torch.distributed.tensor.placement_types import Placement

from ..errors import LayoutError
from ..mesh import Mesh
from ..placement import P, R, code_of, placement_of, placement_str

# Internal code of one axis' placement (treadle.placement): R, P or a tensor dim >= 0 (Shard(dim)).


@dataclass(frozen=True, slots=True, init=False)
class Layout:
    """Placements of one tensor on a mesh, one per mesh axis, e.g. ``Layout([Shard(0), Replicate()])``.

    `shard_order` (see NOTE [shard order]) maps a tensor dim to its sharding mesh axes (indices), outer to
    inner; omitted dims take ascending axis order. Equal layouts compare and hash equal.
    Raises LayoutError on an unknown placement, a non-sum Partial, or an order that names other axes than
    those holding Shard(dim).
    """

    codes: tuple[int, ...]  # per mesh axis: R, P or the sharded tensor dim
    order: tuple[tuple[int, tuple[int, ...]], ...]  # (dim, axes outer->inner) for every sharded dim, by dim

    def __init__(self, placements: Sequence[Placement | str] | str,
                 shard_order: Mapping[int, Sequence[int]] | None = None):
        if isinstance(placements, str):
            placements = [t for t in placements.replace(",", " ").split() if t]
        codes = tuple(code_of(p, i) for i, p in enumerate(placements))
        if not codes:
            raise LayoutError("Layout needs one placement per mesh axis; got none")
        object.__setattr__(self, "codes", codes)
        object.__setattr__(self, "order", _canonical_order(codes, shard_order or {}))

    @classmethod
    def _from_codes(cls, codes: tuple[int, ...], order: tuple[tuple[int, tuple[int, ...]], ...]) -> "Layout":
        obj = object.__new__(cls)
        object.__setattr__(obj, "codes", codes)
        object.__setattr__(obj, "order", order)
        return obj

    @classmethod
    def from_codes(cls, codes: Sequence[int]) -> "Layout":
        """From placement codes (`treadle.placement`: R, P or a dim per mesh axis), default shard order."""
        codes = tuple(codes)
        return cls._from_codes(codes, _canonical_order(codes, {}))

    @classmethod
    def replicate(cls, mesh_ndim: int) -> "Layout":
        """All-replicated layout on a mesh of `mesh_ndim` axes."""
        return cls._from_codes((R,) * mesh_ndim, ())

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """From a short string: placements separated by commas or spaces (``"S0, R"``, ``"P S(2)"``), optionally
        followed by ``@dim:axis>axis`` orders, e.g. ``"S0 S0 @0:1>0"`` (axis 1 outer on dim 0)."""
        head, *orders = text.split("@")
        order: dict[int, tuple[int, ...]] = {}
        for o in orders:
            try:
                dim_s, axes_s = o.split(":")
                order[int(dim_s)] = tuple(int(a) for a in axes_s.split(">"))
            except ValueError:
                raise LayoutError(f"Layout.parse: cannot read shard order {o!r} in {text!r}; "
                                  f"write it as '@dim:outer>inner', e.g. '@0:1>0'") from None
        return cls(head, order)

    # ------------------------------------------------------------------------------------------ views
    @property
    def placements(self) -> tuple[Placement, ...]:
        return tuple(placement_of(c) for c in self.codes)

    @property
    def mesh_ndim(self) -> int:
        return len(self.codes)

    @property
    def shard_order(self) -> dict[int, tuple[int, ...]]:
        return dict(self.order)

    def axes_of(self, dim: int) -> tuple[int, ...]:
        """Mesh axes sharding tensor `dim`, outer to inner (empty when the dim is whole on every rank)."""
        for d, axes in self.order:
            if d == dim:
                return axes
        return ()

    @property
    def partial_axes(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.codes) if c == P)

    @property
    def sharded_dims(self) -> tuple[int, ...]:
        return tuple(d for d, _ in self.order)

    @property
    def is_replicated(self) -> bool:
        return all(c == R for c in self.codes)

    @property
    def has_default_order(self) -> bool:
        return all(list(axes) == sorted(axes) for _, axes in self.order)

    def __repr__(self) -> str:
        body = "[" + ", ".join(repr(p) for p in self.placements) + "]"
        if not self.has_default_order:
            body += f", shard_order={self.shard_order}"
        return f"Layout({body})"

    def __str__(self) -> str:
        s = "(" + ", ".join(placement_str(c) for c in self.codes) + ")"
        for d, axes in self.order:
            if list(axes) != sorted(axes):
                s += f"@{d}:" + ">".join(map(str, axes))
        return s

    def to_json(self) -> dict:
        """Plain data: ``{"placements": ["S0", "R"], "shard_order": {"0": [1, 0]}}``."""
        return {"placements": [placement_str(c, token=True) for c in self.codes],
                "shard_order": {str(d): list(a) for d, a in self.order if list(a) != sorted(a)}}

    @classmethod
    def from_json(cls, data: Mapping) -> "Layout":
        return cls(list(data["placements"]), {int(d): tuple(a) for d, a in data.get("shard_order", {}).items()})

    # ------------------------------------------------------------------------------------- checking
    def check(self, mesh: Mesh | Sequence[int], global_shape: Sequence[int], *, what: str = "layout") -> None:
        """Raise LayoutError unless this layout fits `mesh` and divides `global_shape` evenly.

        The error names the tensor dim, its size, the mesh axes sharding it and sizes that would divide."""
        mesh_shape, names = _mesh_shape_names(mesh)
        if len(self.codes) != len(mesh_shape):
            raise LayoutError(f"{what} {self}: has {len(self.codes)} placements but the mesh {mesh} has "
                              f"{len(mesh_shape)} axes; give one placement per mesh axis")
        ndim = len(global_shape)
        for d, axes in self.order:
            if d >= ndim:
                raise LayoutError(f"{what} {self}: Shard({d}) on mesh axis {names[axes[0]]!r}, but the tensor has "
                                  f"{ndim} dims (shape {tuple(global_shape)}); use a dim below {ndim}")
            factor = math.prod(mesh_shape[a] for a in axes)
            if global_shape[d] % factor:
                axes_txt = " x ".join(f"{names[a]}={mesh_shape[a]}" for a in axes)
                raise LayoutError(f"{what} {self}: tensor dim {d} has size {global_shape[d]} (shape "
                                  f"{tuple(global_shape)}), not divisible by {factor} (mesh axes {axes_txt}); "
                                  f"uneven shards are not supported (no padding): use a size divisible by {factor}")


def _canonical_order(codes: tuple[int, ...], given: Mapping[int, Sequence[int]]
                     ) -> tuple[tuple[int, tuple[int, ...]], ...]:
    by_dim: dict[int, list[int]] = {}
    for axis, c in enumerate(codes):
        if c >= 0:
            by_dim.setdefault(c, []).append(axis)
    for d, axes in given.items():
        if d not in by_dim or sorted(axes) != by_dim[d]:
            raise LayoutError(f"Layout {tuple(placement_str(c) for c in codes)}: shard_order for dim {d} names mesh "
                              f"axes {tuple(axes)}, but the axes holding Shard({d}) are {tuple(by_dim.get(d, []))}")
    return tuple((d, tuple(given[d]) if d in given else tuple(axes)) for d, axes in sorted(by_dim.items()))


def _mesh_shape_names(mesh: Mesh | Sequence[int]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if isinstance(mesh, Mesh):
        return mesh.shape, mesh.names
    shape = tuple(int(s) for s in mesh)
    return shape, tuple(f"axis{i}" for i in range(len(shape)))


# ------------------------------------------------------------------------------------------ shapes
def local_shape(global_shape: Sequence[int], layout: Layout, mesh: Mesh | Sequence[int]) -> tuple[int, ...]:
    """Shape of each rank's local tensor: `global_shape` with every sharded dim divided by the product of its
    axes' sizes (Partial and Replicate keep the global size). Raises LayoutError on uneven sizes."""
    layout.check(mesh, global_shape)
    mesh_shape, _ = _mesh_shape_names(mesh)
    out = list(global_shape)
    for d, axes in layout.order:
        out[d] //= math.prod(mesh_shape[a] for a in axes)
    return tuple(out)


def shard_slices(global_shape: Sequence[int], layout: Layout, mesh: Mesh, rank: int) -> tuple[slice, ...]:
    """The region of the global tensor that `rank` holds (a Partial rank holds a summand of that region)."""
    local = local_shape(global_shape, layout, mesh)
    coord = list(mesh.coordinate(rank).values())
    out = [slice(0, s) for s in global_shape]
    for d, axes in layout.order:
        block = 0
        for a in axes:
            block = block * mesh.shape[a] + coord[a]
        out[d] = slice(block * local[d], (block + 1) * local[d])
    return tuple(out)


def enumerate_layouts(mesh_ndim: int, tensor_ndim: int, *, partial: bool = True,
                      shard_orders: bool = False) -> Iterator[Layout]:
    """Every layout of a `tensor_ndim`-d tensor on a `mesh_ndim`-axis mesh: per axis R, S(0..ndim-1) and P
    (when `partial`); with `shard_orders`, every order of axes sharding one dim too (default order first)."""
    choices = [R, *range(tensor_ndim)] + ([P] if partial else [])
    for codes in itertools.product(choices, repeat=mesh_ndim):
        base = Layout._from_codes(codes, _canonical_order(codes, {}))
        yield base
        if shard_orders:
            multi = [(d, axes) for d, axes in base.order if len(axes) > 1]
            perms = [[(d, p) for p in itertools.permutations(axes)] for d, axes in multi]
            for combo in itertools.product(*perms):
                order = dict(base.order) | dict(combo)
                if any(order[d] != axes for d, axes in base.order):
                    yield Layout._from_codes(codes, tuple(sorted(order.items())))

