"""Roofline time of one op: the larger of its compute time and its memory time. Pure functions; seconds."""

from __future__ import annotations

import torch

from .hardware import HardwareSpec


def compute_time_s(flops: int, hw: HardwareSpec, dtype: torch.dtype | str) -> float:
    """`flops` at the spec's peak for `dtype` times `compute_efficiency`. Raises ProfileError for an unknown dtype."""
    if flops <= 0:
        return 0.0
    return flops / (hw.peak_for(dtype) * hw.compute_efficiency)


def memory_time_s(moved_bytes: int, hw: HardwareSpec) -> float:
    """`moved_bytes` (read + written) at the spec's bandwidth times `memory_efficiency`."""
    if moved_bytes <= 0:
        return 0.0
    return moved_bytes / (hw.hbm_bytes_per_s * hw.memory_efficiency)


def op_time_s(flops: int, moved_bytes: int, hw: HardwareSpec, dtype: torch.dtype | str) -> float:
    """Roofline estimate (Williams, Waterman and Patterson, CACM 2009): an op takes the longer of its compute time
    and its memory time; both use the spec's efficiency factors. `dtype` picks the compute peak (for an op without
    FLOPs it is not consulted). Launch overheads are not modelled."""
    mem_s = memory_time_s(moved_bytes, hw)
    if flops <= 0:
        return mem_s
    return max(compute_time_s(flops, hw, dtype), mem_s)


def mfu(model_flops: int, step_time_s: float, hw: HardwareSpec, dtype: torch.dtype | str) -> float:
    """Model FLOPs utilisation (Chowdhery et al., PaLM 2022, App. B): achieved model FLOP/s over the peak for
    `dtype`. `model_flops` counts forward + backward without recomputation."""
    if step_time_s <= 0:
        return 0.0
    return model_flops / step_time_s / hw.peak_for(dtype)
