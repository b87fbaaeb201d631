"""The graph a capture makes: `TracedModule` (a GraphModule whose forward takes the original module's arguments,
whose leaves are the original child modules) and the opaque ``treadle::leaf_call`` op that keeps a leaf a leaf
during `torch.export` (NOTE [capture] in `capture.py`)."""

from __future__ import annotations

import contextlib
import itertools
import keyword
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from ..errors import ScheduleError

logger = logging.getLogger(__name__)

_CONST_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)


# ------------------------------------------------------------------------------------------ leaf op
_ACTIVE_LEAF_CALLS: dict[int, Callable[[list[torch.Tensor]], list[torch.Tensor]]] = {}
_CALL_IDS = itertools.count()


@torch.library.custom_op("treadle::leaf_call", mutates_args=())
def _leaf_call(tensors: list[torch.Tensor], call_id: int) -> list[torch.Tensor]:
    raise RuntimeError("treadle::leaf_call only exists while a module is being captured")


@_leaf_call.register_fake
def _leaf_call_fake(tensors: list[torch.Tensor], call_id: int) -> list[torch.Tensor]:
    return _ACTIVE_LEAF_CALLS[call_id](tensors)


@dataclass
class _LeafCallRecord:
    """What one leaf call saw at capture: its path, the non-tensor parts of its arguments and outputs."""

    path: str
    in_spec: Any
    in_flat: list[Any]  # constants; _TensorSlot(i) for the i-th tensor input; _Opaque(j) for opaque input j
    out_spec: Any = None
    out_flat: list[Any] = field(default_factory=list)  # constants; _TensorSlot(i) for the i-th tensor output


@dataclass(frozen=True)
class _TensorSlot:
    index: int


@dataclass(frozen=True)
class _Opaque:
    index: int


def _is_const(x: Any) -> bool:
    return isinstance(x, _CONST_TYPES)


# ------------------------------------------------------------------------------------------ traced module
class TracedModule(fx.GraphModule):
    """A captured module: graph over flat tensor inputs plus the original call structure.

    ``forward(*args, **kwargs)`` accepts what the original module accepted: the call is pytree-flattened;
    tensors go to the graph's placeholders, opaque objects to the leaves that take them, and constants
    must equal those seen at capture (else ScheduleError: the graph was specialised on them).
    """

    def __init__(self, root: nn.Module | dict, graph: fx.Graph, *, in_spec: Any, in_kinds: list[Any],
                 out_spec: Any, out_flat: list[Any], method: str, source: str, class_name: str = "TracedModule"):
        super().__init__(root, graph, class_name)
        self._treadle_in_spec = in_spec
        self._treadle_in_kinds = in_kinds  # per flat input: _TensorSlot, _Opaque or the constant
        self._treadle_out_spec = out_spec
        self._treadle_out_flat = out_flat
        self.capture_method = method
        self.source_type = source

    def recompile(self):
        for node in self.graph.nodes:  # a node named `self` would shadow the module inside forward
            if node.name == "self":
                node._rename("self_")
        with _keyword_safe_targets():
            res = super().recompile()
        cls = type(self)
        if cls.forward is not _structured_forward:
            cls._flat_forward = cls.forward
            cls.forward = _structured_forward
        return res

    def __deepcopy__(self, memo):  # keep the structured call across copies
        import copy

        res = super().__deepcopy__(memo)
        for k in ("_treadle_in_spec", "_treadle_in_kinds", "_treadle_out_spec", "_treadle_out_flat",
                  "capture_method", "source_type"):
            res.__dict__[k] = copy.deepcopy(self.__dict__[k], memo)
        return res

    def __reduce__(self):
        raise TypeError("a TracedModule is not picklable; save the schedule (to_json) and replay it instead")


@contextlib.contextmanager
def _keyword_safe_targets():
    """During code generation, spell a sub-module named like a Python keyword (``lambda``, ``class``) as
    ``getattr(self, "lambda")``: torch.fx writes ``self.lambda``, which is a syntax error."""
    import torch.fx.graph as fx_graph

    orig = fx_graph._format_target

    def format_target(base: str, target: str) -> str:
        r = base
        for e in target.split("."):
            r = f'getattr({r}, "{e}")' if not e.isidentifier() or keyword.iskeyword(e) else f"{r}.{e}"
        return r

    fx_graph._format_target = format_target
    try:
        yield
    finally:
        fx_graph._format_target = orig


def _structured_forward(self, *args, **kwargs):
    if self._treadle_in_spec is None:  # fx capture: the graph takes the call as is
        return self._flat_forward(*args, **kwargs)
    flat, spec = pytree.tree_flatten((args, kwargs))
    if spec != self._treadle_in_spec:
        raise ScheduleError(f"traced {self.source_type}: called with a different argument structure than at "
                            f"capture ({spec} vs {self._treadle_in_spec}); retrace with matching example inputs")
    tensors, opaques = [], []
    for x, kind in zip(flat, self._treadle_in_kinds):
        if isinstance(kind, _TensorSlot):
            if not torch.is_tensor(x):
                raise ScheduleError(f"traced {self.source_type}: expected a tensor at input {kind.index}, got "
                                    f"{type(x).__name__}")
            tensors.append(x)
        elif isinstance(kind, _Opaque):
            opaques.append(x)
        elif not (x is kind or x == kind):
            raise ScheduleError(f"traced {self.source_type}: the graph was captured with constant input {kind!r}, "
                                f"called with {x!r}; retrace with matching example inputs")
    outs = self._flat_forward(*tensors, *opaques)
    if self._treadle_out_spec is None:
        return outs
    flat_out = [outs[k.index] if isinstance(k, _TensorSlot) else k for k in self._treadle_out_flat]
    return pytree.tree_unflatten(flat_out, self._treadle_out_spec)


