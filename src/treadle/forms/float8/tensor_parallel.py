"""A float8 linear whose weight tensor parallelism splits: the leaf rule build computes it by (registered for torchao's
`Float8Linear` in the one registry of sharding rules, `treadle.sharding_rules`).

NOTE [float8 under tensor parallelism]: with tensorwise scales each operand of each product is cast with one scale,
from the amax of the whole tensor. A column- or row-parallel leaf holds a slice of its weight, and a row-parallel one
a slice of its input (a column-parallel one a slice of its output's gradient), so the amax of what a rank holds is
not the amax of the tensor the single-process model casts. The rule casts every operand itself, its amax all-reduced
(MAX) over each mesh axis the weight is split on, before torchao's product sees it:

  forward     input, weight                    -> float8, each with its amax over the axes
  backward    output gradient, weight, input   -> float8, each with its amax over the axes (the gradient cast once
                                                  for both products where the recipe gives both one dtype)

(a replicated operand reduces to its own value). The product is torchao's tensorwise one, op for op: it saves the
high-precision input and weight (shared with their other users and with FSDP2's unsharded weight, as torchao's
saves them) and casts them again in the backward. Each element then holds the same float8 value on its rank as in
the single-process float8 model: a column-parallel output is exact; a row-parallel one differs by the order of the
fp32 partial sums the reduction adds, which a later cast can turn into one float8 rounding step (what verify allows
under tensor parallelism: NOTE [what verified means for float8]).
Two all-reduces of one scalar per leaf forward and three per backward: latency-bound collectives on the leaf's
axes, which the price records as it records every c10d op.

A split weight that FSDP2 gathers in float8 (``all_gather=True``) arrives at the leaf already cast, with the scale
torchao's gather took; torchao takes it over the data-parallel shards only (its amax over FSDP2's mesh). So build
sets those scales itself, before every forward (`split_gather_scales`, a pre-hook on the model that runs before the
first unit gathers): the amaxes over FSDP2's shards (torchao's `precompute_float8_dynamic_scale_for_fsdp`, one
all-reduce), then each scale's minimum over the weight's split axes (the scale falls as the amax grows, so that is
the scale of the whole weight's amax, exactly), one all-reduce per set of axes. Every gather of the step (the
forward's, a recomputation's, the backward's) uses them, as the single-process model casts its weight once a step.

Refused (BuildError, and by the primitive when it is stated after the split): the rowwise recipes, whose per-row
scales of the output gradient (column-parallel) or of the input (row-parallel) run along the split dim and are cast
twice with different axes inside torchao's backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...errors import BuildError
from ...schedule.float8_primitive import FLOAT8_ALIGN, tensor_parallel_refusal
from ...schedule.state import ParamShard
from ...schedule.tree import within
from ...sharding_rules import LeafPlan, register_leaf_rule
from ..tensor.leaf_rules import matmul_plan

FLOAT8_LINEAR = "torchao.float8.float8_linear.Float8Linear"  # named, not imported (torchao is optional)


def _cast(x: torch.Tensor, dtype: torch.dtype, mm_config: Any, role: Any, groups: list, pow2: bool) -> torch.Tensor:
    """`x` as a float8 tensor with one scale from its amax over `groups` (torchao's tensorwise cast, the amax
    reduced with a c10d all-reduce: MAX)."""
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale

    with torch.no_grad():
        amax = torch.max(torch.abs(x)).clone()
        for g in groups:
            if dist.get_world_size(g) > 1:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=g)
        scale = amax_to_scale(amax, dtype, round_scales_to_power_of_2=pow2)
    return hp_tensor_and_scale_to_float8(x, scale, dtype, mm_config, role)


def _is_float8(t: torch.Tensor) -> bool:
    """A weight FSDP2 gathered in float8 (torchao's cast already made, with the scale `split_gather_scales` set)."""
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

    return tensor_already_casted_to_fp8(t)


class _Float8ProductOnShards(torch.autograd.Function):
    """torchao's tensorwise float8 product (`matmul_with_hp_or_float8_args`: the same casts of the same operands,
    the same products, the high-precision operands saved for the backward and cast again there), with every cast's
    amax all-reduced over `groups` (NOTE [float8 under tensor parallelism])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_t: torch.Tensor, m: nn.Module, groups: list) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import GemmInputRole as R

        ctx.save_for_backward(x, w_t)
        ctx.m, ctx.groups = m, groups
        c, mm = m.config, m.linear_mm_config
        p2 = c.round_scales_to_power_of_2
        x8 = _cast(x, c.cast_config_input.target_dtype, mm, R.INPUT, groups, p2)
        w8_t = w_t if _is_float8(w_t) else _cast(w_t, c.cast_config_weight.target_dtype, mm, R.WEIGHT, groups, p2)
        y = torch.mm(x8.reshape(-1, x.shape[-1]), w8_t)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        from torchao.float8.float8_training_tensor import GemmInputRole as R

        x, w_t = ctx.saved_tensors
        c, mm, groups = ctx.m.config, ctx.m.linear_mm_config, ctx.groups
        p2 = c.round_scales_to_power_of_2
        g = gy.reshape(-1, gy.shape[-1])
        g8 = _cast(g, c.cast_config_grad_output.target_dtype, mm, R.GRAD_OUTPUT, groups, p2)
        w8_t = w_t if _is_float8(w_t) else _cast(w_t, c.cast_config_weight_for_grad_input.target_dtype, mm, R.WEIGHT,
                                                 groups, p2)
        gx = torch.mm(g8, w8_t.t()).reshape(*gy.shape[:-1], w_t.shape[0])
        gw_dtype = c.cast_config_grad_output_for_grad_weight.target_dtype
        g8_w = g8 if gw_dtype == c.cast_config_grad_output.target_dtype else _cast(g, gw_dtype, mm, R.GRAD_OUTPUT,
                                                                                   groups, p2)
        x8 = _cast(x.reshape(-1, x.shape[-1]), c.cast_config_input_for_grad_weight.target_dtype, mm, R.INPUT,
                   groups, p2)
        gw = torch.mm(g8_w.t(), x8)
        return gx, gw.t(), None, None


def float8_forward(groups: list, use_bias: bool) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """forward(m, x) of a `Float8Linear` on its shards: torchao's tensorwise product with each operand's amax over
    `groups` (NOTE [float8 under tensor parallelism]); the bias added unless the output is a pending sum."""

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled():  # as Float8Linear.forward: the product in autocast's dtype
            x = x.to(torch.get_autocast_gpu_dtype())
        y = _Float8ProductOnShards.apply(x, m.weight.t(), m, groups)
        return y + m.bias.to(y.dtype) if use_bias and m.bias is not None else y

    return forward


@register_leaf_rule(FLOAT8_LINEAR)
def _float8_linear_rule(path: str, mod: nn.Module, shards: dict[str, list[ParamShard]]) -> LeafPlan:
    from torchao.float8.config import ScalingGranularity

    c = mod.config
    casts = (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output)
    if any(cc.scaling_granularity is not ScalingGranularity.TENSORWISE for cc in casts):
        raise BuildError(f"build: {path!r} is a float8 linear split over mesh axis "
                         f"{[s.axis for s in shards.get('weight', [])]}: "
                         f"{tensor_parallel_refusal('rowwise')}")
    plan = matmul_plan(path, mod, shards, out_dim=0, in_dim=1, compute=None)
    split = shards.get("weight", [])
    use_bias = not plan.row_axes

    def bind(builder) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
        local = [mod.out_features, mod.in_features]
        for s in split:
            local[s.dim] //= builder.mesh.size(s.axis)
        if local[0] % FLOAT8_ALIGN or local[1] % FLOAT8_ALIGN:
            raise BuildError(f"build: float8 linear {path!r} ({mod.in_features} -> {mod.out_features}) split over "
                             f"{[(s.axis, builder.mesh.size(s.axis)) for s in split]} holds a ({local[1]} -> "
                             f"{local[0]}) slice, a dim not divisible by {FLOAT8_ALIGN} (torch._scaled_mm's "
                             f"alignment); skip it in float8(skip=[...]) or split it over fewer ranks")
        return float8_forward([builder.group(s.axis) for s in split], use_bias)

    plan.bind = bind
    return plan


def split_gather_scales(model: nn.Module, split: list[tuple[nn.Module, list]]) -> None:
    """The scales of the float8-gathered weights (NOTE [float8 under tensor parallelism]): torchao's over FSDP2's
    shards, then, for each weight in `split` ((its float8 linear, the groups of the axes its weight is split on)),
    the minimum over those groups: the scale of the whole weight's amax."""
    from .runtime import precompute_scales

    precompute_scales(model)
    by_groups: dict[tuple, list[nn.Module]] = {}
    for m, groups in split:
        by_groups.setdefault(tuple(groups), []).append(m)
    with torch.no_grad():
        for groups, mods in by_groups.items():
            scales = torch.stack([m.weight._local_tensor._precomputed_scale for m in mods])
            for g in groups:
                if dist.get_world_size(g) > 1:
                    dist.all_reduce(scales, op=dist.ReduceOp.MIN, group=g)
            for m, sc in zip(mods, scales):
                m.weight._local_tensor._precomputed_scale = sc


def install_split_gather_scales(builder) -> None:
    """The "post_hooks" build step: where FSDP2 will gather a split float8 weight in float8, a forward pre-hook on the
    model sets every such weight's scale before the first unit gathers (NOTE [float8 under tensor parallelism])."""
    from ...schedule.float8_primitive import float8_linears

    lin = {p: spec for p, spec in float8_linears(builder.v.extras).items() if spec.all_gather}
    split = []
    for path, m in builder.model.named_modules():
        shards = builder.param_shards.get(id(m.weight), []) if path in lin else []
        if shards:
            split.append((m, [builder.group(s.axis) for s in shards]))
    if not split or not builder.wrap:
        return
    from ..data.facts import fsdp_units

    units = fsdp_units(builder.model)
    rooted = [p for p, m in builder.model.named_modules() if any(m is x for x, _ in split)
              and next(u for u in units if within(p, u)) == ""]
    if rooted:
        raise BuildError(f"build: float8(all_gather=True) linear {rooted[0]!r} is split over a tensor axis and sits "
                         f"in FSDP2's root unit, which gathers before build can set its float8 scale (NOTE [float8 "
                         f"under tensor parallelism]); state all_gather=False for it or keep it inside the blocks")
    # prepended: before every hook registered so far; FSDP2's own root hook, registered at "wrap", runs first and
    # gathers only the root's own parameters (no float8 linear is outside the blocks' units)
    builder.model.register_forward_pre_hook(lambda mod, args: split_gather_scales(mod, split), prepend=True)
