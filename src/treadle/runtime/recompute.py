"""Activation checkpointing as build installs it: non-reentrant `torch.utils.checkpoint` around a module's forward,
without the KV cache for a layer that declares it writes one; and what its machinery costs on the host
(`recompute_host_s`, `selective_host_s`: the one statement the price and the planner's cost graph charge)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)


def recompute_host_s(hw, *, ops: int, regions: int) -> float:
    """Host seconds torch.utils.checkpoint adds for `regions` checkpointed regions and `ops` recomputed ops on
    `hw` (a HardwareSpec): its frame and replay per region, its saved-tensor hooks and holders per op (NOTE
    [framework overheads] in `treadle.profile.hardware`)."""
    return regions * hw.checkpoint_region_s + ops * hw.checkpoint_op_s


def selective_host_s(hw, *, ops: int, regions: int) -> float:
    """Host seconds selective checkpointing's dispatch modes add (`torch.utils.checkpoint`'s
    `create_selective_checkpoint_contexts`: a Python `__torch_dispatch__` that asks the policy of every op and
    caches what it keeps) for `regions` regions and `ops` ops run under them, forward and recompute together, on
    `hw` (NOTE [framework overheads] in `treadle.profile.hardware`). On top of `recompute_host_s`. Eager only: a
    compiled region has no dispatch mode at run time."""
    return regions * hw.selective_region_s + ops * hw.selective_op_s


# NOTE [checkpoint and the KV cache]: a checkpointed module's forward runs again in the backward. A Hugging Face
# decoder layer handed the model's KV cache writes its keys and values into it, so the replay writes them a
# second time: the cache ends the step with that layer's entries doubled, and the extra copies stay alive until
# the backward ends (the price of the demo's GPT-2 with 4 of 4 blocks checkpointed: 1.1 MiB of a 5.9 MiB peak).
# Hugging Face's own gradient checkpointing therefore hands such a layer no cache in training: a layer class
# that subclasses its `GradientCheckpointingLayer` declares `_can_checkpoint_with_cache` (False: it writes the
# cache). treadle's `checkpoint` honours that declaration the same way: while training with gradients, the
# layer's cache arguments (`_CACHE_ARGS`, by name, positional or keyword) become None and `use_cache` False,
# with a warning once per layer class. A module without the declaration is replayed as called.
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
_warned_cache: set[str] = set()


def checkpointed_forward(m: nn.Module, orig: Callable, path: str, context_fn: Callable | None = None) -> Callable:
    """`orig` under non-reentrant activation checkpointing (selective with `context_fn`, as
    `torch.utils.checkpoint.checkpoint` takes it), without the KV cache for a layer that declares it writes one
    (NOTE [checkpoint and the KV cache])."""
    from torch.utils.checkpoint import checkpoint

    opts = {"use_reentrant": False} if context_fn is None else {"use_reentrant": False, "context_fn": context_fn}
    if getattr(type(m), "_can_checkpoint_with_cache", True):
        return lambda *a, **k: checkpoint(orig, *a, **opts, **k)
    sig = inspect.signature(orig)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    def forward(*a, **k):
        if m.training and torch.is_grad_enabled():
            try:
                bound = sig.bind(*a, **k)
            except TypeError:  # the call itself is wrong: let the module say so
                return checkpoint(orig, *a, **opts, **k)
            args = bound.arguments
            extra = args.get(var_kw, {}) if var_kw else {}
            dropped = []
            for where in (args, extra):
                for name in _CACHE_ARGS:
                    if where.get(name) is not None:
                        where[name] = None
                        dropped.append(name)
                if where.get("use_cache"):
                    where["use_cache"] = False
                    dropped.append("use_cache")
            if dropped:
                kind = type(m).__name__
                if kind not in _warned_cache:
                    _warned_cache.add(kind)
                    if _first_rank():  # every rank does the same: one line per job, not one per rank
                        logger.warning("checkpoint %s: %s writes the KV cache, which the recompute would write again; "
                                       "in training it gets %s (as Hugging Face's gradient checkpointing does)",
                                       path, kind, ", ".join(f"{n}=False" if n == "use_cache" else f"{n}=None"
                                                             for n in dict.fromkeys(dropped)))
                a, k = bound.args, bound.kwargs
        return checkpoint(orig, *a, **opts, **k)

    return forward


def _first_rank() -> bool:
    """True outside torch.distributed or on its rank 0."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
