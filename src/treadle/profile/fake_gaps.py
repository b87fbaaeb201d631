"""Gaps of PyTorch's fake tensors treadle fills: shape functions they lack for dtypes the real CPU kernels accept,
and a deep copy of a fake model without a deprecation warning.

`treadle.price` and the planner's capture run a model's step on fake tensors (shapes and dtypes, no data). A
fake op runs the op's *meta* function, and a few meta functions still check the constraints of one GPU kernel
where the CPU kernel is general. One met so far:

* ``aten._grouped_mm`` (a mixture-of-experts layer's experts as one grouped product; Hugging Face calls it for
  every dtype on CPU): its meta function requires bfloat16, the CPU kernel takes float32 too. `call` runs the
  meta function on bfloat16 stand-ins of the same shapes and returns the output in the dtype the real kernel
  returns (the inputs' dtype, or `out_dtype`). Shapes, strides and every other check are the meta function's;
  its 16-byte stride alignment is then checked on 2-byte elements, stricter than the real float32 kernel (a
  weight whose inner size is not a multiple of 8 is refused here and accepted by the CPU kernel).

Pure shape logic: nothing here changes what a real (non-fake) tensor computes.

`copy_model`: the planner and the price copy a model whose tensors may be fake (`copy.deepcopy`). torch's
`Tensor.__deepcopy__` asks a tensor subclass for its ``data_ptr()`` to choose ``clone()``, which a FakeTensor
answers with "Accessing the data pointer of FakeTensor is deprecated" (once per process: on every ``treadle
plan``); the copy is the same, so that one warning is silenced, for that call only.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, TypeVar

_T = TypeVar("_T")

import torch
from torch._subclasses.fake_tensor import FakeTensor

_BF16_ONLY = {torch.ops.aten._grouped_mm.default}


def copy_model(model: _T) -> _T:
    """``copy.deepcopy(model)``, without torch's FakeTensor ``data_ptr`` warning (module doc)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor", category=UserWarning)
        return copy.deepcopy(model)


def call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)``, with the stand-ins above for fake operands of an op in `_BF16_ONLY`."""
    if func in _BF16_ONLY and len(args) >= 2 and all(isinstance(a, FakeTensor) for a in args[:2]):
        a, b = args[0], args[1]
        if a.dtype == b.dtype and a.dtype != torch.bfloat16 and a.dtype.is_floating_point:
            dtype = kwargs.get("out_dtype") or a.dtype
            kw = {k: v for k, v in kwargs.items() if k != "out_dtype"}
            bias = kw.get("bias")
            if isinstance(bias, torch.Tensor):
                kw["bias"] = bias.to(torch.bfloat16)
            out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *args[2:], **kw)
            return out.to(dtype)
    return func(*args, **kwargs)
