"""Roofline time of one op: the larger of its compute time and its memory time. Pure functions; seconds."""

from __future__ import annotations

import math

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


def matmul_efficiency(flops: float, hw: HardwareSpec) -> float:
    """The fraction of the peak a matrix product of `flops` reaches (NOTE [kernel rates]): `hw.matmul_curve`
    interpolated in log(FLOPs) and clamped at its ends, or `compute_efficiency` without a curve."""
    curve = hw.matmul_curve
    if not curve or flops <= 0:
        return hw.compute_efficiency
    if flops <= curve[0][0]:
        return curve[0][1]
    if flops >= curve[-1][0]:
        return curve[-1][1]
    for (f0, e0), (f1, e1) in zip(curve, curve[1:]):
        if f0 <= flops <= f1:
            w = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
            return e0 + w * (e1 - e0)
    return curve[-1][1]


def op_time_s(flops: int, moved_bytes: int, hw: HardwareSpec, dtype: torch.dtype | str, *, kind: str | None = None,
              op: str | None = None, elems: int = 0) -> float:
    """Roofline estimate (Williams, Waterman and Patterson, CACM 2009): an op takes the longer of its compute time
    and its memory time; both use the spec's efficiency factors. `dtype` picks the compute peak (for an op without
    FLOPs it is not consulted). Launch overheads are not modelled. With the op's `kind` ("matmul",
    "attention", ...), short `op` name (e.g. "tanh") and output `elems`, the spec's kernel rates refine it (NOTE
    [kernel rates]): a matmul's efficiency by its size, attention's own efficiency, and an arithmetic-bound
    pointwise op at least ``elems * elementwise_s_per_elem[op]``."""
    mem_s = memory_time_s(moved_bytes, hw)
    if op is not None and elems and op in hw.elementwise_s_per_elem:
        mem_s = max(mem_s, elems * hw.elementwise_s_per_elem[op])
    if flops <= 0:
        return mem_s
    if kind == "matmul" and hw.matmul_curve:
        eff = matmul_efficiency(flops, hw)
    elif kind == "attention" and hw.attention_efficiency is not None:
        eff = hw.attention_efficiency
    else:
        eff = hw.compute_efficiency
    return max(flops / (hw.peak_for(dtype) * eff), mem_s)


def mfu(model_flops: int, step_time_s: float, hw: HardwareSpec, dtype: torch.dtype | str) -> float:
    """Model FLOPs utilisation (Chowdhery et al., PaLM 2022, App. B): achieved model FLOP/s over the peak for
    `dtype`. `model_flops` counts forward + backward without recomputation."""
    if step_time_s <= 0:
        return 0.0
    return model_flops / step_time_s / hw.peak_for(dtype)
