"""Record one training step on fake tensors: every ATen op with its module, FLOPs, bytes, saved bytes and the
live-memory timeline.

How each figure is observed (NOTE [recording]):
- Ops: a `TorchDispatchMode` below autograd sees every ATen op, forward and backward, with the tensors it ran
  on (fake ones: shapes, dtypes and storages, no data).
- Module of a forward op: forward pre/post hooks keep a stack of module paths; the top owns the op.
- Module of a backward op: the hooks also note the autograd sequence number at which each module began and
  ended, so every autograd node created in the forward maps to the innermost module that created it; in
  backward, `torch._C._current_autograd_node()` names the node whose backward is running. Ops of a
  checkpointed module recomputed during backward re-enter the forward hooks and count as "recompute".
  Gradient accumulation into a parameter (AccumulateGrad) belongs to the module owning the parameter.
- Memory: a storage is allocated when an op returns a tensor on a storage not seen before (views and in-place
  ops reuse theirs); it is freed when the storage object dies (a weak reference callback). Live bytes are the
  sum of tracked storages; parameters, buffers and inputs exist before the step and are not tracked.
- Saved for backward: a `saved_tensors_hooks` pack hook sees each tensor autograd saves; its storage is
  charged once, to the op that produced it (inputs and buffers apart; parameters are not activations).
  Inside `torch.utils.checkpoint` the checkpoint's own hooks take over, so what it does not save is not charged.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..errors import ProfileError
from . import fake_gaps
from .flops import backward_flops, forward_flops, rule_for
from .hardware import HardwareSpec
from .records import OpRecord
from .roofline import op_time_s

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
# factories that allocate without writing (a caching allocator hands out a block; no kernel runs)
_UNINITIALISED = {_aten.empty, _aten.empty_strided, _aten.empty_like, _aten.new_empty, _aten.new_empty_strided}
_seq_nr = torch._C._autograd._get_sequence_nr  # next autograd sequence number on this thread
_NO_SEQ = 2**63  # "no forward end yet"


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


# NOTE [float8 in the price]: torchao's float8 training tensors (and any tensor subclass whose inner tensors are
# float8) report their original dtype, so a product on them reaches this mode as `aten.mm` on, say, bfloat16
# operands; the subclass runs `torch._scaled_mm` on the float8 data below the mode. Such a product is priced as
# the device runs it: at the hardware's float8 peak ("float8_e4m3fn"; a CPU emulates it at its fp32 rate), reading
# one byte an element. The casts and amax reductions that make the float8 operands are ops of their own, recorded
# as they run.
_FLOAT8 = frozenset(d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                                   "float8_e5m2fnuz")) if d is not None)


def _float8_data(t: torch.Tensor) -> torch.Tensor | None:
    """The float8 tensor inside a tensor subclass (`__tensor_flatten__`), or None."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None or type(t) is torch.Tensor:
        return None
    try:
        names, _ = t.__tensor_flatten__()
    except Exception:  # noqa: BLE001 - a subclass that cannot flatten here holds no float8 data we can see
        return None
    for n in names:
        inner = getattr(t, n, None)
        if isinstance(inner, torch.Tensor) and inner.dtype in _FLOAT8:
            return inner
    return None


def _logical_bytes(t: torch.Tensor) -> int:
    inner = _float8_data(t)
    if inner is not None:
        return inner.numel() * inner.element_size()
    try:
        return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse): logical size
        return t.numel() * t.element_size()


def op_bytes(func: Any, kind: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> tuple[int, int]:
    """(read, written) bytes of one op of rule `kind` as the price charges them: a view moves none; a factory
    reads none; an uninitialised allocation writes none; else its tensor inputs' logical bytes and its outputs'."""
    if kind == "view":
        return 0, 0
    read = 0 if kind == "factory" else sum(_logical_bytes(t) for t in ins)
    uninit = getattr(func, "_overloadpacket", None) in _UNINITIALISED  # they only allocate: no bytes moved
    return read, 0 if uninit else sum(t.numel() * t.element_size() for t in outs)


class StepRecorder:
    """State of one recorded step; `Dispatch` and the hooks below write into it (see NOTE [recording])."""

    def __init__(self, *, hardware: HardwareSpec, preexisting: dict[int, tuple[torch.UntypedStorage, str]],
                 progress: Callable[[str, float], None] | None = None, n_modules: int = 1) -> None:
        self.hw = hardware
        self.records: list[OpRecord] = []
        self.live_bytes = 0
        self.alive: dict[int, tuple[int, int, weakref.ref]] = {}  # storage id -> (nbytes, record index, ref)
        self.preexisting = preexisting  # storage id -> (storage, "param" | "buffer" | "input")
        self.saved: set[int] = set()
        self.saved_input_bytes = 0
        self.stack: list[str] = []
        self.seq_starts: list[int] = [0]
        self.seq_paths: list[str] = [""]
        self.phase = "forward"
        self.in_backward = False
        self.forward_end_seq = _NO_SEQ
        self.error: ProfileError | None = None
        self.paused = False
        self.progress = progress
        self.n_modules = max(n_modules, 1)
        self.modules_done = 0
        self.forward_ops = 0
        self._names: dict[Any, str] = {}
        self.leaf_owner: dict[int, str] = {}  # id of a parameter leaf -> path of the module owning it
        self.failed_at: tuple[str, str, str] | None = None  # (op, module, phase) of an op that raised
        # per record, when a caller sets a list here: ((storage identity, bytes) read, (identity, bytes) written),
        # an identity being (storage id, index of the record that allocated it; -1 before the step): the data
        # flow between ops that a compiled step's fusion groups need (`treadle.pricing.compiled`)
        self.flows: list[tuple[tuple, tuple]] | None = None
        # per free, when a caller sets a list here: (records before it, index of the record that allocated the
        # storage, bytes): where each storage's life ends (`treadle.pricing.reuse` checks its splices with it)
        self.frees: list[tuple[int, int, int]] | None = None

    # ------------------------------------------------------------------------------------------ module tracking
    def _boundary(self, path: str) -> None:
        seq = _seq_nr()
        if self.seq_starts[-1] == seq:
            self.seq_paths[-1] = path
        else:
            self.seq_starts.append(seq)
            self.seq_paths.append(path)

    def pre_hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.stack.append(path)
            self._boundary(path)
        return hook

    def post_hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.stack and self.stack[-1] == path:
                self.stack.pop()
            self._boundary(self.stack[-1] if self.stack else "")
            if not self.in_backward and self.progress is not None:
                self.modules_done += 1
                if self.modules_done % 16 == 0:
                    self.progress("forward", min(self.modules_done / self.n_modules, 1.0))
        return hook

    def attach(self, named_modules: list[tuple[str, nn.Module]]) -> list[Any]:
        handles = []
        for path, mod in named_modules:
            handles.append(mod.register_forward_pre_hook(self.pre_hook(path)))
            handles.append(mod.register_forward_hook(self.post_hook(path), always_call=True))
        return handles

    def where(self) -> tuple[str, str]:
        """(module path, phase) of the op about to run."""
        if not self.in_backward:
            return (self.stack[-1] if self.stack else ""), "forward"
        if self.stack:
            return self.stack[-1], "recompute"
        node = torch._C._current_autograd_node()
        if node is None:
            return "", "backward"
        var = getattr(node, "variable", None)
        if var is not None:  # AccumulateGrad: the module that owns the parameter
            return self.leaf_owner.get(id(var), ""), "backward"
        # nodes made during a recompute (seq past the forward's end) are in the same seq-ordered table
        return self.seq_paths[bisect.bisect_right(self.seq_starts, node._sequence_nr()) - 1], "backward"

    def start_backward(self) -> None:
        self.forward_end_seq = _seq_nr()
        self.in_backward = True
        self.phase = "backward"
        self.forward_ops = len(self.records)

    # ------------------------------------------------------------------------------------------ memory
    def _free(self, key: int) -> None:
        entry = self.alive.pop(key, None)
        if entry is None:
            return
        nbytes, index, _ = entry
        if self.frees is not None:
            self.frees.append((len(self.records), index, nbytes))
        self.live_bytes -= nbytes
        self.saved.discard(key)
        if not self.in_backward:
            self.records[index].temp_bytes += nbytes

    def _track(self, t: torch.Tensor, rec: OpRecord) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self.alive or key in self.preexisting:
            return
        nbytes = st.nbytes()
        self.alive[key] = (nbytes, rec.index, weakref.ref(st, lambda _r, k=key: self._free(k)))
        self.live_bytes += nbytes
        rec.output_bytes += nbytes

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.paused or not isinstance(t, torch.Tensor):
            return t
        st = t.untyped_storage()
        key = id(st)
        if key in self.saved:
            return t
        entry = self.alive.get(key)
        if entry is not None:
            self.saved.add(key)
            self.records[entry[1]].saved_bytes += entry[0]
        else:
            pre = self.preexisting.get(key)
            if pre is not None and pre[1] != "param":
                self.saved.add(key)
                self.saved_input_bytes += st.nbytes()
        return t

    def _ident(self, t: torch.Tensor, *, logical: bool) -> tuple[tuple[int, int], int]:
        try:
            key = id(t.untyped_storage())
        except (RuntimeError, NotImplementedError):  # no storage: an identity of its own
            return (id(t), -2), t.numel() * t.element_size()
        entry = self.alive.get(key)
        nbytes = _logical_bytes(t) if logical else t.numel() * t.element_size()
        return (key, entry[1] if entry is not None else -1), nbytes

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    # ------------------------------------------------------------------------------------------ ops
    def op_name(self, func: Any) -> str:
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = str(func)
        return name

    def record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        module, phase = self.where()
        try:
            rule = rule_for(func)
        except ProfileError as exc:
            err = ProfileError(f"{exc}; met in module {module or '<model>'!r} during {phase}")
            self.error = self.error or err
            raise err from None
        live_before = self.live_bytes
        try:
            out = fake_gaps.call(func, args, kwargs)
        except Exception:
            self.failed_at = (self.op_name(func), module, phase)
            raise
        ins = _tensors((args, kwargs))
        outs = _tensors(out)
        first = next((t for t in ins + outs if t.is_floating_point()), None)
        if first is None:
            first = next(iter(outs or ins), None)
        dtype = str(first.dtype).removeprefix("torch.") if first is not None else "float32"
        mats = [t for t in ins if t.dim() >= 2]
        if rule.kind == "matmul" and mats and all(_float8_data(t) is not None for t in mats):
            dtype = "float8_e4m3fn"  # NOTE [float8 in the price]
        rec = OpRecord(len(self.records), self.op_name(func), rule.kind, module, phase, dtype)
        rec.live_before_bytes = live_before
        self.records.append(rec)
        if rule.kind in ("matmul", "attention", "conv"):
            try:
                rec.flops = forward_flops(func, args, kwargs, out)
                if phase == "forward":
                    needs = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
                    if any(needs):
                        rec.backward_flops = backward_flops(func, args, kwargs, out, needs_input_grad=needs)
            except ProfileError as exc:
                err = ProfileError(f"{exc}; met in module {module or '<model>'!r} during {phase}")
                self.error = self.error or err
                raise err from None
        rec.read_bytes, rec.write_bytes = op_bytes(func, rule.kind, ins, outs)
        for t in outs:
            self._track(t, rec)
        if self.flows is not None:
            self.flows.append((tuple(self._ident(t, logical=True) for t in ins),
                               tuple(self._ident(t, logical=False) for t in outs) if rule.kind != "view" else ()))
        rec.live_after_bytes = self.live_bytes
        try:
            rec.time_s = op_time_s(rec.flops, rec.read_bytes + rec.write_bytes, self.hw, rec.dtype, kind=rule.kind,
                                   op=func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else None,
                                   elems=sum(t.numel() for t in outs))
        except ProfileError as exc:
            if rec.dtype == "float8_e4m3fn":  # NOTE [float8 in the price]
                exc = ProfileError(f"a float8 product needs a device with a float8 matrix unit (sm_89 and later); "
                                   f"{exc}")
            err = ProfileError(f"{exc}; met at op {rec.op} in module {module or '<model>'!r}")
            self.error = self.error or err
            raise err from None
        if self.in_backward and self.progress is not None and len(self.records) % 256 == 0:
            done = (len(self.records) - self.forward_ops) / max(2 * self.forward_ops, 1)
            self.progress("backward", min(done, 0.99))
        return out


# Fake tensors answer `.device`/`.layout` through the dispatcher; real tensors do not. Not ops of the model.
# not ops a device runs: never recorded (nor counted by the planner's capture, NOTE [ops per node])
METADATA_QUERIES = frozenset({torch.ops.prim.device.default, torch.ops.prim.layout.default})


class Dispatch(TorchDispatchMode):
    """Hands every ATen op to a StepRecorder (unless it is paused)."""

    def __init__(self, recorder: StepRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.recorder.paused or func in METADATA_QUERIES:
            return func(*args, **kwargs)
        return self.recorder.record(func, args, kwargs)
