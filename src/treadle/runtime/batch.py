"""Splitting a global batch over the data-parallel axis, checked first (verify, train and run share it).

A batched input is a tensor whose dim 0 has the global batch size B (the first tensor input's dim 0);
other inputs (scalars, non-batched tensors) go to every rank whole. Rank i of n gets rows [i*B/n, (i+1)*B/n).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import TreadleError


def batch_size(inputs: dict[str, Any], where: str) -> int:
    """The global batch size B of `inputs` (dim 0 of the first tensor input with dims).
    Raises TreadleError naming `where` when no input is a batched tensor."""
    for v in inputs.values():
        if torch.is_tensor(v) and v.dim() > 0:
            return int(v.shape[0])
    raise TreadleError(f"{where}: the inputs {sorted(inputs)} hold no batched tensor (one with a dim 0)")


def check_batch(inputs: dict[str, Any], dp_size: int, *, axis: str | None, where: str) -> int:
    """B, after checking that it splits evenly into `dp_size` data-parallel parts of at least one row.
    Raises TreadleError naming `where`, B, the axis and its size, and what would work."""
    b = batch_size(inputs, where)
    if dp_size > 1 and (b < dp_size or b % dp_size):
        why = "is smaller than" if b < dp_size else "does not divide by"
        raise TreadleError(f"{where}: the global batch {b} {why} the data-parallel size {dp_size} (mesh axis "
                           f"{axis!r}); use a batch that is a multiple of {dp_size}, e.g. {dp_size * max(1, b // dp_size)}")
    return b


def split_batch(inputs: dict[str, Any], dp_size: int, index: int, *, axis: str | None, where: str) -> dict[str, Any]:
    """Data-parallel part `index` of `dp_size` of `inputs` (checked with `check_batch`)."""
    b = check_batch(inputs, dp_size, axis=axis, where=where)
    if dp_size == 1:
        return dict(inputs)
    return {k: (v.chunk(dp_size, dim=0)[index] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == b else v)
            for k, v in inputs.items()}
