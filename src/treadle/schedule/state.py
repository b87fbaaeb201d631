"""What the primitives of one schedule record: the state shared by a root schedule and all its sub-schedules.

Written only by the schedule layer's primitives (`treadle.schedule.core`, `graph_primitives`); every other
layer reads it through `Schedule.view()` (`treadle.schedule.view.ScheduleView`), and `build` marks what it
changes through `Schedule.mark_built` and `Schedule.rebind_param`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..mesh import Mesh
from .data_parallel import DataParallel
from .log import Record


def chunk_dim(t: torch.Tensor, dim: int, n: int, index: int, blocks: int = 1) -> torch.Tensor:
    """Chunk `index` of `n` along `dim`, taken inside each of `blocks` parts and concatenated.
    Shape (.., S, ..) -> (.., S / n, ..). The caller checked that S divides by blocks * n."""
    if blocks == 1:
        return t.chunk(n, dim=dim)[index]
    parts = t.chunk(blocks, dim=dim)
    return torch.cat([p.chunk(n, dim=dim)[index] for p in parts], dim=dim)


@dataclass(frozen=True)
class ParamShard:
    """One mesh axis's split of one parameter: tensor dim `dim` over `axis`, in `blocks` interleaved parts.

    ``blocks=3`` says the dim is a concatenation of three equal parts (a fused q|k|v projection): each
    part is split over the axis, so rank r keeps (q_r, k_r, v_r).
    """

    dim: int
    axis: str
    blocks: int = 1


@dataclass(frozen=True)
class SyncSpec:
    """A layout change at a module boundary, recorded by `sync`."""

    path: str
    mode: str
    axis: str | None
    op: str | None = None
    kwargs: tuple = ()  # sorted (key, value) pairs for the op: dim, split_dim, concat_dim, grad
    to: tuple | None = None  # typed form: target placement per named axis ((axis, Placement), ...)
    from_: tuple | None = None  # typed form: source placement per named axis, when it cannot be derived
    arg: int | str = 0  # fwd_pre / bwd_post: which input (position or name)
    out: int = 0  # fwd_post: which output of a tuple / ModelOutput

    def kw(self) -> dict:
        return dict(self.kwargs)


@dataclass
class _State:
    """Everything the primitives of one schedule have recorded (shared by all its sub-schedules)."""

    model: nn.Module
    mesh: Mesh
    records: list[Record] = field(default_factory=list)
    param_shards: dict[int, list[ParamShard]] = field(default_factory=dict)  # id(param) -> splits, in order
    syncs: list[SyncSpec] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    fork_rngs: list[tuple[str, str]] = field(default_factory=list)  # (path, axis)
    reduce_grads: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)  # (path, axis, names)
    annotations: dict[int, dict[str, Any]] = field(default_factory=dict)  # id(param) -> tags
    attrs: list[tuple[str, str, Any]] = field(default_factory=list)  # (path, name, value)
    shard_attrs: list[tuple[str, str, str]] = field(default_factory=list)  # (path, name, axis)
    data_parallel: DataParallel | None = None  # axes, FSDP2 shard axes (treadle.schedule.data_parallel)
    built: bool = False
    original: nn.Module | None = None  # a copy of the model taken before its first `replace` (verify's reference)
    extras: dict[str, Any] = field(default_factory=dict)  # state of graph-level primitives and pipelines

    def snapshot(self) -> None:
        if self.original is None and not any(p.is_meta for p in self.model.parameters()):
            self.original = copy.deepcopy(self.model)
