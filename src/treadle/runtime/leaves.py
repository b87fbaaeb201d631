"""Build's part of running sharded leaves: a leaf that keeps its own forward runs it on parameters gathered in
forward (`gathered_forward`; NOTE [exact leaf rules] in `treadle.sharding_rules`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..schedule.state import ParamShard


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
