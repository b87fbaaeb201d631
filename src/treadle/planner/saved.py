"""What autograd saves, per node of the captured graph: measured, not guessed. Bytes.

NOTE [saved by autograd]: the exported forward graph (`capture`) is run once more on fake tensors, node
by node (a `torch.fx.Interpreter`), with gradients enabled and a ``saved_tensors_hooks`` pack hook — the
same observation `treadle.profile` makes (one source of truth). Every storage an op returns is
attributed to the node whose execution first produced it (any ATen op inside it, e.g. the statistics a
composite ``layer_norm`` keeps) (views share their base's storage, in-place ops reuse
theirs); every storage autograd packs is counted once, on that node. Parameters and user inputs are not
activations and are not counted. The result is exact for the captured shapes: which operand each
backward formula keeps, a same-dtype ``.to`` that returns its input, a ``mul`` whose partner needs no
gradient — all follow from the real autograd formulas.

`saved_bytes_by_node` returns {node name: global bytes saved}; the cost graph divides a node's figure by
its output's shards (node_costs.saved_bytes).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

logger = logging.getLogger(__name__)


class _Produced(TorchDispatchMode):
    """Every storage any ATen op returns, attributed to the graph node running (composite nodes such as
    ``layer_norm`` or ``scaled_dot_product_attention`` save tensors they do not return)."""

    def __init__(self, run: "_Run") -> None:
        super().__init__()
        self.run = run

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.run.note(out)
        return out


class _Run(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, skip: set[int]) -> None:
        super().__init__(gm)
        self.producer: dict[int, tuple[str, int]] = {}  # storage id -> (node name, storage bytes)
        self.skip = skip  # storages of parameters, buffers and inputs
        self.saved: dict[str, int] = {}
        self.packed: set[int] = set()
        self.keep: list[Any] = []  # storages stay alive (ids are not reused) while the run lasts
        self.current: str | None = None

    def note(self, out: Any) -> None:
        if self.current is None:
            return
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = id(st)
                if key not in self.producer and key not in self.skip:
                    self.producer[key] = (self.current, st.nbytes())
                    self.keep.append(st)

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = n.name if n.op == "call_function" else None
        try:
            return super().run_node(n)
        finally:
            self.current = None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = id(st)
        if key in self.packed:
            return t
        who = self.producer.get(key)
        if who is not None:
            self.packed.add(key)
            self.saved[who[0]] = self.saved.get(who[0], 0) + who[1]
        return t


def saved_bytes_by_node(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> dict[str, int]:
    """Run `gm` (an exported program's module) forward on fake copies of its parameters and of `args` /
    `kwargs` (the model's inputs, real or fake) and return {node name: bytes autograd saved of the storages
    that node produced} (NOTE [saved by autograd]). Raises whatever the forward raises."""
    from ..profile.profiler import _fake_inputs, _fake_state

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    state = _fake_state(gm, fake_mode)
    fargs, fkwargs = _fake_inputs(tuple(args), dict(kwargs), fake_mode)
    skip = {id(t.untyped_storage()) for t in state.values()}
    skip |= {id(t.untyped_storage()) for t in tree_leaves((fargs, fkwargs)) if isinstance(t, torch.Tensor)}
    run = _Run(gm, skip)
    with _reparametrize_module(gm, state, tie_weights=True), fake_mode, torch.enable_grad(), \
            _Produced(run), torch.autograd.graph.saved_tensors_hooks(run.pack, lambda t: t):
        out = run.run(*tree_leaves((tuple(fargs), dict(fkwargs))))  # placeholders: the flattened user inputs
        del out
    logger.debug("saved by autograd: %d nodes, %d bytes", len(run.saved), sum(run.saved.values()))
    return run.saved
