"""Sharded-compute rules for convolutional leaves: channel-parallel `nn.Conv2d` and `nn.BatchNorm2d`.

Activations are NCHW, so the channel dim is 1 (Slapo's "partition along axis 1").

=================================  ===========  ===========  ===========================================
parameter layout on axis a         output on a  input on a   notes
=================================  ===========  ===========  ===========================================
Conv2d W(out,in,kh,kw) Shard(0)    Shard(1)     Replicate    bias Shard(0) too; input gradient summed
                                                             over a (like a column-parallel Linear)
Conv2d Shard(1)                    Partial      Shard(1)     bias-free only (a bias would need adding
                                                             once after the reduction, per channel)
BatchNorm2d weight/bias Shard(0)   Shard(1)     Shard(1)     running_mean / running_var are sliced the
                                                             same way at build; statistics per channel
                                                             are exact (each rank sees whole N, H, W)
=================================  ===========  ===========  ===========================================

Grouped or depthwise convolutions are refused (their channel groups would need splitting along groups).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.placement_types import Partial, Shard

from ...errors import BuildError
from ...runtime.params import local_slice
from ...schedule.state import ParamShard
from ...sharding_rules import LeafPlan, register_leaf_rule


@register_leaf_rule(nn.Conv2d)
def _conv2d_rule(path: str, mod: nn.Module, shards: dict[str, list[ParamShard]]) -> LeafPlan:
    if mod.groups != 1:
        raise BuildError(f"build: {path!r}: a sharded Conv2d with groups={mod.groups} is not supported; shard "
                         f"convolutions with groups=1")
    w_shards = shards.get("weight", [])
    b_shards = shards.get("bias", [])
    if b_shards and not w_shards:
        raise BuildError(f"build: {path!r}: bias is sharded on {[s.axis for s in b_shards]} but weight is not")
    plan = LeafPlan()
    col, row = [], []
    for s in w_shards:
        if s.blocks != 1:
            raise BuildError(f"build: {path!r}: blocks={s.blocks} is not supported for Conv2d")
        if s.dim == 0:
            col.append(s.axis)
            plan.out[s.axis] = Shard(1)
            if mod.bias is not None and not any(b.axis == s.axis and b.dim == 0 for b in b_shards):
                raise BuildError(f"build: {path!r} weight is split on its output channels over axis {s.axis!r} but "
                                 f"its bias is not; add sch[{path!r}].shard('bias', dim=0, axis={s.axis!r})")
        elif s.dim == 1:
            row.append(s.axis)
            plan.out[s.axis] = Partial()
            if mod.bias is not None:
                raise BuildError(f"build: {path!r} weight is split on its input channels over axis {s.axis!r} "
                                 f"(a pending sum) but the Conv2d has a bias, which would be added on every rank; "
                                 f"use bias=False or split the output channels instead")
        else:
            raise BuildError(f"build: {path!r}: Conv2d weight dim {s.dim} is a kernel dim; split dim 0 (output "
                             f"channels) or 1 (input channels)")
    if len(row) > 1:
        raise BuildError(f"build: {path!r}: the input channels are split over several axes {row}; split them on one")
    plan.grad_partial_axes = tuple(col)
    plan.row_axes = tuple(row)
    plan.forward = lambda m, x: m._conv_forward(x, m.weight, m.bias)
    return plan


_BN_BUFFERS = ("running_mean", "running_var")


@register_leaf_rule(nn.BatchNorm2d)
def _batchnorm2d_rule(path: str, mod: nn.Module, shards: dict[str, list[ParamShard]]) -> LeafPlan:
    plan = LeafPlan()
    w, b = shards.get("weight", []), shards.get("bias", [])
    if [(s.dim, s.axis) for s in w] != [(s.dim, s.axis) for s in b]:
        raise BuildError(f"build: {path!r}: BatchNorm2d weight and bias must be split the same way (got weight "
                         f"{[(s.dim, s.axis) for s in w]}, bias {[(s.dim, s.axis) for s in b]})")
    for s in w:
        plan.out[s.axis] = Shard(1)
    return plan


def slice_running_stats(builder) -> None:
    """Before parameters are sliced: a BatchNorm2d with channel-split parameters keeps only its channels'
    running statistics (the same split as its weight)."""
    for path, m in builder.model.named_modules():
        if type(m) is not nn.BatchNorm2d or m.weight is None or id(m.weight) not in builder.param_shards:
            continue
        shards = builder.param_shards[id(m.weight)]
        for name in _BN_BUFFERS:
            buf = getattr(m, name, None)
            if buf is not None:
                m._buffers[name] = local_slice(buf, shards, builder.coords, builder.sizes).clone()

