"""Bytes of parameters, gradients and optimizer state per module. Pure functions of parameter metadata; bytes.

Optimizer state (per trainable parameter of n elements; Rajbhandari et al., ZeRO, SC'20, Sec. 3.1):
- "adamw", fp32 parameters: two fp32 moments, 8n bytes.
- "adamw", 16-bit parameters (mixed precision): fp32 master copy + two fp32 moments, 12n bytes
  (with the 2n-byte bf16/fp16 parameter and 2n-byte gradient this is ZeRO's 16 bytes per parameter).
- "sgd": one momentum buffer in the parameter's dtype (if `momentum`), else nothing. "none": nothing.
Gradients have the parameter's dtype and exist for parameters with `requires_grad`.
"""

from __future__ import annotations

from typing import Iterable, Literal

import torch

from ..errors import ProfileError

Optimizer = Literal["adamw", "sgd", "none"]
OPTIMIZERS = ("adamw", "sgd", "none")
FP32_BYTES = 4


def parameter_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def buffer_bytes(model: torch.nn.Module) -> int:
    """Bytes of every buffer of `model` (persistent or not, as `Module.buffers()` lists them, each once)."""
    return sum(b.numel() * b.element_size() for b in model.buffers())


def gradient_bytes(p: torch.Tensor) -> int:
    return parameter_bytes(p) if p.requires_grad else 0


def optimizer_state_bytes(p: torch.Tensor, *, optimizer: str = "adamw", master_weights: bool | None = None,
                          momentum: bool = True) -> int:
    """Optimizer state bytes of one parameter. `master_weights=None` keeps an fp32 master copy exactly when the
    parameter is not fp32/fp64. Raises ProfileError for an unknown optimizer, listing the known ones."""
    if optimizer not in OPTIMIZERS:
        raise ProfileError(f"unknown optimizer {optimizer!r}; known: {OPTIMIZERS}")
    if not p.requires_grad or optimizer == "none":
        return 0
    n = p.numel()
    if optimizer == "sgd":
        return parameter_bytes(p) if momentum else 0
    if master_weights is None:
        master_weights = p.dtype not in (torch.float32, torch.float64)
    moment_bytes = max(p.element_size(), FP32_BYTES) if not master_weights else FP32_BYTES
    return 2 * n * moment_bytes + (n * FP32_BYTES if master_weights else 0)


def state_bytes(params: Iterable[torch.Tensor], *, optimizer: str = "adamw",
                master_weights: bool | None = None) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer state) bytes of `params` (deduplicate tied parameters before calling)."""
    pb = gb = ob = 0
    for p in params:
        pb += parameter_bytes(p)
        gb += gradient_bytes(p)
        ob += optimizer_state_bytes(p, optimizer=optimizer, master_weights=master_weights)
    return pb, gb, ob
