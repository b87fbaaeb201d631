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

`measure_by_node(...).saved` is {node name: global bytes saved}; the cost graph divides a node's figure by
its output's shards (node_costs.saved_bytes).

NOTE [ops per node]: the same run counts the ATen ops each node dispatches, forward and backward, because every
dispatched op costs the device's `op_overhead_s` and `treadle.price` charges exactly that (one per recorded op).
A graph node is not one op either way: a composite node (``layer_norm``, ``linear`` with a bias) runs several,
and a backward formula runs its own (a linear's: two matrix products, a transpose, a bias sum; a node with
several consumers adds the engine's gradient sums). Measured on the tests' tiny models, the backward dispatches
2.2-2.8 ops per forward op, where one per node was charged: the planner's step came out 15-50% below the price of
the very plan it returned, mostly this. Forward: the ops dispatched while the node runs. Backward: the loss (the
captured output) is back-propagated on the same fake tensors, and every op is attributed to the node whose
autograd functions are running (each node owns the `grad_fn`s its forward created, found by walking from its
outputs' `grad_fn` to those of earlier nodes); the engine's gradient sums go to the node whose functions ran
last. `measure_by_node` returns both with the saved bytes; when the backward cannot run, the counts are None.

NOTE [bytes per node]: the same run adds up the bytes each node's ops read and write, forward and backward, as
`treadle.price` counts an op's (`recorder.op_bytes`). A node is not one pass over its inputs and outputs: a cross
entropy on a large vocabulary upcasts its logits, writes their log-softmax and reads it again (3x its input
forward); its backward writes two logits-sized gradients (4x). The cost graph scales what it computes from the
node's own tensors by the measured figure over those tensors' bytes (`NodeCosts.traffic`); on Llama-3-8B's head
the loss alone was 3 ms a micro-batch under its price. The backward's ops the engine runs between a node's
functions (its gradient sums: NOTE [gradient sums at a fork] in node_costs.py, and the parameters' accumulation)
are no node's: a post-hook on each function marks when none runs.

NOTE [recompute stops early]: non-reentrant activation checkpointing (what `build` uses) re-runs a block's forward
in backward only until every tensor the block's ops saved has been saved again, then stops: the ops after the
last op that saves anything are not recomputed. In a transformer block that is the output projection's product
(it saves its input) — its all-reduce under tensor parallelism, the dropout-free residual add and what follows
are not run again. The measurement records which nodes' ops save a tensor (`NodeMeasure.packers`), and the cost
graph charges a checkpointed block only up to its last such node (`StrategyCost.rec_s`). The recompute also
detaches every activation it saves again (one more op each: GPT-2's block recomputes 55 ops, 37 of its forward
and 18 detaches; `NodeMeasure.packs` counts 20 activations saved), which the block's host cost charges. Pricing the whole
forward over-charged the demo's plan's recompute by 30% (53 ms against 41 priced).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..profile import fake_gaps
from ..errors import ProfileError
from ..profile.flops import rule_for
from ..profile.recorder import METADATA_QUERIES, _tensors, op_bytes
from .grad_live import BackwardLive, shapes_of, slot

logger = logging.getLogger(__name__)


class _Produced(TorchDispatchMode):
    """Every storage any ATen op returns, attributed to the graph node running (composite nodes such as
    ``layer_norm`` or ``scaled_dot_product_attention`` save tensors they do not return), and every op counted
    to its node (NOTE [ops per node])."""

    def __init__(self, run: "_Run") -> None:
        super().__init__()
        self.run = run

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = fake_gaps.call(func, args, kwargs or {})
        if func not in METADATA_QUERIES:
            self.run.count()
            self.run.add_bytes(func, args, kwargs or {}, out)
        if self.run.backward:  # NOTE [a backward's working set]
            self.run.live.made(out, self.run.bwd_current, self.run.producer, self.run.skip)
        self.run.note(out, None if func in METADATA_QUERIES else func, args, kwargs or {})
        return out


class _Run(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, skip: set[int]) -> None:
        super().__init__(gm)
        self.producer: dict[int, tuple[str, int, int]] = {}  # storage id -> (node name, storage bytes, elements)
        self.skip = skip  # storages of parameters, buffers and inputs
        self.saved: dict[str, int] = {}
        self.packed: set[int] = set()
        self.keep: list[Any] = []  # storages stay alive (ids are not reused) while the run lasts
        self.current: str | None = None
        self.fwd_ops: dict[str, int] = {}
        self.bwd_ops: dict[str, int] = {}
        self.backward = False
        self.grad_fn_owner: dict[Any, str] = {}  # autograd function -> the node whose forward made it
        self.bwd_current: str | None = None
        self.inside = False  # a node's autograd function is running (else the engine: NOTE [bytes per node])
        self.fwd_bytes: dict[str, int] = {}
        self.bwd_bytes: dict[str, int] = {}
        self.packers: set[str] = set()
        self.packs: dict[str, int] = {}  # node -> tensors its ops save (a recompute detaches each once more)
        self.trace: dict[str, list[OpTrace]] = {}  # node -> its forward's ops in order (NOTE [ops a policy keeps])
        # NOTE [a backward's working set]: each node's tensor shapes, its saved bytes by the tensor each is shaped
        # like, and the backward's log
        self.shapes: dict[str, tuple] = {}
        self.packed_of: list[tuple[str, int, int, int]] = []  # (producer, bytes, elements, first packer's order)
        self.order: dict[str, int] = {}  # node -> its place in the forward
        self.live = BackwardLive()

    def count(self) -> None:
        if self.backward:
            if self.bwd_current is not None:
                self.bwd_ops[self.bwd_current] = self.bwd_ops.get(self.bwd_current, 0) + 1
        elif self.current is not None:
            self.fwd_ops[self.current] = self.fwd_ops.get(self.current, 0) + 1

    def add_bytes(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """NOTE [bytes per node]: the bytes an op moves, as the price counts them, to the node running it."""
        if self.backward:
            if not self.inside or self.bwd_current is None:
                return  # the engine's own ops: gradient sums at a fork, parameters' accumulation
            into, name = self.bwd_bytes, self.bwd_current
        elif self.current is not None:
            into, name = self.fwd_bytes, self.current
        else:
            return
        try:
            kind = rule_for(func).kind
        except ProfileError:  # an op the price does not know either: it refuses the schedule, the bytes do not matter
            return
        into[name] = into.get(name, 0) + sum(op_bytes(func, kind, _tensors((args, kwargs)), _tensors(out)))

    def own(self, name: str, out: Any) -> None:
        """Attribute the autograd functions `name`'s forward created (those not owned by an earlier node)."""
        stack = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in self.grad_fn_owner or type(fn).__name__ == "AccumulateGrad":
                continue
            self.grad_fn_owner[fn] = name
            stack.extend(nxt for nxt, _ in fn.next_functions)

    def hook_backward(self) -> None:
        for fn, name in self.grad_fn_owner.items():
            fn.register_prehook(functools.partial(self._enter, name))
            fn.register_hook(self._leave)

    def _enter(self, name: str, grad_outputs: Any) -> None:
        self.bwd_current = name
        self.inside = True

    def _leave(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self.inside = False

    def note(self, out: Any, func: Any = None, args: tuple = (), kwargs: dict | None = None) -> None:
        if self.current is None:
            return
        made: list[tuple[int, int]] = []
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = id(st)
                if key not in self.producer and key not in self.skip:
                    self.producer[key] = (self.current, st.nbytes(), st.nbytes() // max(1, t.element_size()))
                    self.keep.append(st)
                    made.append((key, st.nbytes()))
        if func is not None and not self.backward:
            self.trace.setdefault(self.current, []).append(_op_trace(func, args, kwargs or {}, out, made))

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = n.name if n.op == "call_function" else None
        self.order.setdefault(n.name, len(self.order))
        try:
            out = super().run_node(n)
            if self.current is not None:
                self.own(n.name, out)
                self.shapes[n.name] = shapes_of(n, self.env, out)
            return out
        finally:
            self.current = None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = id(st)
        if self.current is not None and not self.backward:
            self.packers.add(self.current)  # NOTE [recompute stops early]: this node's op saves something
            if key not in self.skip:  # an activation, not a parameter or an input
                self.packs[self.current] = self.packs.get(self.current, 0) + 1
        if key in self.packed:
            return t
        who = self.producer.get(key)
        if who is not None:
            self.packed.add(key)
            self.saved[who[0]] = self.saved.get(who[0], 0) + who[1]
            self.packed_of.append((*who, self.order.get(self.current, 0)))
        return t

    def saved_by_slot(self) -> dict[str, dict[str | None, int]]:
        """Each node's saved bytes by the tensor each storage is shaped like (NOTE [a backward's working set])."""
        like: dict[str, dict[str | None, int]] = {}
        for name, nbytes, numel, _ in self.packed_of:
            d = like.setdefault(name, {})
            s = slot(self.shapes.get(name), numel)
            d[s] = d.get(s, 0) + nbytes
        return like


@dataclass(frozen=True, slots=True)
class OpTrace:
    """One ATen op a node dispatched in forward (NOTE [ops a policy keeps] in `treadle.planner.policies`): its
    op (the OpOverload a checkpoint policy is asked about), the storages it made, (id, bytes) each (none for a view),
    its FLOPs (0 where no rule) and the bytes of its tensor arguments and outputs (its share of the node's time)."""

    func: Any
    made: tuple[tuple[int, int], ...]
    flops: int = 0
    io_bytes: int = 0


def _op_trace(func: Any, args: tuple, kwargs: dict, out: Any, made: list) -> OpTrace:
    from ..errors import ProfileError
    from ..profile.flops import forward_flops

    try:
        flops = forward_flops(func, args, kwargs, out)
    except Exception as exc:  # noqa: BLE001  a refinement: the op's share falls back to its bytes
        if not isinstance(exc, ProfileError):
            logger.debug("saved: FLOPs of %s not counted (%s: %s)", func, type(exc).__name__, exc)
        flops = 0
    io = sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
    return OpTrace(func, tuple(made), flops, io)


@dataclass(frozen=True, slots=True)
class NodeMeasure:
    """Per node name of the captured graph: bytes autograd saves of its storages (NOTE [saved by autograd]), and
    the ATen ops it dispatches forward and backward (NOTE [ops per node]; None when the backward failed)."""

    saved: dict[str, int]
    fwd_ops: dict[str, int]
    bwd_ops: dict[str, int] | None
    packers: frozenset[str] = frozenset()  # nodes whose ops save a tensor for backward (NOTE [recompute stops early])
    packs: dict[str, int] = field(default_factory=dict)  # activations each node's ops save (same NOTE)
    trace: dict[str, list[OpTrace]] = field(default_factory=dict)  # each node's forward ops, in order
    packed: frozenset[int] = frozenset()  # the storages (ids in `trace`) autograd saves
    # NOTE [a backward's working set]: per node, its saved bytes and its backward's working set, each by the tensor
    # its parts are shaped like (None: the output; else an input's node name); the working sets None when the
    # backward failed
    saved_like: dict[str, dict[str | None, int]] = field(default_factory=dict)
    working: dict[str, dict[str | None, int]] | None = None
    fwd_bytes: dict[str, int] = field(default_factory=dict)  # NOTE [bytes per node]; the backward's None when it
    bwd_bytes: dict[str, int] | None = None  # failed


def measure_by_node(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, *, backward: bool = True) -> NodeMeasure:
    """Run `gm` (an exported program's module) forward on fake copies of its parameters and of `args` /
    `kwargs` (the model's inputs, real or fake) and measure per node: the bytes autograd saved of the storages
    the node produced (NOTE [saved by autograd]), the ops it dispatches (NOTE [ops per node]: the forward's, and
    with `backward` the backward's of the loss, the graph's scalar floating outputs summed) and what it saves
    (NOTE [recompute stops early]). Raises whatever the forward raises; a backward that fails is logged and
    gives ``bwd_ops=None``."""
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
        leaves = {id(t): t for t in state.values() if t.requires_grad}.values()
        hooks = [h for t in leaves for h in (t.register_post_accumulate_grad_hook(run.live.hook),
                                             t.register_hook(run.live.incoming))]
        try:
            bwd = _backward(run, out) if backward else None
        finally:
            for h in hooks:
                h.remove()
        del out
    logger.debug("saved by autograd: %d nodes, %d bytes", len(run.saved), sum(run.saved.values()))
    return NodeMeasure(run.saved, run.fwd_ops, bwd, frozenset(run.packers), dict(run.packs), run.trace,
                       frozenset(run.packed), run.saved_by_slot(),
                       run.live.peaks(run.shapes, run.order, run.packed_of) if bwd is not None else None,
                       run.fwd_bytes, run.bwd_bytes if bwd is not None else None)


def _backward(run: _Run, out: Any) -> dict[str, int] | None:
    """Back-propagate the captured loss and return the backward's ops per node (NOTE [ops per node])."""
    loss = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad and t.numel() == 1
            and t.is_floating_point()]
    if not loss:
        return None
    run.hook_backward()
    run.backward = True
    try:
        total = loss[0] if len(loss) == 1 else sum(loss[1:], loss[0])
        total.backward()
    except Exception as exc:  # the counts are a refinement: the forward's measurement stands without them
        logger.warning("capture: counting the backward's ops failed (%s: %s); one op per node assumed",
                       type(exc).__name__, exc)
        return None
    finally:
        run.backward = False
    return run.bwd_ops
