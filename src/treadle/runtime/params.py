"""Slicing global parameters to their local shards and gathering them back (pure tensor code).

A parameter's layout is a list of `ParamShard` (dim, axis, blocks) applied in order; the local shard of
rank coordinate c on an axis of size n is chunk c of n along the dim, taken inside each of `blocks`
equal parts. `local_slice` and `assemble` are exact inverses.
"""

from __future__ import annotations

import torch

from ..schedule.state import ParamShard, chunk_dim  # chunk_dim: one definition of a shard's slice


def unchunk_dim(pieces: list[torch.Tensor], dim: int, blocks: int = 1) -> torch.Tensor:
    """Inverse of `chunk_dim` given all n pieces in coordinate order."""
    if blocks == 1:
        return torch.cat(pieces, dim=dim)
    per_piece = [p.chunk(blocks, dim=dim) for p in pieces]
    return torch.cat([torch.cat([pp[b] for pp in per_piece], dim=dim) for b in range(blocks)], dim=dim)


def local_slice(t: torch.Tensor, shards: list[ParamShard], coords: dict[str, int],
                sizes: dict[str, int]) -> torch.Tensor:
    """The local shard of global tensor `t` at mesh coordinate `coords`."""
    for s in shards:
        t = chunk_dim(t, s.dim, sizes[s.axis], coords[s.axis], s.blocks)
    return t


def assemble(local_by_coord: dict[tuple[int, ...], torch.Tensor], shards: list[ParamShard],
             names: tuple[str, ...], sizes: dict[str, int]) -> torch.Tensor:
    """Rebuild the global tensor from the local shards of every mesh coordinate (keys follow `names`)."""
    current = dict(local_by_coord)
    for s in reversed(shards):
        ax = names.index(s.axis)
        merged: dict[tuple[int, ...], torch.Tensor] = {}
        groups: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}
        for coord, t in current.items():
            key = coord[:ax] + (0,) + coord[ax + 1 :]
            groups.setdefault(key, []).append((coord[ax], t))
        for key, items in groups.items():
            items.sort(key=lambda x: x[0])
            merged[key] = unchunk_dim([t for _, t in items], s.dim, s.blocks)
        current = merged
    return next(iter(current.values()))
