"""Collectives over one process group with the right backward, on `torch.distributed` (gloo, NCCL).

Shapes are local. Each forward has a named adjoint (NOTE [grad layouts]):

=================  ==========================  ====================================
forward            meaning                     backward (gradient arrives complete)
=================  ==========================  ====================================
all_reduce         Partial -> Replicate        identity
grad_all_reduce    Replicate -> Replicate      all_reduce   (Megatron's "f")
all_gather(d)      Shard(d) -> Replicate       split(d), or reduce_scatter(d) when the
                                               consumer makes the gradient Partial
reduce_scatter(d)  Partial -> Shard(d)         all_gather(d)
split(d)           Replicate -> Shard(d)       all_gather(d)
all_to_all(s, c)   Shard(c) -> Shard(s)        all_to_all(c, s)
exchange_rows      rows to their ranks         exchange_rows with the counts swapped
=================  ==========================  ====================================

NOTE [grad layouts]: treadle keeps every gradient *complete* on each rank (never a pending sum): a
replicated tensor consumed by a sharded op gets its partial gradient summed right there by
`grad_all_reduce`. So the adjoint of each collective assumes a complete gradient at its output; the
one fused exception is ``all_gather(grad="reduce_scatter")``, which equals ``grad_all_reduce`` followed
by ``all_gather`` at half the traffic.

Sizes are checked before any collective runs: an uneven split aborts gloo, so it raises LayoutError.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from ..errors import LayoutError

# torch >= 2.13 names the tensor-in/tensor-out collectives *_single; older releases *_into_tensor / *_tensor.
_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check_divisible(x: torch.Tensor, dim: int, n: int, what: str) -> int:
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise LayoutError(f"{what}: tensor dim {dim} has size {x.shape[dim]} (shape {tuple(x.shape)}), "
                          f"not divisible by the group size {n}")
    return dim


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    # NOTE [contiguous gathers]: the result is contiguous, as DTensor's Shard(d) -> Replicate is (gather on dim 0,
    # then one concatenation along d). A strided view of a (n*s, ...) buffer would make every consumer that
    # flattens it (each Linear reading it: q, k and v) copy it again and save its own copy for backward.
    xt = x.contiguous()
    out = torch.empty((n * xt.shape[0], *xt.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_base(out, xt, group=group)
    return out if dim == 0 else torch.cat(out.chunk(n, dim=0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return x
    dim = _check_divisible(x, dim, n, "reduce_scatter")
    # rank i's chunk of `dim` first, as one contiguous (n * rows, ...) input (NOTE [contiguous gathers])
    xt = x.contiguous() if dim == 0 else torch.cat(x.chunk(n, dim=dim), dim=0)
    out = torch.empty((xt.shape[0] // n, *xt.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_base(out, xt, group=group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return x
    dim = _check_divisible(x, dim, n, "split")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_to_all(x: torch.Tensor, split_dim: int, concat_dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return x
    split_dim = _check_divisible(x, split_dim, n, "all_to_all")
    concat_dim = concat_dim % x.dim()
    # chunk i of split_dim goes to rank i; received chunks are concatenated along concat_dim in rank order
    send = torch.stack(x.chunk(n, dim=split_dim), dim=0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=concat_dim)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GradOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.fn(g), None


def on_grad(x: torch.Tensor, fn) -> torch.Tensor:
    """Identity forward; backward applies `fn` (a collective, not differentiated again) to the gradient."""
    return _GradOnly.apply(x, fn) if x.requires_grad else x


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, grad_op):
        ctx.dim, ctx.group, ctx.grad_op = dim, group, grad_op
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.grad_op == "reduce_scatter":
            return _reduce_scatter(g, ctx.dim, ctx.group), None, None, None
        return _split(g, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.group), None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, concat_dim, group):
        ctx.dims, ctx.group = (split_dim % x.dim(), concat_dim % x.dim()), group
        return _all_to_all(x, split_dim, concat_dim, group)

    @staticmethod
    def backward(ctx, g):
        split_dim, concat_dim = ctx.dims
        return _all_to_all(g, concat_dim, split_dim, ctx.group), None, None, None


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.counts, ctx.group = (send, recv), group
        return _exchange_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, g):
        send, recv = ctx.counts
        return _exchange_rows(g.contiguous(), recv, send, ctx.group), None, None, None


def _exchange_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


# ---------------------------------------------------------------------------------------------- public
def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum a Partial tensor over `group` (Partial -> Replicate). Backward: identity."""
    return _AllReduce.apply(x, group)


def grad_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; backward sums the gradient over `group` (a replicated input to sharded compute)."""
    return on_grad(x, lambda g: _all_reduce(g, group))


class _GradAllReduceMany(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        out = list(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            if g is not None:
                by_dtype.setdefault(g.dtype, []).append(i)
        for idx in by_dtype.values():  # one flat all-reduce per dtype
            flat = _all_reduce(torch.cat([grads[i].reshape(-1) for i in idx]), ctx.group)
            for i, part in zip(idx, flat.split([grads[i].numel() for i in idx])):
                out[i] = part.view_as(grads[i])
        return (None, *out)


def grad_all_reduce_many(xs: list[torch.Tensor], group) -> list[torch.Tensor]:
    """`grad_all_reduce` of several tensors whose gradients one backward node produces together (a norm's weight
    and bias): identity forward; backward sums their gradients over `group` in one flat all-reduce per dtype,
    once all of them are computed. Tensors that need no gradient pass through."""
    need = [i for i, x in enumerate(xs) if x.requires_grad]
    out = list(xs)
    if need:
        for i, y in zip(need, _GradAllReduceMany.apply(group, *(xs[i] for i in need))):
            out[i] = y
    return out


def all_gather(x: torch.Tensor, dim: int, group, *,
               grad: Literal["split", "reduce_scatter"] = "split") -> torch.Tensor:
    """Concatenate the shards of `dim` over `group` in rank order (Shard(dim) -> Replicate).
    Local shape (.., s, ..) -> (.., n*s, ..). Backward: `split`, or `reduce_scatter` (see NOTE)."""
    if grad not in ("split", "reduce_scatter"):
        raise LayoutError(f"all_gather: grad must be 'split' or 'reduce_scatter', got {grad!r}")
    return _AllGather.apply(x, dim, group, grad)


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum a Partial tensor and keep this rank's chunk of `dim` (Partial -> Shard(dim)).
    Raises LayoutError when `dim` does not divide by the group size. Backward: all_gather."""
    return _ReduceScatter.apply(x, dim, group)


def split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Keep this rank's chunk of `dim` (Replicate -> Shard(dim)); no communication forward.
    Raises LayoutError when `dim` does not divide by the group size. Backward: all_gather."""
    return _Split.apply(x, dim, group)


def all_to_all(x: torch.Tensor, split_dim: int, concat_dim: int, group) -> torch.Tensor:
    """Re-shard from `concat_dim` to `split_dim` (Shard(concat_dim) -> Shard(split_dim)).
    Local shape: `split_dim` shrinks n-fold, `concat_dim` grows n-fold. Backward: the inverse all_to_all."""
    return _AllToAll.apply(x, split_dim, concat_dim, group)


def exchange_counts(send: list[int], group, device: torch.device | None = None) -> list[int]:
    """How many rows each rank of `group` sends this rank, given how many this rank sends each: `send` holds m
    counts per rank (m >= 1; rank r's are ``send[r*m:(r+1)*m]``, e.g. one per expert it holds), and the result
    the m counts of each source rank, in group order: one all-to-all of the counts (no gradient)."""
    n = dist.get_world_size(group)
    if not send or len(send) % n:
        raise LayoutError(f"exchange_counts: {len(send)} counts over a group of {n} ranks (m counts per rank)")
    t = torch.tensor(send, dtype=torch.int64, device=device)
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t, group=group)
    return [int(v) for v in out.tolist()]


def exchange_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Uneven all-to-all of rows (dim 0): the first ``send[0]`` rows of `x` go to rank 0 of `group`, the next
    ``send[1]`` to rank 1, ...; returns the ``sum(recv)`` rows received, in rank order (`recv` from
    `exchange_counts`). Backward: the same exchange with the counts swapped (each gradient row returns to the
    rank that sent the row). Raises LayoutError when `send` does not cover `x`'s rows."""
    n = dist.get_world_size(group)
    if len(send) != n or len(recv) != n or sum(send) != x.shape[0]:
        raise LayoutError(f"exchange_rows: {x.shape[0]} rows, send counts {send}, receive counts {recv} over a "
                          f"group of {n} ranks (one count per rank; the send counts must sum to the rows)")
    return _ExchangeRows.apply(x, list(send), list(recv), group)

