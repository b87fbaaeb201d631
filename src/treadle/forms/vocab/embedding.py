"""The vocab-parallel embedding's sharded compute: the Embedding rule (registered in `treadle.sharding_rules`) and its
masked lookup.

=============================  ==============  ===========  ========================================
weight layout on axis a        output on a     input on a   notes
=============================  ==============  ===========  ========================================
Embedding W(V,E) Shard(0)      Partial         Replicate    masked lookup of the local vocab range
Embedding Shard(1)             Shard(-1)       Replicate
=============================  ==============  ===========  ========================================
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor.placement_types import Partial, Shard

from ...errors import BuildError
from ...schedule.state import ParamShard
from ...sharding_rules import LeafPlan, register_leaf_rule


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
        axis = plan.vocab_axis = vocab[0].axis

        def bind(builder) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
            m = builder.module(path)
            v_local = m.weight.shape[0] // builder.sizes[axis]
            return embedding_forward(builder.coords[axis] * v_local, m.weight.shape[0])

        plan.bind = bind
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
