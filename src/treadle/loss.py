"""The one loss convention of every entry point: profile, plan, price, verify and train call `default_loss` when
no ``loss_fn=`` is given, and `call_loss` to check what a user's ``loss_fn`` returns."""

from __future__ import annotations

from typing import Any

import torch

from .errors import TreadleError


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a model output when no ``loss_fn=`` is given, the same for profile, plan, verify and train:
    ``output.loss`` (or ``output["loss"]``) when the model returned one (Hugging Face models given labels);
    else a 0-dim floating output itself; else the mean square of the first floating tensor of the output
    (a tensor, a tuple / list, a dict or ModelOutput), a stand-in that touches every output element.
    Raises TreadleError when the output holds no floating tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    t = _first_float(output)
    if t is None:
        raise TreadleError(f"loss: the model output ({type(output).__name__}) has no .loss and no floating tensor; "
                           f"pass loss_fn=(output -> scalar tensor), or give the model labels")
    return t if t.dim() == 0 else t.float().pow(2).mean()


def _first_float(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor) and o.is_floating_point():
                return o
    return None


def call_loss(loss_fn: Any, output: Any, where: str) -> torch.Tensor:
    """`loss_fn(output)` checked to be a scalar tensor; raises TreadleError naming `where` otherwise."""
    loss = loss_fn(output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TreadleError(f"{where}: loss_fn must return a scalar tensor, got {what}")
    return loss.reshape(())
