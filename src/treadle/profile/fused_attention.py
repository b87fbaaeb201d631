"""NOTE [attention as a GPU runs it]: rehearsing a step on fake CPU tensors for a GPU device.

PyTorch's CPU `scaled_dot_product_attention` takes its fused (flash) kernel only without dropout; with
``dropout_p > 0`` it falls back to the math path, which materialises the (batch, heads, q, k) scores and
probabilities and saves them and the dropout mask for backward. A GPU's flash / memory-efficient kernels run
attention with dropout fused (the mask is regenerated from the RNG state in backward) and save only the
inputs, the output and the log-sum-exp. `GpuAttention` is a TorchFunctionMode that calls the fused kernel
the way a GPU would — the same call with ``dropout_p=0`` on the fake tensors (values do not matter there,
FLOPs and saved bytes do) — so a rehearsal for a GPU prices attention's time and memory as the GPU runs it.
Used by `treadle.price` when the rank's device is not a CPU, and by the planner's capture when it plans for
GPUs only (`capture(gpu_attention=True)`); a CPU device keeps PyTorch's CPU behaviour.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
         torch.ops.aten.scaled_dot_product_attention.default}  # the last: an exported graph's node


class GpuAttention(TorchFunctionMode):
    """Scaled dot-product attention with dropout runs as the fused kernel (dropout folded in), as on a GPU."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _SDPA:
            if len(args) > 4:  # (q, k, v, attn_mask, dropout_p, ...)
                args = args[:4] + (0.0,) + args[5:]
            else:
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


def attach_in_recompute(named_modules, in_backward) -> list:
    """Forward hooks that run the modules a checkpoint recomputes in backward under `GpuAttention` as well:
    the autograd engine does not carry a TorchFunctionMode into backward, so without them a recomputed
    attention with dropout took the CPU's math path — different ops from the forward (a selective
    checkpoint then fails: "encountered during backward but not found in storage") and other FLOPs and
    bytes. `named_modules`: (path, module) pairs; `in_backward()`: whether backward is running. Returns the
    hook handles (remove them after the step)."""
    state = {"depth": 0, "mode": None}

    def pre(mod, args) -> None:
        if not in_backward():
            return
        if state["depth"] == 0:
            state["mode"] = GpuAttention()
            state["mode"].__enter__()
        state["depth"] += 1

    def post(mod, args, out) -> None:
        if state["depth"] == 0:
            return
        state["depth"] -= 1
        if state["depth"] == 0:
            state["mode"].__exit__(None, None, None)
            state["mode"] = None

    handles = []
    for _, m in named_modules:
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, always_call=True))
    return handles


__all__ = ["GpuAttention", "attach_in_recompute"]
