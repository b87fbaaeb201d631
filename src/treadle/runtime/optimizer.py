"""AdamW as treadle's runtime makes it (`treadle.train`, `treadle.run`), and how `treadle.price` charges it.

NOTE [foreach optimizer]: PyTorch picks AdamW's multi-tensor (foreach) kernels by default only for accelerator
tensors; on CPU it loops over the parameter tensors, ~10 dispatched ops each. On FSDP2's DTensor parameters every
one of those ops also goes through DTensor's dispatch (~25-35 us on a CPU core). Measured on 4 gloo ranks
(2 CPU cores) with the demo's GPT-2 under FSDP2, the optimizer step took 77 ms of a 360 ms step in the loop form
and 15 ms in the foreach form (DDP: 18 and 17 ms). The runtime therefore asks for foreach whenever the
parameters are all of one kind (all DTensors or all plain tensors: a foreach kernel takes one kind), on every
device, and the `cpu` device specs say so (`HardwareSpec.optimizer_foreach`), so the price charges the form
that runs. An optimizer you make yourself is yours: set `optimizer_foreach` of the device spec to match it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def foreach_ok(params: Iterable[torch.Tensor]) -> bool:
    """True when the multi-tensor kernels can take every parameter: all DTensors or all plain tensors."""
    return len({isinstance(p, DTensor) for p in params}) <= 1


def adamw(params: Iterable[torch.Tensor] | list[dict], **kwargs) -> torch.optim.AdamW:
    """`torch.optim.AdamW(params, **kwargs)` in the foreach form when `foreach_ok` (NOTE [foreach optimizer]);
    `params` may be parameter groups (dicts with "params")."""
    params = list(params)
    flat = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
    kwargs.setdefault("foreach", foreach_ok(flat))
    return torch.optim.AdamW(params, **kwargs)
