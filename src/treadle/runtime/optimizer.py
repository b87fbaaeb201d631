"""AdamW as treadle's runtime makes it (`treadle.train`, `treadle.run`), and what one step of it costs: the one
statement of that cost the price (`treadle.pricing`) and the planner's cost graph both read (`adamw_tensor_s`,
`adamw_fixed_s`).

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
eight passes (NOTE [AdamW traffic] below) and, on CPU, dispatches each of its ~12 list
ops once per tensor. Measured on one core with the benches' GPT-2 (0.96 M parameters): 1.8-3.3 ms per step
fused, 6.4-8.6 ms foreach; results equal to ~1e-7 (rounding). The runtime asks for it whenever the
parameters are floating point, of one kind and on a device with fused kernels (`fused_ok`), else for
foreach when `foreach_ok`, else the loop; the device specs say `optimizer_fused=True`, and the price charges
one pass (`HardwareSpec.optimizer_fused`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..profile.roofline import op_time_s

# torch.optim.AdamW (no amsgrad) per element: ~12 FLOPs (two moment updates, bias corrections, sqrt, division,
# decoupled weight decay). Dispatched ops per step (counted in PyTorch 2.13): the per-tensor loop (PyTorch's
# default on CPU) ~10 per parameter tensor; the foreach form (default for CUDA tensors) ~12 multi-tensor ops
# plus ~2 per parameter tensor (step counters).
ADAMW_FLOPS_PER_ELEM = 12
_ADAMW_OPS = 10
_ADAMW_FOREACH_OPS = 12
_ADAMW_FOREACH_OPS_PER_PARAM = 2
# the fused kernel (NOTE [fused optimizer]): the step counters' foreach add and `_fused_adamw_` over the list,
# which loops over the tensors in C++ (measured on one core: ~8 us per tensor, ~one dispatch's worth)
_ADAMW_FUSED_OPS = 2
_ADAMW_FUSED_OPS_PER_PARAM = 1


# NOTE [AdamW traffic]: torch.optim.AdamW (PyTorch 2.13, no amsgrad, not `fused`) makes eight elementwise
# passes over every parameter element, in the loop form and the foreach form alike; each pass reads and writes
# memory of its own (p: a parameter's or gradient's element size, s: one moment's):
#     p.mul_(1 - lr * wd)                 read p, write p         2p
#     m.lerp_(g, 1 - beta1)               read m, g, write m      2s + p
#     v.mul_(beta2)                       read v, write v         2s
#     v.addcmul_(g, g, 1 - beta2)         read v, g, write v      2s + p
#     d = v.sqrt()                        read v, write d         2s
#     d.div_(bias_correction2 ** 0.5)     read d, write d         2s
#     d.add_(eps)                         read d, write d         2s
#     p.addcdiv_(m, d, -step_size)        read p, m, d, write p   2p + 2s
# = 6p + 14s bytes per element: 80 B for fp32 parameters and moments, ~2.9x the 28 B of one fused pass (read
# p, g, m, v; write p, m, v). Measured on one core (GPT-2 of the benches, 0.96 M parameters): 5.9-8.4 ms per
# step in the foreach form, priced 3.6-3.8 ms with 28 B and ~8.5 ms with 80 B. The runtime now runs the fused
# kernel wherever it can (NOTE [fused optimizer]; 1.8-3.3 ms), and `HardwareSpec.optimizer_fused` says which
# form is charged. The fused kernel makes one pass: read p, g, m, v; write p, m, v = 3p + 4s (28 B in fp32).
def adamw_bytes_per_elem(param_itemsize: int, optimizer_bytes_per_elem: int, fused: bool = False) -> float:
    """Bytes AdamW's step moves per parameter element (NOTE [AdamW traffic]): one pass when `fused`, eight
    otherwise; `optimizer_bytes_per_elem` is both moments' (8 for fp32 AdamW)."""
    if fused:
        return 3 * param_itemsize + 4 * optimizer_bytes_per_elem / 2
    return 6 * param_itemsize + 14 * optimizer_bytes_per_elem / 2


def adamw_ops(n_tensors: int, foreach: bool, fused: bool = False) -> tuple[int, int]:
    """(dispatched ops, of which on whole lists) of one AdamW step over `n_tensors` parameter tensors: a DTensor
    parameter pays `subclass_op_overhead_s` once per op of the loop, or once per list op in the foreach and
    fused forms."""
    if fused:
        return _ADAMW_FUSED_OPS + _ADAMW_FUSED_OPS_PER_PARAM * n_tensors, _ADAMW_FUSED_OPS
    if foreach:
        return _ADAMW_FOREACH_OPS + _ADAMW_FOREACH_OPS_PER_PARAM * n_tensors, _ADAMW_FOREACH_OPS
    return _ADAMW_OPS * n_tensors, _ADAMW_OPS * n_tensors


def adamw_tensor_s(elems: float, dtype: torch.dtype, optimizer_bytes_per_elem: int, hw: Any, *,
                   subclass: bool) -> float:
    """One parameter tensor's share of an AdamW step on `hw` (a HardwareSpec): the elementwise work on its
    `elems` local elements (roofline, NOTE [AdamW traffic]) and the ops dispatched per tensor (the loop form's
    ten, each through DTensor's dispatch too when the parameters are tensor subclasses (`subclass`); the
    foreach and fused forms' per-tensor part). The step's list ops are `adamw_fixed_s`."""
    moved = elems * adamw_bytes_per_elem(dtype.itemsize, optimizer_bytes_per_elem, hw.optimizer_fused)
    n_ops, n_list = adamw_ops(1, hw.optimizer_foreach, hw.optimizer_fused)
    host = (n_ops - n_list) * hw.op_overhead_s if n_ops != n_list else n_ops * (
        hw.op_overhead_s + (hw.subclass_op_overhead_s if subclass else 0.0))
    return op_time_s(int(ADAMW_FLOPS_PER_ELEM * elems), int(moved), hw, dtype) + host


def adamw_fixed_s(hw: Any, *, subclass: bool) -> float:
    """The part of an AdamW step that does not grow with the tensor count: the foreach and fused forms' list
    ops (each through DTensor's dispatch once when the parameters are tensor subclasses); 0 for the loop."""
    n_ops, n_list = adamw_ops(0, hw.optimizer_foreach, hw.optimizer_fused)
    return n_list * (hw.op_overhead_s + (hw.subclass_op_overhead_s if subclass else 0.0))


def trainable_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every parameter the optimizer steps (those that get a gradient), in
    `named_parameters` order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


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


def after_optimizer_step(model: torch.nn.Module) -> None:
    """Each parallel form's work after an optimizer step of a built `model` (`Form.after_optimizer_step`: float8's
    scales for FSDP2's next gathers). Every training loop calls it right after ``opt.step()``: `treadle.run`,
    `treadle.train` and verify's ranks, so they run what the price prices."""
    from ..form import forms

    for f in forms():
        f.after_optimizer_step(model)
