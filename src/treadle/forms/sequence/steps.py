"""Sequence parallelism as recipe steps: where the sequence is split, gathered and its gradients reduced.
Activations are (B, T, E): the sequence is dim 1 (`SEQUENCE`)."""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Replicate, Shard

from ...schedule.core import Schedule

SEQUENCE = Shard(1)


def split_input(mod: Schedule, axis: str) -> Schedule:
    """Slice the sequence where `mod` reads its first input (where the residual stream enters the blocks)."""
    return mod.sync("fwd_pre", to=SEQUENCE, axis=axis)


def split_output(mod: Schedule, axis: str) -> Schedule:
    """Slice `mod`'s replicated output over the sequence (free forward; the gradient is gathered)."""
    return mod.sync("fwd_post", to=SEQUENCE, from_=Replicate(), axis=axis)


def gather_input(mod: Schedule, axis: str, *, reduce_scatter_grad: bool = False) -> Schedule:
    """Gather the sequence before `mod` reads it (a column-parallel region). With `reduce_scatter_grad` the
    gather's backward reduce-scatters the summed partial gradients of its column-parallel readers straight to
    the sequence shard, as Megatron-LM does (NOTE [gather with a reduce-scatter backward]), instead of an
    all-reduce then a split: half the traffic."""
    mod.sync("fwd_pre", to=Replicate(), from_=SEQUENCE, axis=axis)
    if reduce_scatter_grad:
        mod.sync("bwd_post", to=SEQUENCE, axis=axis)
    return mod


def gather_output(mod: Schedule, axis: str) -> Schedule:
    """Gather `mod`'s sequence-sharded output back to the whole sequence."""
    return mod.sync("fwd_post", to=Replicate(), from_=SEQUENCE, axis=axis)


def sharded_norms(norms: list[Schedule], axis: str) -> None:
    """Modules that run on the sequence shard with replicated parameters (norms) sum their gradients over
    `axis`."""
    for m in norms:
        m.reduce_grads(axis=axis)
