"""AdamW as treadle's runtime makes it (`treadle.train`, `treadle.run`), and how `treadle.price` charges it.

NOTE [foreach optimizer]: PyTorch picks AdamW's multi-tensor (foreach) kernels by default only for accelerator
tensors; on CPU it loops over the parameter tensors, ~10 dispatched ops each. On FSDP2's DTensor parameters every
one of those ops also goes through DTensor's dispatch (~25-35 us on a CPU core). Measured on 4 gloo ranks
(2 CPU cores) with the demo's GPT-2 under FSDP2, the optimizer step took 77 ms of a 360 ms step in the loop form
and 15 ms in the foreach form (DDP: 18 and 17 ms). The runtime therefore asks for foreach whenever the
parameters are all of one kind (all DTensors or all plain tensors: a foreach kernel takes one kind), on every
device, and the `cpu` device specs say so (`HardwareSpec.optimizer_foreach`), so the price charges the form
that runs. An optimizer you make yourself is yours: set `optimizer_foreach` of the device spec to match it.

NOTE [fused optimizer]: better still, AdamW's fused kernel (`fused=True`, on CPU as on accelerators, DTensors
included) updates each element in one pass — read p, g, m, v; write p, m, v — where the foreach form makes
eight passes (NOTE [AdamW traffic] in `treadle.planner.price`) and, on CPU, dispatches each of its ~12 list
ops once per tensor. Measured on one core with the benches' GPT-2 (0.96 M parameters): 1.8-3.3 ms per step
fused, 6.4-8.6 ms foreach; results equal to ~1e-7 (rounding). The runtime asks for it whenever the
parameters are floating point, of one kind and on a device with fused kernels (`fused_ok`), else for
foreach when `foreach_ok`, else the loop; the device specs say `optimizer_fused=True`, and the price charges
one pass (`HardwareSpec.optimizer_fused`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def foreach_ok(params: Iterable[torch.Tensor]) -> bool:
    """True when the multi-tensor kernels can take every parameter: all DTensors or all plain tensors."""
    return len({isinstance(p, DTensor) for p in params}) <= 1


def fused_ok(params: Iterable[torch.Tensor]) -> bool:
    """True when AdamW's fused kernel can take every parameter (NOTE [fused optimizer]): one kind (`foreach_ok`),
    floating point, on a device type with fused optimizer kernels."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    params = list(params)
    devices = set(_get_fused_kernels_supported_devices())
    return bool(params) and foreach_ok(params) and all(
        torch.is_floating_point(p) and p.device.type in devices for p in params)


def adamw(params: Iterable[torch.Tensor] | list[dict], **kwargs) -> torch.optim.AdamW:
    """`torch.optim.AdamW(params, **kwargs)` with the fused kernel when `fused_ok` (NOTE [fused optimizer]), else
    the foreach form when `foreach_ok` (NOTE [foreach optimizer]), else the loop; an explicit `fused` or
    `foreach` argument stands. `params` may be parameter groups (dicts with "params")."""
    params = list(params)
    flat = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
    if "fused" not in kwargs and "foreach" not in kwargs:
        if fused_ok(flat):
            kwargs["fused"] = True
        else:
            kwargs["foreach"] = foreach_ok(flat)
    return torch.optim.AdamW(params, **kwargs)
