"""What a verify run records on one process: every module's output and gradients, the parameters' gradients and
steps, over the training steps it runs (`_run_steps`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import VerifyError
from ..loss import call_loss
from ..runtime.optimizer import after_optimizer_step

class _Recorder:
    """Forward hooks that keep each module's first tensor output and, through a tensor hook, its gradient,
    per (data slice, call) — a module may run several times per forward (T5 calls its dropout twice).
    Recording stops before backward, so checkpoint recomputation is not mistaken for calls. The modules inside
    an `opaque` path are not recorded: they run on rows the ranks exchange (an expert-parallel experts
    module's activation runs on the rows its experts received), so no rank's call matches the reference's."""

    def __init__(self, model: nn.Module, opaque: tuple[str, ...] = ()):
        self.outputs: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        self.grads: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        self.slice = 0
        self.order: list[str] = []
        self.grad_order: list[str] = []
        self.active = True
        self.handles = []
        self.stack: list[str] = []
        for path, m in model.named_modules():
            if any(path.startswith(o + ".") for o in opaque):
                continue
            self.handles.append(m.register_forward_pre_hook(self._pre(path)))
            self.handles.append(m.register_forward_hook(self._post(path)))  # not on failure: the stack then names where

    def _pre(self, path):
        def hook(mod, args):
            self.stack.append(path)

        return hook

    def _post(self, path):
        def hook(mod, args, out):
            if self.stack and self.stack[-1] == path:
                self.stack.pop()
            if not self.active:
                return
            t = _first_tensor(out)
            if t is None or not t.is_floating_point():
                return
            if path not in self.outputs:
                self.order.append(path)
            calls = self.outputs.setdefault(path, {})
            call = (self.slice, sum(1 for sl, _ in calls if sl == self.slice))  # backward may visit them in any order
            calls[call] = t.detach().clone()
            if t.requires_grad:
                def grad_hook(g, path=path, call=call):
                    if g is None:  # an output no loss depends on
                        return
                    if path not in self.grads:
                        self.grad_order.append(path)
                    self.grads.setdefault(path, {})[call] = g.detach().clone()

                t.register_hook(grad_hook)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    @staticmethod
    def by_call(table: dict[str, dict[tuple[int, int], torch.Tensor]]) -> dict[str, list[list[torch.Tensor]]]:
        """path -> [call][slice] tensors (calls present in every slice only)."""
        out = {}
        for path, d in table.items():
            slices = sorted({sl for sl, _ in d})
            n_calls = min(sum(1 for sl2, _ in d if sl2 == sl) for sl in slices)
            out[path] = [[d[(sl, c)] for sl in slices if (sl, c) in d] for c in range(n_calls)]
        return out


def _first_tensor(out: Any) -> torch.Tensor | None:
    if torch.is_tensor(out):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for o in out:
            if torch.is_tensor(o):
                return o
    return None


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _RandomDraws(TorchDispatchMode):
    """The ops of a forward that draw random numbers (ATen's ``nondeterministic_seeded`` tag: dropout, the
    ``rand`` family, sampling), each with the module that ran it (`_Recorder.stack`): NOTE [random draws in
    verify]."""

    def __init__(self, rec: "_Recorder") -> None:
        super().__init__()
        self.rec = rec
        self.seen: dict[str, str] = {}  # op -> the first module that drew with it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            self.seen.setdefault(str(func.overloadpacket.__name__), self.rec.stack[-1] if self.rec.stack else "")
        return func(*args, **(kwargs or {}))


def _run_steps(model: nn.Module, slices: list[dict[str, Any]], loss_fn, steps: int, lr: float,
               float_inputs: list[str], dp_scale: float, opaque: tuple[str, ...] = (),
               watch_random: bool = False) -> dict[str, Any]:
    """Forward, backward and `steps` AdamW steps of `model` over `slices` (mean of the slice losses).
    Returns losses, recorded outputs/grads, input grads, parameter grads and parameters after step 1 (the
    modules inside `opaque` paths not recorded: `_Recorder`); with `watch_random`, also the ops of the first
    step's forward that drew random numbers ("random_draws": op -> module; NOTE [random draws in verify])."""
    inner = _unwrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    rec = _Recorder(inner, opaque)
    result: dict[str, Any] = {"losses": []}
    for step in range(steps):
        rec.active = step == 0
        total = None
        input_grads: dict[str, list[torch.Tensor]] = {}
        leaves = []
        for i_slice, sl in enumerate(slices):
            sl = dict(sl)
            rec.stack.clear()
            rec.slice = i_slice
            for k in float_inputs:
                sl[k] = sl[k].detach().clone().requires_grad_(True)
                leaves.append((k, sl[k]))
            try:
                if watch_random and step == 0:
                    with _RandomDraws(rec) as draws:
                        out = model(**sl)
                    result.setdefault("random_draws", {}).update(draws.seen)
                else:
                    out = model(**sl)
            except Exception as exc:
                where = (rec.stack[-1] or "<model>") if rec.stack else "<model>"
                raise VerifyError(f"forward failed in module {where!r}: {type(exc).__name__}: {exc}") from exc
            loss = call_loss(loss_fn, out, "verify") * dp_scale
            total = loss if total is None else total + loss
            t_out = _first_tensor(out)
            if step > 0 and t_out is not None and t_out.is_floating_point():  # step 0: the recorder has it
                result.setdefault("step_outputs", {}).setdefault(step, []).append(t_out.detach().clone())
        rec.active = False  # checkpointed modules run again in backward: not new calls
        total.backward()
        result["losses"].append(float(total.detach()))
        if step == 0:
            result["outputs"] = _Recorder.by_call(rec.outputs)
            result["order"] = list(rec.order)
            result["grads"] = _Recorder.by_call(rec.grads)
            result["grad_order"] = list(rec.grad_order)
            for k, t in leaves:
                input_grads.setdefault(k, []).append(t.grad.detach().clone() if t.grad is not None else None)
            result["input_grads"] = input_grads
        _optimizer_step(opt, dict(inner.named_parameters()), result, first=step == 0, model=model)
    rec.remove()
    return result


def _optimizer_step(opt: torch.optim.Optimizer, named: dict[str, torch.Tensor], result: dict[str, Any], *,
                    first: bool, model: nn.Module) -> None:
    """`opt`'s step (and the forms' work after it on `model`, as every training loop does); on the `first`, the
    gradients before it and the parameters after it (whole tensors) go to `result` ("param_grads", "params") by
    the names of `named`."""
    if first:
        result["param_grads"] = {n: (_full(p.grad).detach().clone() if p.grad is not None else None)
                                 for n, p in named.items()}
    opt.step()
    after_optimizer_step(model)
    if first:
        result["params"] = {n: _full(p).detach().clone() for n, p in named.items()}
    opt.zero_grad(set_to_none=True)


def _run_pipeline_steps(pipe: nn.Module, local: dict[str, Any], steps: int, lr: float) -> dict[str, Any]:
    """`steps` AdamW steps of a pipelined model (`PipelineModel.step`) on this replica's batch. Returns the losses
    and, by the unbuilt model's names, the parameter gradients of step 1 and the parameters after it, for the
    parameters this rank's stages hold. Its modules run inside the stages a micro-batch at a time, so no module
    outputs are recorded."""
    opt = torch.optim.AdamW(pipe.parameters(), lr=lr, weight_decay=0.01)
    named = pipe.canonical_parameters()
    result: dict[str, Any] = {"losses": [], "outputs": {}, "order": [], "grads": {}, "grad_order": [],
                              "input_grads": {}, "pipeline": True}
    for step in range(steps):
        result["losses"].append(pipe.step(**local))
        _optimizer_step(opt, named, result, first=step == 0, model=pipe)
    return result
