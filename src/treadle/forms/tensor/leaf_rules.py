"""How a tensor-parallel leaf computes on sharded weights: the Linear and Conv1D rules (column / row parallel, fused
blocks), registered in the one registry of sharding rules (`treadle.sharding_rules`).

=============================  ==============  ===========  ========================================
weight layout on axis a        output on a     input on a   notes
=============================  ==============  ===========  ========================================
Linear W(out,in) Shard(0)      Shard(-1)       Replicate    bias must be Shard(0) on a too; input
Conv1D W(in,out) Shard(1)                                   gradient summed over a (grad_all_reduce)
Linear Shard(1) / Conv1D (0)   Partial         Shard(-1)    bias added once, after the reduction
=============================  ==============  ===========  ========================================
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Shard

from ...errors import BuildError
from ...lazy import qualified_name
from ...schedule.state import ParamShard
from ...sharding_rules import LeafPlan, register_leaf_rule

# a layer type of transformers (GPT-2 and relatives), not a model class; named, not imported (an instance exists
# only once transformers is imported: NOTE [registrations on first use])
HF_CONV1D = "transformers.pytorch_utils.Conv1D"


def is_hf_conv1d(mod: nn.Module) -> bool:
    """True for transformers' Conv1D or a subclass of it (matched by qualified name: transformers not imported)."""
    return any(qualified_name(t) == HF_CONV1D for t in type(mod).__mro__)


def matmul_dims(mod: nn.Module) -> tuple[int, int, int, int] | None:
    """(out_features, in_features, weight dim of the outputs, weight dim of the inputs) of a leaf these rules run
    as a matrix product (Linear: W (out, in); transformers' Conv1D: W (in, out)); None for any other module."""
    if isinstance(mod, nn.Linear):
        return mod.out_features, mod.in_features, 0, 1
    if is_hf_conv1d(mod):
        return mod.weight.shape[1], mod.weight.shape[0], 1, 0
    return None


def matmul_plan(path: str, mod: nn.Module, shards: dict[str, list[ParamShard]], *, out_dim: int, in_dim: int,
                compute: Callable[[nn.Module, torch.Tensor, bool], torch.Tensor] | None) -> LeafPlan:
    """The plan of a matrix-product leaf whose weight dim `out_dim` holds its outputs and `in_dim` its inputs:
    column- and row-parallel splits, a column split's bias split alike, a row split's bias added after the
    reduction. `compute(module, x, use_bias)` is its local product (None: the caller binds one, `LeafPlan.bind`).
    Raises BuildError naming the path, parameter and axis of a layout it does not run."""
    w_shards = shards.get("weight", [])
    b_shards = shards.get("bias", [])
    has_bias = getattr(mod, "bias", None) is not None
    if b_shards and not w_shards:
        raise BuildError(f"build: {path!r}: bias is sharded on {[s.axis for s in b_shards]} but weight is not")
    plan = LeafPlan()
    col, row = [], []
    for s in w_shards:
        if s.dim == out_dim:
            col.append(s.axis)
            plan.out[s.axis] = Shard(-1)
            match = [b for b in b_shards if b.axis == s.axis]
            if has_bias and (not match or match[0].dim != 0 or match[0].blocks != s.blocks):
                raise BuildError(f"build: {path!r} weight is split on output dim {out_dim} over axis {s.axis!r} "
                                 f"(column parallel) but its bias is not split the same way; add "
                                 f"sch[{path!r}].shard('bias', dim=0, axis={s.axis!r}"
                                 f"{', blocks=%d' % s.blocks if s.blocks > 1 else ''})")
        elif s.dim == in_dim:
            if s.blocks != 1:
                raise BuildError(f"build: {path!r}: blocks={s.blocks} is only supported on the output dim")
            row.append(s.axis)
            plan.out[s.axis] = Partial()
            if any(b.axis == s.axis for b in b_shards):
                raise BuildError(f"build: {path!r} weight is split on input dim {in_dim} over axis {s.axis!r} "
                                 f"(row parallel): its bias must stay whole on that axis")
    if len(row) > 1:
        raise BuildError(f"build: {path!r}: the input dim is split over several axes {row}; split it on one")
    plan.grad_partial_axes = tuple(col)
    plan.row_axes = tuple(row)
    if row and has_bias:
        plan.pending_bias = "bias"
    use_bias = not row
    if compute is not None:
        plan.forward = lambda m, x: compute(m, x, use_bias)
    return plan


@register_leaf_rule(nn.Linear)
def _linear_rule(path: str, mod: nn.Module, shards: dict[str, list[ParamShard]]) -> LeafPlan:
    def compute(m: nn.Module, x: torch.Tensor, use_bias: bool) -> torch.Tensor:
        return F.linear(x, m.weight, m.bias if use_bias else None)

    return matmul_plan(path, mod, shards, out_dim=0, in_dim=1, compute=compute)


def _conv1d_rule(path: str, mod: nn.Module, shards: dict[str, list[ParamShard]]) -> LeafPlan:
    # transformers' Conv1D: y = x @ W + b with W of shape (in, out)
    def compute(m: nn.Module, x: torch.Tensor, use_bias: bool) -> torch.Tensor:
        y = x @ m.weight
        return y + m.bias if use_bias and m.bias is not None else y

    return matmul_plan(path, mod, shards, out_dim=1, in_dim=0, compute=compute)


register_leaf_rule(HF_CONV1D)(_conv1d_rule)
