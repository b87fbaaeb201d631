"""How a leaf module computes on sharded weights: one rule per module type (Linear, Conv1D, Embedding).

A rule reads the layout of the leaf's parameters and returns a `LeafPlan`: the layout its output has
on each mesh axis, the axes on which its input gradient is a pending sum (a replicated input to a
column-sharded weight), the bias to add once after reduction (row-sharded weight), and the local forward.

=============================  ==============  ===========  ========================================
weight layout on axis a        output on a     input on a   notes
=============================  ==============  ===========  ========================================
Linear W(out,in) Shard(0)      Shard(-1)       Replicate    bias must be Shard(0) on a too; input
Conv1D W(in,out) Shard(1)                                   gradient summed over a (grad_all_reduce)
Linear Shard(1) / Conv1D (0)   Partial         Shard(-1)    bias added once, after the reduction
Embedding W(V,E) Shard(0)      Partial         Replicate    masked lookup of the local vocab range
Embedding Shard(1)             Shard(-1)       Replicate
=============================  ==============  ===========  ========================================
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor.placement_types import Partial, Placement, Shard

from ..errors import BuildError
from ..schedule.core import ParamShard

logger = logging.getLogger(__name__)

LeafRule = Callable[[str, nn.Module, dict[str, list[ParamShard]]], "LeafPlan"]
_RULES: dict[type, LeafRule] = {}


@dataclass
class LeafPlan:
    """What a sharded leaf needs at build. Axes not named keep Replicate."""

    out: dict[str, Placement] = field(default_factory=dict)  # output layout per axis
    grad_partial_axes: tuple[str, ...] = ()  # input gradient is a pending sum over these axes
    pending_bias: str | None = None  # name of a bias to add after the row reduction
    row_axes: tuple[str, ...] = ()
    forward: Callable[..., torch.Tensor] | None = None  # local forward(module, x) replacing the original
    vocab_axis: str | None = None
    gathered: dict[str, list[ParamShard]] | None = None  # own forward on these parameters, gathered in forward


def register_leaf_rule(*types: type) -> Callable[[LeafRule], LeafRule]:
    """Register a rule for module types; a second rule for one type is an error."""

    def deco(fn: LeafRule) -> LeafRule:
        for t in types:
            if t in _RULES:
                raise BuildError(f"a leaf rule for {t.__qualname__} is already registered ({_RULES[t].__name__})")
            _RULES[t] = fn
        return fn

    return deco


def has_leaf_rule(mod: nn.Module) -> bool:
    """True when build can compute `mod` with sharded parameters: a rule for its class or a base class."""
    return any(t in _RULES for t in type(mod).__mro__)


def leaf_plan(path: str, mod: nn.Module, shards: dict[str, list[ParamShard]]) -> LeafPlan:
    """The plan for leaf `mod` whose direct parameters have `shards`. Raises BuildError for a module
    type without a rule or a layout the rule does not support, naming path, parameter and axis.

    NOTE [exact leaf rules]: a rule reproduces one class's forward. It applies to that class and to
    subclasses that keep its forward; a subclass with its own forward (Gemma's scaled embedding multiplies
    the lookup) runs that forward on weights gathered to full size in forward (`gathered_plan`), so its
    output is Replicate and its own computation is kept; sharding it saves parameter memory, not compute."""
    for t in type(mod).__mro__:
        if t in _RULES:
            if t is type(mod) or getattr(type(mod), "forward", None) is getattr(t, "forward", None):
                return _RULES[t](path, mod, shards)
            logger.info("build: %r is a %s with its own forward; it runs on gathered weights (no %s rule for it)",
                        path, type(mod).__qualname__, t.__qualname__)
            return gathered_plan(path, mod, shards)
    known = sorted(t.__qualname__ for t in _RULES)
    raise BuildError(f"build: {path!r} ({type(mod).__name__}) has sharded parameters {sorted(shards)} but "
                     f"treadle has no sharded-compute rule for that module type (rules exist for {known}); "
                     f"shard its children instead, or replace it with a module of a supported type")


def gathered_plan(path: str, mod: nn.Module, shards: dict[str, list[ParamShard]]) -> LeafPlan:
    """A leaf that keeps its own forward: each sharded parameter is all-gathered to its global shape in forward
    (gradient: this rank's slice, exact because the input and output are Replicate on the gathered axes).
    Output: Replicate on every axis. The caller fills `forward` with `gathered_forward` (it needs groups)."""
    for name, ss in shards.items():
        if not isinstance(getattr(mod, name, None), torch.Tensor):
            raise BuildError(f"build: {path!r}: sharded {name!r} is not a tensor attribute of "
                             f"{type(mod).__qualname__}")
    return LeafPlan(gathered=dict(shards))


def gathered_forward(shards: dict[str, list[ParamShard]], group: Callable[[str], Any],
                     ) -> Callable[..., torch.Tensor]:
    """forward(module, *args, **kwargs): the class's own forward with `shards`' parameters gathered, undoing
    the splits in reverse order (the last split is the innermost), interleaved blocks included."""
    from . import collectives as C

    def full(p: torch.Tensor, ss: list[ParamShard]) -> torch.Tensor:
        for s in reversed(ss):
            g = group(s.axis)
            x = C.all_gather(p, s.dim, g)
            if s.blocks > 1:  # rank pieces each hold (b_0, ..., b_k): regroup block by block
                n = x.shape[s.dim] // p.shape[s.dim]
                pieces = [q.chunk(s.blocks, dim=s.dim) for q in x.chunk(n, dim=s.dim)]
                x = torch.cat([torch.cat([q[b] for q in pieces], dim=s.dim) for b in range(s.blocks)], dim=s.dim)
            p = x
        return p

    def forward(m: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        saved = {n: m._parameters[n] for n in shards}
        try:
            for n, ss in shards.items():
                m._parameters[n] = full(saved[n], ss)
            return type(m).forward(m, *args, **kwargs)
        finally:
            m._parameters.update(saved)

    return forward


def _matmul_plan(path: str, mod: nn.Module, shards: dict[str, list[ParamShard]], *, out_dim: int,
                 in_dim: int, compute: Callable[[nn.Module, torch.Tensor, bool], torch.Tensor]) -> LeafPlan:
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
    plan.forward = lambda m, x: compute(m, x, use_bias)
    return plan


@register_leaf_rule(nn.Linear)
def _linear_rule(path: str, mod: nn.Module, shards: dict[str, list[ParamShard]]) -> LeafPlan:
    def compute(m: nn.Module, x: torch.Tensor, use_bias: bool) -> torch.Tensor:
        return F.linear(x, m.weight, m.bias if use_bias else None)

    return _matmul_plan(path, mod, shards, out_dim=0, in_dim=1, compute=compute)


def _conv1d_rule(path: str, mod: nn.Module, shards: dict[str, list[ParamShard]]) -> LeafPlan:
    # transformers' Conv1D: y = x @ W + b with W of shape (in, out)
    def compute(m: nn.Module, x: torch.Tensor, use_bias: bool) -> torch.Tensor:
        y = x @ m.weight
        return y + m.bias if use_bias and m.bias is not None else y

    return _matmul_plan(path, mod, shards, out_dim=1, in_dim=0, compute=compute)


try:  # a layer type of transformers (GPT-2 and relatives), not a model class
    from transformers.pytorch_utils import Conv1D as _HFConv1D

    register_leaf_rule(_HFConv1D)(_conv1d_rule)
except ImportError:  # pragma: no cover - transformers is a dependency, but the rule is optional
    pass


@register_leaf_rule(nn.Embedding)
def _embedding_rule(path: str, mod: nn.Module, shards: dict[str, list[ParamShard]]) -> LeafPlan:
    plan = LeafPlan()
    w_shards = shards.get("weight", [])
    vocab = [s for s in w_shards if s.dim == 0]
    if len(vocab) > 1:
        raise BuildError(f"build: {path!r}: the vocab dim is split over several axes; split it on one")
    if mod.max_norm is not None:
        raise BuildError(f"build: {path!r}: a sharded Embedding with max_norm is not supported")
    for s in w_shards:
        plan.out[s.axis] = Partial() if s.dim == 0 else Shard(-1)
    if vocab:
        plan.vocab_axis = vocab[0].axis
    return plan


def embedding_forward(vocab_start: int, vocab_size: int) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """Masked lookup of a vocab-sharded embedding: ids outside [start, start + V/n) give zero rows (another
    rank holds them). An id outside [0, vocab_size) raises IndexError, as the unsharded lookup does."""

    def forward(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if not is_fake(ids) and not torch.compiler.is_compiling():  # a capture (export, compile) traces no check
            bad = (ids < 0) | (ids >= vocab_size)
            if ids.device.type == "cpu":
                if bool(bad.any()):
                    raise IndexError(f"index out of range in self: ids {ids[bad].unique()[:8].tolist()} outside "
                                     f"[0, {vocab_size}) of a vocab-sharded embedding")
            else:  # a device-side assert, as the unsharded CUDA lookup does, without a host sync
                torch._assert_async(~bad.any(), "index out of range in self (vocab-sharded embedding)")
        v_local = m.weight.shape[0]
        outside = (ids < vocab_start) | (ids >= vocab_start + v_local)
        local_ids = (ids - vocab_start).masked_fill(outside, 0)
        pad = None
        if m.padding_idx is not None and vocab_start <= m.padding_idx < vocab_start + v_local:
            pad = m.padding_idx - vocab_start
        out = F.embedding(local_ids, m.weight, pad, None, 2.0, m.scale_grad_by_freq, m.sparse)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    return forward
