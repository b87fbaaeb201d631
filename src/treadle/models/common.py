"""Pieces shared by the ready-made schedules: find the repeated blocks and the embedding/head by
structure, and the parts of a Megatron recipe that do not depend on the block's inside."""

from __future__ import annotations

import logging

from torch import nn

from ..errors import ScheduleError
from ..schedule.core import Schedule

logger = logging.getLogger(__name__)


def path_of(sch: Schedule, module: nn.Module | None) -> str | None:
    if module is None:
        return None
    for p, m in sch.model.named_modules():
        if m is module:
            return p
    return None


def block_container(model: nn.Module) -> str | None:
    """Path of the model's main stack of repeated blocks: of its nn.ModuleLists and nn.ModuleDicts keyed "0",
    "1", ... in order (torchtitan's layers), the one holding the most parameters (then the longest: not a list of
    per-head norms inside a block), so that ``f"{path}.{i}"`` names block i either way; None if none."""
    best, best_key = None, (0, 0)
    for p, m in model.named_modules():
        if not is_block_stack(m):
            continue
        key = (sum(q.numel() for q in m.parameters()), len(m))  # the stack that holds most, not a per-head list
        if key > best_key:
            best, best_key = p, key
    return best


def is_block_stack(m: nn.Module) -> bool:
    """An nn.ModuleList, or an nn.ModuleDict keyed "0", "1", ... in order."""
    return isinstance(m, nn.ModuleList) or (
        isinstance(m, nn.ModuleDict) and list(m.keys()) == [str(i) for i in range(len(m))])


def blocks_path(sch: Schedule) -> str:
    """Path of the model's main stack of repeated blocks (`block_container`)."""
    best = block_container(sch.model)
    if best is None:
        raise ScheduleError("no nn.ModuleList (or nn.ModuleDict keyed 0, 1, ...) of repeated blocks found in the model")
    return best


def has_children(mod: nn.Module, *paths: str) -> bool:
    for p in paths:
        try:
            mod.get_submodule(p)
        except AttributeError:
            return False
    return True


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
