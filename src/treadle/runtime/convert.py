"""Layout changes of activations on one mesh axis, as collectives with autograd (see `collectives`).

`convert(x, src, dst)` derives the collective that takes a local tensor from placement `src` to `dst` on
one axis; `convert_grad` applies a conversion to the gradient only (identity forward). Multi-axis changes
apply per axis: first every Shard -> Replicate (gathers, last axis first), then reductions of Partial,
then splits, so no step works on more data than it must.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..errors import BuildError
from . import collectives as C


def _same(a: Placement, b: Placement, ndim: int | None = None) -> bool:
    if isinstance(a, Shard) and isinstance(b, Shard):
        if ndim is None:
            return a.dim == b.dim
        return a.dim % ndim == b.dim % ndim
    return type(a) is type(b)


def convert(x: torch.Tensor, src: Placement, dst: Placement, group, *, where: str = "",
            gather_grad: str = "split") -> torch.Tensor:
    """Move local tensor `x` from `src` to `dst` over `group` (one mesh axis).
    Raises BuildError for a change no collective makes (to Partial)."""
    if _same(src, dst, x.dim()):
        return x
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        return C.all_reduce(x, group)
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return C.reduce_scatter(x, dst.dim, group)
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return C.all_gather(x, src.dim, group, grad=gather_grad)
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return C.split(x, dst.dim, group)
    if isinstance(src, Shard) and isinstance(dst, Shard):
        return C.all_to_all(x, dst.dim, src.dim, group)
    raise BuildError(f"{where}: no collective turns {src} into {dst}; a layout becomes Partial only "
                     f"through compute (a row-sharded matmul), not through communication")


def _order(pairs: list[tuple[str, Placement, Placement]]) -> list[tuple[str, Placement, Placement]]:
    def rank(p: tuple[str, Placement, Placement]) -> int:
        _, s, d = p
        if isinstance(s, Shard) and isinstance(d, Replicate):
            return 0
        if isinstance(s, Partial):
            return 1
        return 2

    gathers = [p for p in pairs if rank(p) == 0][::-1]
    return gathers + [p for p in pairs if rank(p) == 1] + [p for p in pairs if rank(p) == 2]


def convert_multi(x: torch.Tensor, src: dict[str, Placement], dst: dict[str, Placement],
                  group_of: Callable[[str], object], *, where: str = "") -> torch.Tensor:
    """Per-axis `convert` for every axis named in `dst` (axes missing from `src` are Replicate)."""
    pairs = [(ax, src.get(ax, Replicate()), d) for ax, d in dst.items()]
    for ax, s, d in _order(pairs):
        x = convert(x, s, d, group_of(ax), where=f"{where} axis {ax!r}")
    return x


def apply_op(x: torch.Tensor, op: str, kwargs: dict, group, where: str = "") -> torch.Tensor:
    """The explicit sync op on an activation, with its adjoint in backward. Raises BuildError when a dim the
    op names does not exist on `x` (before any collective runs)."""
    for k in ("dim", "split_dim", "concat_dim"):
        if k in kwargs and not -x.dim() <= kwargs[k] < x.dim():
            raise BuildError(f"{where + ': ' if where else ''}sync op {op}: {k}={kwargs[k]}, but the tensor has {x.dim()} dims "
                             f"(shape {tuple(x.shape)})")
    if op == "all_reduce":
        return C.all_reduce(x, group)
    if op == "all_gather":
        return C.all_gather(x, kwargs["dim"], group, grad=kwargs.get("grad", "split"))
    if op == "reduce_scatter":
        return C.reduce_scatter(x, kwargs["dim"], group)
    if op == "split":
        inner = kwargs.get("inner", 1)
        if inner == 1:
            return C.split(x, kwargs["dim"], group)
        d = kwargs["dim"] % x.dim()
        if x.shape[d] % inner:
            raise BuildError(f"sync split: dim {d} of size {x.shape[d]} is not a multiple of inner={inner}")
        return C.split(x.unflatten(d, (-1, inner)), d + 1, group).flatten(d, d + 1)
    if op == "all_to_all":
        return C.all_to_all(x, kwargs["split_dim"], kwargs["concat_dim"], group)
    raise BuildError(f"unknown sync op {op!r}")
