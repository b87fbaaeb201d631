"""`verify` of a schedule with float8 linears (NOTE [what verified means for float8] in `treadle.forms.float8`): the
reference converted the same way, and the float8 model's fidelity to the original as SQNR checks."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from ..errors import BuildError, VerifyError
from ..forms.float8 import FLOAT8_MIN_SQNR_DB, convert_linears
from ..loss import call_loss
from ..schedule.float8_primitive import float8_linears, float8_specs
from .compare import Diff
from .report import Check


def float8_reference(view: Any, reference: nn.Module) -> nn.Module:
    """A copy of `reference` with the linears the schedule's `float8` names converted as build converts them,
    emulated on the CPU (FSDP2's float8 gather moves the same bytes, so it is no part of the reference)."""
    out = copy.deepcopy(reference)
    try:
        convert_linears(out, view, device=torch.device("cpu"), fsdp=True, wrapped=False, where="verify")
    except BuildError as exc:
        raise VerifyError(f"verify: the float8 reference: {exc}") from None
    return out


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio of `got` against `ref`, in dB (inf when equal)."""
    r, g = ref.detach().double(), got.detach().double()
    noise = float((r - g).pow(2).sum())
    signal = float(r.pow(2).sum())
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _grads(model: nn.Module, slices: list[dict], loss_fn, dp_scale: float) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    total = None
    for sl in slices:
        loss = call_loss(loss_fn, model(**sl), "verify") * dp_scale
        total = loss if total is None else total + loss
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(total.detach()), grads


def fidelity_checks(original: nn.Module, float8_model: nn.Module, slices: list[dict], loss_fn,
                    dp_scale: float, *, seed: int) -> list[Check]:
    """(2) of NOTE [what verified means for float8]: one forward and backward of fresh copies of `original` and
    `float8_model` on the same slices; a "float8" check of the loss and of every parameter gradient, passed when
    its SQNR is at least `FLOAT8_MIN_SQNR_DB`."""
    torch.manual_seed(seed)
    loss0, g0 = _grads(copy.deepcopy(original), slices, loss_fn, dp_scale)
    torch.manual_seed(seed)
    loss8, g8 = _grads(copy.deepcopy(float8_model), slices, loss_fn, dp_scale)
    out = []

    def check(name: str, ref: torch.Tensor, got: torch.Tensor) -> None:
        db = sqnr_db(ref, got)
        err = float((got.double() - ref.double()).abs().max()) if ref.numel() else 0.0
        scale = float(ref.double().abs().max()) if ref.numel() else 0.0
        out.append(Check("float8", name, Diff(err, err / scale if scale else 0.0, db >= FLOAT8_MIN_SQNR_DB,
                                              note=f"SQNR {db:.1f} dB against the original; bound "
                                                   f"{FLOAT8_MIN_SQNR_DB:.0f} dB")))

    check("loss", torch.tensor(loss0), torch.tensor(loss8))
    for name, ref in g0.items():
        if name in g8 and float(ref.abs().max()) > 0:
            check(f"grad {name}", ref, g8[name])
    return out


def has_float8(view: Any) -> bool:
    return bool(float8_specs(view.extras))


def float8_split(view: Any) -> bool:
    """Whether a float8 linear's weight is split over a mesh axis, so that partial products are summed in another
    order than one process sums them (NOTE [float8 under tensor parallelism] in `treadle.forms.float8`)."""
    shards = view.shards_by_name()
    return any(shards.get(f"{lin}.weight") for lin in float8_linears(view.extras))
