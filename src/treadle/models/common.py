"""Pieces shared by the ready-made schedules: find the repeated blocks and the embedding/head by
structure, and the parts of a Megatron recipe that do not depend on the block's inside."""

from __future__ import annotations

import logging

from torch import nn

from ..errors import ScheduleError
from ..schedule.core import Schedule
from ..schedule.log import Ref
from torch.distributed.tensor.placement_types import Replicate, Shard

logger = logging.getLogger(__name__)


def path_of(sch: Schedule, module: nn.Module | None) -> str | None:
    if module is None:
        return None
    for p, m in sch.model.named_modules():
        if m is module:
            return p
    return None


def blocks_path(sch: Schedule) -> str:
    """Path of the model's main stack of repeated blocks: its longest nn.ModuleList."""
    best, best_len = None, 0
    for p, m in sch.model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > best_len:
            best, best_len = p, len(m)
    if best is None:
        raise ScheduleError("no nn.ModuleList of repeated blocks found in the model")
    return best


def has_children(mod: nn.Module, *paths: str) -> bool:
    for p in paths:
        try:
            mod.get_submodule(p)
        except AttributeError:
            return False
    return True


def check_heads(where: str, n_heads: int, tp_size: int, what: str = "attention heads") -> None:
    if n_heads % tp_size:
        raise ScheduleError(f"{where}: {n_heads} {what} do not divide over tensor-parallel size {tp_size}; "
                            f"use a tp size that divides {n_heads}")


def vocab_parallel(sch: Schedule, *, tp: str, causal: bool, sequence_parallel: bool,
                   parallel_loss: bool = True, split_embedding: bool = True) -> None:
    """Vocab-parallel input embedding (masked lookup + all-reduce, or reduce-scatter over the sequence)
    and vocab-parallel output head with vocab-parallel cross-entropy as the model's ``loss_function``.
    With ``parallel_loss=False`` (a model that computes its loss inline, not through ``loss_function``)
    the head's logits are gathered over the vocab instead, and the model's own loss runs on them.
    With `sequence_parallel` the head gathers the sequence first, and (if `split_embedding`) the
    embedding reduce-scatters over the sequence instead of all-reducing."""
    emb_path = path_of(sch, sch.model.get_input_embeddings())
    head_path = path_of(sch, sch.model.get_output_embeddings() if hasattr(sch.model, "get_output_embeddings") else None)
    if emb_path is None:
        raise ScheduleError("vocab_parallel: the model has no input embedding (get_input_embeddings)")
    emb = sch[emb_path]
    emb.shard("weight", dim=0, axis=tp)
    emb.sync("fwd_post", to=Shard(1) if sequence_parallel and split_embedding else Replicate(), axis=tp)
    if head_path is not None:
        head = sch[head_path]
        if head.mod.weight is not emb.mod.weight:
            head.shard("weight", dim=0, axis=tp)
        if getattr(head.mod, "bias", None) is not None:
            head.shard("bias", dim=0, axis=tp)
        if sequence_parallel:
            head.sync("fwd_pre", to=Replicate(), from_=Shard(1), axis=tp)
        if parallel_loss:
            sch.set_attr("loss_function", Ref("treadle.runtime.losses:VocabParallelLoss", axis=tp, causal=causal))
        else:
            head.sync("fwd_post", to=Replicate(), axis=tp)


def checkpoint_layers(sch: Schedule, blocks: str, fraction: float) -> list[int]:
    """Checkpoint `fraction` of the blocks, spread evenly over the stack. Returns their indices."""
    if not 0.0 <= fraction <= 1.0:
        raise ScheduleError(f"checkpoint fraction must be in [0, 1], got {fraction}")
    n = len(sch[blocks].mod)
    k = round(fraction * n)
    idx = sorted({int(i * n / k) for i in range(k)}) if k else []
    for i in idx:
        sch[f"{blocks}.{i}"].checkpoint()
    return idx


def finish(sch: Schedule, *, blocks: str, dp: str | None, zero3: bool, checkpoint_fraction: float) -> Schedule:
    checkpoint_layers(sch, blocks, checkpoint_fraction)
    if dp is not None:
        sch.data_parallel(axis=dp, shard=zero3)
    return sch
