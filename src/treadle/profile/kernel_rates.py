"""Measure NOTE [kernel rates] (treadle.profile.hardware) on this core: what kernels of a kind really reach.

- `matmul_curve`: fp32 ``torch.mm`` of square (n, n) matrices for n in `MATMUL_SIZES`, each as (FLOPs, achieved
  FLOP/s / peak), the peak being the largest product's rate (the one `calibrate_cpu` reports).
- `attention_efficiency`: ``scaled_dot_product_attention`` forward (causal, fp32) of a small transformer's shape,
  FLOPs by `treadle.profile.flops`, over the peak.
- `elementwise_s_per_elem`: pointwise ops whose kernel is bound by arithmetic (transcendentals): seconds per
  element on a 1M-element fp32 tensor, kept only when slower than copying that tensor (memory-bound ops
  are the roofline's already).

NOTE [operands as a step holds them]: a training step runs each product once on operands that the ops before it
wrote and that other tensors have since pushed out of the core's private caches; a probe that repeats one product
on the same two matrices runs them from L1/L2. Both probes above therefore take each call's operands from a ring
of copies of `ROTATE_BYTES` in all (more than any core's private caches), so that a call finds its operands where a
step finds them. Measured on this 2-core EPYC host (1 MiB L2 a core), the hot probe against the ring: n = 64 0.54 ->
0.37 of the peak, n = 128 0.79 -> 0.59, n = 512 unchanged; LLaMA's (512 x 128) x (128 x 128) product took 0.171 ms
repeated and 0.210 ms from the ring, and its forward's 29 products 10.5 ms inside a step against 8.8 ms priced from
the hot curve.

Times are best-of-`reps` thread CPU time (`overheads.best_thread_time_s`), so run on one torch thread.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .overheads import best_thread_time_s

MATMUL_SIZES = (32, 64, 128, 256, 512)
ROTATE_BYTES = 32 * 2**20  # NOTE [operands as a step holds them]
# pointwise ATen ops (forward and their backward kernels) that transformer blocks use and that may be bound by
# arithmetic on a CPU core
ELEMENTWISE_OPS = ("tanh", "exp", "log", "sigmoid", "erf", "sqrt", "rsqrt", "pow", "sin", "cos", "silu", "gelu",
                   "tanh_backward", "sigmoid_backward", "silu_backward", "gelu_backward", "_softmax",
                   "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data")


def _ring(make: Callable[[], tuple[torch.Tensor, ...]], rotate_bytes: int) -> tuple[Callable[[], tuple], int]:
    """(a function returning the next operands of a ring of copies of ``make()`` holding `rotate_bytes` in all (at
    least one copy; 0: one copy, every call the same operands), the ring's length): NOTE [operands as a step holds
    them]."""
    first = make()
    per = sum(t.numel() * t.element_size() for t in first)
    ring = [first] + [make() for _ in range(max(1, rotate_bytes // max(per, 1)) - 1)]
    at = [0]

    def nxt() -> tuple:
        at[0] = (at[0] + 1) % len(ring)
        return ring[at[0]]

    return nxt, len(ring)


def matmul_curve(peak_flops_per_s: float, *, reps: int = 5,
                 rotate_bytes: int = ROTATE_BYTES) -> tuple[tuple[float, float], ...]:
    points = []
    for n in MATMUL_SIZES:
        nxt, k = _ring(lambda: (torch.randn(n, n), torch.randn(n, n)), rotate_bytes)
        inner = max(k, (256 // n) ** 3)
        t = best_thread_time_s(lambda: torch.mm(*nxt()), reps=reps, inner=inner)
        flops = 2.0 * n**3
        points.append((flops, min(1.0, flops / t / peak_flops_per_s)))
    return tuple(points)


def attention_efficiency(peak_flops_per_s: float, *, reps: int = 5, rotate_bytes: int = ROTATE_BYTES) -> float:
    from . import flops as flops_mod

    nxt, n = _ring(lambda: tuple(torch.randn(2, 4, 64, 32) for _ in range(3)), rotate_bytes)
    t = best_thread_time_s(lambda: F.scaled_dot_product_attention(*nxt(), is_causal=True), reps=reps, inner=max(5, n))
    q, k, v = nxt()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    f = flops_mod.forward_flops(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v),
                                {"is_causal": True}, (out,))
    return max(1e-3, min(1.0, f / t / peak_flops_per_s))


def elementwise_s_per_elem(*, reps: int = 5, numel: int = 1 << 20) -> dict[str, float]:
    x = torch.rand(numel) + 0.5
    y = torch.rand(numel) + 0.5
    dst = torch.empty_like(x)
    copy_s = best_thread_time_s(lambda: dst.copy_(x), reps=reps)
    aten = torch.ops.aten
    calls = {
        "tanh": lambda: torch.tanh(x), "exp": lambda: torch.exp(x), "log": lambda: torch.log(x),
        "sigmoid": lambda: torch.sigmoid(x), "erf": lambda: torch.erf(x), "sqrt": lambda: torch.sqrt(x),
        "rsqrt": lambda: torch.rsqrt(x), "pow": lambda: torch.pow(x, 3.0), "sin": lambda: torch.sin(x),
        "cos": lambda: torch.cos(x), "silu": lambda: F.silu(x), "gelu": lambda: F.gelu(x),
        "tanh_backward": lambda: aten.tanh_backward(y, x), "sigmoid_backward": lambda: aten.sigmoid_backward(y, x),
        "silu_backward": lambda: aten.silu_backward(y, x), "gelu_backward": lambda: aten.gelu_backward(y, x),
        "_softmax": lambda: aten._softmax(x.view(1024, -1), -1, False),
        "_log_softmax": lambda: aten._log_softmax(x.view(1024, -1), -1, False),
        "_softmax_backward_data": lambda: aten._softmax_backward_data(y.view(1024, -1), x.view(1024, -1), -1,
                                                                      torch.float32),
        "_log_softmax_backward_data": lambda: aten._log_softmax_backward_data(y.view(1024, -1), x.view(1024, -1),
                                                                              -1, torch.float32),
    }
    out = {}
    for name in ELEMENTWISE_OPS:
        t = best_thread_time_s(calls[name], reps=reps)
        if t > 1.5 * copy_s:  # clearly above moving the bytes: arithmetic-bound here
            out[name] = t / numel
    return out


__all__ = ["matmul_curve", "attention_efficiency", "elementwise_s_per_elem", "MATMUL_SIZES", "ELEMENTWISE_OPS",
           "ROTATE_BYTES"]
