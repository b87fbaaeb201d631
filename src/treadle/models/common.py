"""Pieces shared by the ready-made schedules: find the repeated blocks and the embedding/head by
structure, and the parts of a Megatron recipe that do not depend on the block's inside."""

from __future__ import annotations

import logging

from torch import nn

from ..errors import ScheduleError
from ..profile.blocks import block_container, is_block_stack  # noqa: F401  (found by structure, below the schedules)
from ..schedule.core import Schedule

logger = logging.getLogger(__name__)


def path_of(sch: Schedule, module: nn.Module | None) -> str | None:
    if module is None:
        return None
    for p, m in sch.model.named_modules():
        if m is module:
            return p
    return None


def blocks_path(sch: Schedule) -> str:
    """Path of the model's main stack of repeated blocks (`block_container`)."""
    best = block_container(sch.model)
    if best is None:
        raise ScheduleError("no nn.ModuleList (or nn.ModuleDict keyed 0, 1, ..., or nn.Sequential of one block class) of "
                            "repeated blocks found in the model")
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


# NOTE [a named recipe only for its own blocks]: a recipe by module names (the Megatron recipes, the kernel
# schedules) knows what each named module computes and nothing else. A block that also holds parameters in
# modules the recipe does not name (Qwen3's per-head q/k norms, whose weight every head shares and whose gradient
# must then be summed over the tensor axis; OLMo-2's q/k norm over the whole projection) would be built without
# what those modules need: silently wrong gradients, or a crash in forward. So a family is chosen only when its
# naming modules exist and every parameter-holding module of block 0 is one it knows; otherwise the data-flow
# paths decide (the constrained plan for Megatron).

# family: (the modules that identify it, the other parameter-holding modules it may hold)
FAMILY_MODULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gpt2": (("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"), ("ln_1", "ln_2")),
    "llama": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"), ("input_layernorm", "post_attention_layernorm")),
    "bert": (("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
              "intermediate.dense", "output.dense"), ("attention.output.LayerNorm", "output.LayerNorm")),
}


def named_family(block: nn.Module) -> str | None:
    """The family of `FAMILY_MODULES` whose modules `block` has and nothing else holding parameters (NOTE [a named
    recipe only for its own blocks]); GPT-2's only over a fused q|k|v of three equal pieces. None otherwise."""
    from ..forms.tensor.leaf_rules import matmul_dims

    holders = {p for p, m in block.named_modules() if p and any(True for _ in m.parameters(recurse=False))}
    for family, (names, others) in FAMILY_MODULES.items():
        if has_children(block, *names) and holders <= set(names) | set(others):
            if family == "gpt2":  # not GPT-2's names over another attention (multi-query q|k|v of unequal pieces)
                dims = matmul_dims(block.get_submodule("attn.c_attn"))
                if dims is None or dims[0] != 3 * dims[1]:
                    continue
            return family
    return None
