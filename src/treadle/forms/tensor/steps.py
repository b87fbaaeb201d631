"""Tensor parallelism as recipe steps: how a person (or a ready-made schedule) states it on a module path."""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Placement, Replicate

from ...errors import ScheduleError
from ...schedule.core import Schedule
from .leaf_rules import matmul_dims


def _dims(lin: Schedule, what: str) -> tuple[int, int, int, int]:
    dims = matmul_dims(lin.mod)
    if dims is None:
        raise ScheduleError(f"{what} at {lin.path!r}: {type(lin.mod).__name__} is not a Linear or Conv1D leaf")
    return dims


def column(lin: Schedule, axis: str, *, blocks: int = 1) -> Schedule:
    """Column-parallel: split a Linear / Conv1D leaf's weight (and bias) over its output features on `axis`, in
    `blocks` interleaved parts (3: a fused q|k|v). Its output is Shard(-1); its input's gradient a pending sum,
    reduced by build. Raises ScheduleError for another module type."""
    out_dim = _dims(lin, "column")[2]
    kw = {"blocks": blocks} if blocks > 1 else {}
    lin.shard("weight", dim=out_dim, axis=axis, **kw)
    if getattr(lin.mod, "bias", None) is not None:
        lin.shard("bias", dim=0, axis=axis, **kw)
    return lin


def row(lin: Schedule, axis: str, *, to: Placement = Replicate()) -> Schedule:
    """Row-parallel: split a Linear / Conv1D leaf's weight over its input features on `axis`; its pending-sum
    output is reduced to `to` at the leaf's exit (Replicate: an all-reduce; Shard(1): a reduce-scatter over the
    sequence, sequence parallelism's). Raises ScheduleError for another module type."""
    lin.shard("weight", dim=_dims(lin, "row")[3], axis=axis)
    lin.sync("fwd_post", to=to, axis=axis)
    return lin


def check_heads(where: str, n_heads: int, tp_size: int, what: str = "attention heads") -> None:
    """Head-parallel attention needs the heads to divide over the axis. Raises ScheduleError naming both."""
    if n_heads % tp_size:
        raise ScheduleError(f"{where}: {n_heads} {what} do not divide over tensor-parallel size {tp_size}; "
                            f"use a tp size that divides {n_heads}")
