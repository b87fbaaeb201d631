"""`profile(model, example_inputs)`: a training step on fake tensors, priced per op and per module.

The step is forward, loss, backward (train=True) or forward only, run under `FakeTensorMode`: shapes, dtypes
and storages without memory or arithmetic, so a 70B model profiles on a laptop. A real model is profiled on
fake copies of its parameters (nothing of it changes); a model built under FakeTensorMode (see
`treadle.models.zoo.named_model(..., fake=True)`) is used as it is. Identical repeated blocks are profiled
once (NOTE [block reuse] in `blocks.py`); how each figure is observed is NOTE [recording] in `recorder.py`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call uses

from ..errors import ProfileError, TreadleError
from ..loss import default_loss  # the one loss convention (re-exported)
from .blocks import expand, find_block_runs, shortened
from .eager_masks import eager_masks
from .hardware import HardwareSpec, hardware_preset
from .memory import OPTIMIZERS, gradient_bytes, optimizer_state_bytes, parameter_bytes
from .records import ModelProfile, ModuleStats, OpRecord
from .recorder import Dispatch, StepRecorder, _tensors

logger = logging.getLogger(__name__)

Progress = Callable[[str, float], None]


def _split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _fake_state(model: nn.Module, fake_mode: FakeTensorMode) -> dict[str, torch.Tensor]:
    """Fresh fake leaves for every parameter and buffer (tied ones stay tied), so gradients land on them."""
    by_id: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        leaf = by_id.get(id(t))
        if leaf is None:
            if isinstance(t, FakeTensor) and t.fake_mode is fake_mode:
                with fake_mode:
                    leaf = t.detach()
            else:
                leaf = fake_mode.from_tensor(t.detach(), static_shapes=True)
            leaf.requires_grad_(isinstance(t, nn.Parameter) and t.requires_grad)
            by_id[id(t)] = leaf
        state[name] = leaf
    return state


def _fake_inputs(args: tuple, kwargs: dict, fake_mode: FakeTensorMode) -> tuple[tuple, dict]:
    def conv(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not (isinstance(x, FakeTensor) and x.fake_mode is fake_mode):
            return fake_mode.from_tensor(x, static_shapes=True)
        return x

    return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}


def fake_step_recorder(model: nn.Module, args: tuple, kwargs: dict, *, fake_mode: FakeTensorMode,
                       hw: HardwareSpec, progress: Progress | None = None):
    """Fake parameters/buffers and inputs of `model` in `fake_mode`, and a StepRecorder that knows their
    storages as pre-existing (param / buffer / input) and each parameter's owning module (first name wins for
    tied parameters). Returns (state, args, kwargs, recorder, named_modules); the caller attaches and runs."""
    state = _fake_state(model, fake_mode)
    args, kwargs = _fake_inputs(args, kwargs, fake_mode)
    pre: dict[int, tuple[torch.UntypedStorage, str]] = {}
    param_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for name, t in state.items():
        pre[id(t.untyped_storage())] = (t.untyped_storage(), "param" if name in param_names else "buffer")
    for t in _tensors((args, kwargs)):
        pre.setdefault(id(t.untyped_storage()), (t.untyped_storage(), "input"))
    named = list(model.named_modules())
    rec = StepRecorder(hardware=hw, preexisting=pre, progress=progress, n_modules=len(named))
    for name, t in state.items():
        rec.leaf_owner.setdefault(id(t), name.rpartition(".")[0])
    return state, args, kwargs, rec, named


def _record(model: nn.Module, args: tuple, kwargs: dict, *, fake_mode: FakeTensorMode, hw: HardwareSpec,
            train: bool, loss_fn: Callable[[Any], torch.Tensor] | None, progress: Progress | None
            ) -> tuple[list[OpRecord], int, int]:
    """Run one step under the recorder; returns (records, live bytes after the step, saved input bytes)."""
    state, args, kwargs, rec, named = fake_step_recorder(model, args, kwargs, fake_mode=fake_mode, hw=hw,
                                                         progress=progress)
    handles = rec.attach(named)
    hooks = torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack) if train else contextlib.nullcontext()
    try:
        # the fake leaves stay in place through backward: a checkpointed module recomputes with them there
        with _reparametrize_module(model, state, tie_weights=True), eager_masks(kwargs), fake_mode, Dispatch(rec), \
                hooks, torch.set_grad_enabled(train):
            out = model(*args, **kwargs)
            if train:
                try:
                    loss = (loss_fn or default_loss)(out)
                except TreadleError as exc:
                    if isinstance(exc, ProfileError):
                        raise
                    raise ProfileError(f"cannot find a loss in the model output: {exc}") from None
                del out  # a training loop keeps the loss, not the outputs (logits), through backward
                if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                    raise ProfileError("the loss does not require grad: no parameter needs a gradient, or loss_fn "
                                       "returned a constant; pass train=False to profile the forward only")
                rec.start_backward()
                loss.backward()
                del loss
            else:
                del out
    except ProfileError:
        raise
    except Exception as exc:  # an op error inside autograd comes back wrapped; report the recorder's own
        if rec.error is not None:
            raise rec.error from exc
        if rec.failed_at is not None:
            op, module, phase = rec.failed_at
            where = f"at op {op} in module {module or '<model>'!r} during {phase}"
        else:
            last = rec.records[-1] if rec.records else None
            where = (f"after op {last.op} in module {last.module or '<model>'!r} during {last.phase}" if last
                     else "before the first op")
        raise ProfileError(f"profiling failed {where}: {type(exc).__name__}: {exc}") from exc
    finally:
        for h in handles:
            h.remove()
    if rec.error is not None:
        raise rec.error
    del state
    return rec.records, rec.live_bytes, rec.saved_input_bytes


@contextlib.contextmanager
def _no_gc() -> Any:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _ancestors(path: str, cache: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    got = cache.get(path)
    if got is None:
        parts = path.split(".") if path else []
        got = ("",) + tuple(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        cache[path] = got
    return got


def _aggregate(prof: ModelProfile, model: nn.Module, *, optimizer: str, master_weights: bool | None) -> None:
    mods = prof.modules
    for path, m in model.named_modules():
        mods[path] = ModuleStats(path=path, type_name=type(m).__name__, depth=path.count(".") + 1 if path else 0)
    cache: dict[str, tuple[str, ...]] = {}
    owner = {id(p): n.rpartition(".")[0] for n, p in model.named_parameters()}  # deduplicated: first owner
    for _, p in model.named_parameters():
        pb, gb = parameter_bytes(p), gradient_bytes(p)
        ob = optimizer_state_bytes(p, optimizer=optimizer, master_weights=master_weights) if prof.train else 0
        gb = gb if prof.train else 0
        for a in _ancestors(owner[id(p)], cache):
            s = mods.get(a)
            if s is not None:
                s.n_params += p.numel()
                s.param_bytes += pb
                s.grad_bytes += gb
                s.optimizer_state_bytes += ob
    # per-module op figures: sum each module's own ops first, then push the sums up the tree
    own: dict[str, list] = {}
    for r in prof.ops:
        acc = own.get(r.module)
        if acc is None:
            acc = own[r.module] = [0, 0, 0, 0, 0, 0, 0.0, 0.0, 0]
        if r.phase == "forward":
            acc[0] += r.flops
            acc[3] += r.saved_bytes
            acc[4] += r.output_bytes
            acc[5] += r.temp_bytes
            acc[6] += r.time_s
        else:
            acc[1 if r.phase == "backward" else 2] += r.flops
            acc[7] += r.time_s
        acc[8] += 1
    for path, acc in own.items():
        for a in _ancestors(path, cache):
            s = mods.get(a)
            if s is None:
                s = mods[a] = ModuleStats(path=a, type_name="?", depth=a.count(".") + 1 if a else 0)
            s.forward_flops += acc[0]
            s.backward_flops += acc[1]
            s.recompute_flops += acc[2]
            s.saved_bytes += acc[3]
            s.output_bytes += acc[4]
            s.temp_bytes += acc[5]
            s.forward_time_s += acc[6]
            s.backward_time_s += acc[7]
            s.n_ops += acc[8]


def _model_dtype(model: nn.Module) -> str:
    counts = Counter()
    for p in model.parameters():
        if p.is_floating_point():
            counts[str(p.dtype).removeprefix("torch.")] += p.numel()
    return counts.most_common(1)[0][0] if counts else "float32"


def profile(model: nn.Module, example_inputs: Any, *, hardware: HardwareSpec | str = "cpu", train: bool = True,
            loss_fn: Callable[[Any], torch.Tensor] | None = None, optimizer: str = "adamw",
            master_weights: bool | None = None, reuse_blocks: bool = True, name: str | None = None,
            progress: Progress | None = None) -> ModelProfile:
    """Profile one training step (forward, loss, backward; or forward only with `train=False`) of `model` on
    `example_inputs` (a tuple of positional arguments, a dict of keyword arguments, or one tensor).

    hardware: a HardwareSpec or a preset name ("h100-sxm", "cpu", ...) used for per-op roofline times and MFU.
    loss_fn: output -> scalar loss; default `treadle.loss.default_loss` (the output's `.loss`, e.g. HF
        models given labels, else the mean square of the first floating output), as verify and train use.
    optimizer / master_weights: optimizer state counted in memory (see `treadle.profile.memory`).
    reuse_blocks: profile identical repeated blocks once (NOTE [block reuse]); totals are identical.
    progress: called as progress(stage, fraction in [0, 1]) while it works.

    Nothing of `model` changes (a real model is profiled on fake copies of its tensors). Raises ProfileError
    naming the op and module for an op without a FLOP rule, a model that fails on fake tensors, a missing loss,
    or an unknown optimizer.
    """
    t0 = time.perf_counter()
    if optimizer not in OPTIMIZERS:
        raise ProfileError(f"unknown optimizer {optimizer!r}; known: {OPTIMIZERS}")
    hw = hardware_preset(hardware) if isinstance(hardware, str) else hardware
    args, kwargs = _split_inputs(example_inputs)
    tensors = [*model.parameters(), *model.buffers(), *_tensors((args, kwargs))]
    modes = {id(t.fake_mode): t.fake_mode for t in tensors if isinstance(t, FakeTensor)}
    # one fake mode for all: reuse it; none, or a fake model given inputs of another mode: a fresh one
    fake_mode = (detect_fake_mode(tensors) if len(modes) == 1 else None) or FakeTensorMode(allow_non_fake_inputs=False)
    report = progress or (lambda stage, frac: None)
    runs = find_block_runs(model) if reuse_blocks else []
    report("blocks", 1.0)
    records: list[OpRecord] | None = None
    if runs:
        with shortened(model, runs):
            short, final_live, saved_in = _record(model, args, kwargs, fake_mode=fake_mode, hw=hw, train=train,
                                                  loss_fn=loss_fn, progress=progress)
        with _no_gc():  # tens of thousands of small records: the cyclic GC would rescan the model each time
            records = expand(short, runs, final_live_bytes=final_live)
        if records is None:
            runs = []
    if records is None:
        records, final_live, saved_in = _record(model, args, kwargs, fake_mode=fake_mode, hw=hw, train=train,
                                                loss_fn=loss_fn, progress=progress)
    report("aggregate", 0.0)
    dtype = _model_dtype(model)
    prof = ModelProfile(model=name or type(model).__name__, hardware=hw, dtype=dtype, train=train,
                        optimizer=optimizer if train else "none", ops=records, modules={},
                        reused_blocks=[r.to_dict() for r in runs])
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            if isinstance(t, nn.Parameter):
                prof.param_bytes += parameter_bytes(t)
            else:
                prof.buffer_bytes += parameter_bytes(t)
    prof.input_bytes = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in _tensors((args, kwargs))}.values())
    prof.saved_input_bytes = saved_in
    with _no_gc():
        _aggregate(prof, model, optimizer=prof.optimizer, master_weights=master_weights)
    root = prof.modules[""]
    prof.grad_bytes, prof.optimizer_state_bytes = root.grad_bytes, root.optimizer_state_bytes
    peak = -1
    for r in records:
        if r.phase == "forward":
            prof.forward_flops += r.flops
            prof.saved_bytes += r.saved_bytes
            prof.forward_time_s += r.time_s
        else:
            if r.phase == "backward":
                prof.backward_flops += r.flops
            else:
                prof.recompute_flops += r.flops
            prof.backward_time_s += r.time_s
        if r.live_after_bytes > peak:
            peak = r.live_after_bytes
            prof.peak_module, prof.peak_op_index, prof.peak_phase = r.module, r.index, r.phase
    prof.activation_peak_bytes = max(peak, 0)
    prof.step_time_s = prof.forward_time_s + prof.backward_time_s
    try:
        prof.mfu = (prof.model_flops / prof.step_time_s / hw.peak_for(dtype)) if prof.step_time_s > 0 else 0.0
    except ProfileError:
        logger.warning("hardware %s has no peak for %s; MFU not computed", hw.name, dtype)
    prof.profile_time_s = time.perf_counter() - t0
    report("done", 1.0)
    logger.info("profiled %s: %d ops, %.3g FLOPs, peak %.3g bytes at %s, in %.2f s", prof.model, len(records),
                prof.total_flops, prof.peak_bytes, prof.peak_module or "<model>", prof.profile_time_s)
    return prof


def model_flops(model: nn.Module, example_inputs: Any, *, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> int:
    """The useful FLOPs of one training step of `model` as written on the whole (global) batch `example_inputs`:
    forward + backward, no recomputation, nothing counted twice that a parallel schedule would replicate. The one
    numerator of every MFU treadle prints (the price's, `treadle.run`'s; the planner's reads the same rules
    off its captured graph): MFU = model_flops / world / step time / peak. FLOP counts do not depend on the
    hardware; nothing of `model` changes."""
    return int(profile(model, example_inputs, hardware="cpu", loss_fn=loss_fn, optimizer="sgd").model_flops)
