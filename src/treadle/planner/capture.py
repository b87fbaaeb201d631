"""Capture a model's forward training graph (ATen, `torch.export` non-strict) with module paths, small.

The planner needs, for every op: its ATen target, which earlier nodes feed it, global output shapes and
dtypes, and the module path that ran it (from ``nn_module_stack``). Repeated blocks (the entries of an
``nn.ModuleList`` that have the same structure, e.g. transformer layers) are captured only a few times:
`capture` temporarily shortens each such list to the shortest prefix that holds two instances of every
distinct block structure, exports that, and records how many real blocks each captured instance stands for
(``Block.weight``). The first captured instance of a repeated structure always stands for itself alone, so
an edge priced once per consumer instance counts exactly (NOTE [instance weights] in cost_graph.py).

Blocks whose captured subgraphs hash equal (op kinds, shapes, dtypes, wiring, parameter names relative
to the block) form one *template*: the solver gives them one set of decision variables.

Raises PlanError when export fails, naming the model class and the first line of torch's message.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from ..errors import PlanError
from ..form import forms
from ..loss import default_loss
from ..profile.eager_masks import eager_masks
from ..profile.memory import buffer_bytes
from .grad_live import by_index
from .policy_facts import sac_facts

logger = logging.getLogger(__name__)

# ops that produce no value the planner cares about
_SKIP_TARGETS = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "_assert_async"}


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Global shape and dtype of one tensor value."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(slots=True)
class Node:
    """One value-producing node of the captured graph.

    `kind`: "param" (a parameter of the model; `param` holds its name in the model), "input" (a user input;
    `input_index` its position among the flattened user inputs), "buffer", "const" (a lifted constant),
    or "op" (an ATen call). `inputs` are indices of the nodes whose values the op reads, in argument order
    (lists flattened); `args` are the raw arguments with each node replaced by ``("node", index)``.
    `out` is the output metadata (a tuple for multi-output ops). `module` is the innermost module path
    ("" for the root), relative to the model given to `capture`.
    """

    index: int
    name: str
    kind: str
    target: Any  # an OpOverload, or a string for non-op kinds
    args: tuple
    kwargs: dict
    inputs: tuple[int, ...]
    out: TensorMeta | tuple[TensorMeta | None, ...] | None
    module: str
    param: str | None = None
    input_index: int | None = None
    users: list[int] = field(default_factory=list)
    block: int | None = None  # index into CapturedGraph.blocks
    fake_args: tuple = ()  # args with fake tensors (for FLOP formulas)
    fake_kwargs: dict = field(default_factory=dict)
    fake_out: Any = None

    @property
    def op_name(self) -> str:
        return _op_name(self.target) if self.kind == "op" else self.kind


def _op_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None and hasattr(packet, "__name__"):
        return packet.__name__
    name = getattr(target, "__name__", None)
    if name is None:
        name = str(target)  # (only here: an op's str() costs more than the rest of this function)
    return name.split(".")[0] if packet is not None else name


@dataclass(slots=True)
class Block:
    """One captured instance of a repeated module (e.g. ``model.layers.1``).

    `weight` is the number of real blocks it stands for; `template` is the index of the first captured
    block with the same subgraph hash (itself when it is the first); `members` are real module paths.
    """

    path: str
    nodes: list[int]
    digest: str
    weight: int
    template: int
    members: list[str]


@dataclass(slots=True)
class CapturedGraph:
    """Nodes in topological order, the repeated blocks, and the parameter table (name -> meta)."""

    nodes: list[Node]
    blocks: list[Block]
    params: dict[str, TensorMeta]
    param_modules: dict[str, str]  # parameter name -> owning module path
    model_class: str
    n_real_params: int  # parameter elements of the full model (all blocks)
    outputs: list[int] = field(default_factory=list)  # nodes the model returns
    saved: dict[int, int] | None = None  # node -> bytes autograd saves of its storages (NOTE [saved by autograd])
    saved_error: str = ""  # why `saved` is None (then the cost graph falls back to per-op rules, and says so)
    loss_head: "LossHead | None" = None  # the model's loss went through its `loss_function` (NOTE [loss head])
    buffer_bytes: int = 0  # the model's buffers, all of them (DDP broadcasts them every forward: NOTE [DDP buffers])
    # ATen ops each node dispatches, forward and backward (NOTE [ops per node] in saved.py); None: not measured
    # (the cost graph then charges one op per node each way)
    fwd_ops: dict[int, int] | None = None
    bwd_ops: dict[int, int] | None = None
    # what each parallel form noted of the real model before capture shortened its lists (`Form.capture_facts`;
    # data parallelism: the FSDP2 units build wraps besides the root), by form name
    facts: dict[str, Any] = field(default_factory=dict)
    # nodes whose ops save a tensor for backward (NOTE [recompute stops early] in saved.py); None: not measured
    packers: frozenset[int] | None = None
    packs: dict[int, int] | None = None  # activations each node's ops save (the recompute detaches each again)
    sac: dict[str, dict] | None = None  # per selective policy, per block node: `policies.SacFact` (NOTE [ops a policy keeps])
    saved_like: dict[int, dict[int, int]] | None = None  # `saved` by the input it is shaped like (-1: the output)
    working: dict[int, dict[int, int]] | None = None  # the same of NOTE [a backward's working set] (grad_live.py)
    fwd_bytes: dict[int, int] | None = None  # bytes each node's ops move, forward and backward (NOTE [bytes per
    bwd_bytes: dict[int, int] | None = None  # node] in saved.py); None: not measured

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise PlanError(f"no node named {name!r} in the captured graph")

    def ops(self) -> Iterator[Node]:
        return (n for n in self.nodes if n.kind == "op")

    def first_block_op(self) -> int | None:
        """The first op node inside a repeated block (parameter nodes come first in an export, blocks' too): ops
        before it run before the blocks (embeddings), the others after them (head, loss); None without blocks."""
        return min((n.index for n in self.nodes if n.kind == "op" and n.block is not None), default=None)

    def weight_of(self, index: int) -> int:
        """How many real executions one captured node stands for (1 outside repeated blocks)."""
        b = self.nodes[index].block
        return 1 if b is None else self.blocks[b].weight


# NOTE [loss head]: a Hugging Face model computes its training loss by ``self.loss_function(logits, labels, ...)``
# on the output of its output embedding (``get_output_embeddings()``). When capture sees exactly that call, on
# exactly that tensor, with a loss whose meaning `treadle.runtime.losses.VocabParallelLoss` reproduces (HF's
# causal-LM or masked-LM cross-entropy), the planner may replace the loss by the vocab-parallel one and keep
# the logits sharded over the vocab. A model that computes its loss inline (BERT's masked LM) records nothing.
_VOCAB_LOSSES = {"ForCausalLMLoss": True, "ForMaskedLMLoss": False}  # loss function name -> causal (shifted labels)


@dataclass(frozen=True, slots=True)
class LossHead:
    """The model's loss is `loss` (a cross-entropy, `causal`: labels shifted left) of the output of module
    `head` (its output embedding), called once through the model's ``loss_function`` attribute."""

    head: str
    loss: str
    causal: bool


@contextlib.contextmanager
def _watch_loss(model: nn.Module, found: list) -> Iterator[None]:
    """NOTE [loss head]: during the export, record whether ``model.loss_function`` is called on the output of
    the output embedding; appends a `LossHead` to `found` when it is, exactly once. Restores the model."""
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    lf = getattr(model, "loss_function", None) if isinstance(head, nn.Module) else None
    name = getattr(lf, "__name__", "")
    if lf is None or name not in _VOCAB_LOSSES or getattr(lf, "__module__", "") != "transformers.loss.loss_utils":
        yield
        return
    head_path = next((p for p, m in model.named_modules() if m is head), None)
    outs: list = []
    calls: list[bool] = []

    def record(mod, args, out):
        outs.append(out)

    def watched(logits, labels, *args, **kwargs):
        calls.append(bool(outs) and logits is outs[-1])
        return lf(logits, labels, *args, **kwargs)

    had = "_loss_function" in vars(model)
    old = vars(model).get("_loss_function")
    handle = head.register_forward_hook(record)
    try:
        model.loss_function = watched
    except AttributeError:  # no setter: leave the model alone
        handle.remove()
        yield
        return
    try:
        yield
    finally:
        handle.remove()
        if had:
            model._loss_function = old
        else:
            vars(model).pop("_loss_function", None)
    if head_path is not None and calls == [True] and len(outs) == 1:
        found.append(LossHead(head_path, name, _VOCAB_LOSSES[name]))


# ----------------------------------------------------------------------------- repeated-block reduction
def _structure(mod: nn.Module) -> tuple:
    """Eager signature of a module: class, parameter/buffer names and shapes, children in order."""
    return (type(mod).__name__,
            tuple((n, tuple(p.shape), str(p.dtype)) for n, p in mod.named_parameters(recurse=False)),
            tuple((n, tuple(b.shape)) for n, b in mod.named_buffers(recurse=False)),
            tuple((n, _structure(c)) for n, c in mod.named_children()))


def _repeat_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList | nn.ModuleDict]]:
    """The containers of repeated blocks: every ``nn.ModuleList`` or ``nn.ModuleDict`` (torchtitan keeps its
    layers in one, keyed "0", "1", ...) of >= 3 entries that is not inside an entry of another such container
    (NOTE [only outer stacks are shortened])."""
    # NOTE [only outer stacks are shortened]: shortening a list is exact only when the model runs its entries one
    # after another as a chain. A list inside a block is often not one: StableLM's per-head norms are zipped with
    # the heads, a list of experts is indexed by the router. Those are captured whole; the outer stacks (a
    # decoder's layers, an encoder's and a decoder's blocks) are the chains worth shortening.
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))]
    inner = {name for name, _ in lists for outer, o in lists
             if outer != name and len(o) >= 2 and name.startswith(f"{outer}." if outer else "")}
    return [(name, m) for name, m in lists if len(m) >= 3 and name not in inner]


@contextlib.contextmanager
def _shortened_lists(model: nn.Module, enabled: bool) -> Iterator[dict[str, tuple[int, list[str]]]]:
    """Temporarily shorten repeated ModuleLists / ModuleDicts (to their first entries, keys kept); yields {kept
    entry path: (weight, member paths)}."""
    plan: dict[str, tuple[int, list[str]]] = {}
    restore: list[tuple[nn.Module, str, nn.Module]] = []
    if enabled:
        for name, lst in _repeat_lists(model):
            items = list(lst.named_children()) if isinstance(lst, nn.ModuleDict) else [
                (str(i), m) for i, m in enumerate(lst)]
            keys = [k for k, _ in items]
            sigs = [_structure(m) for _, m in items]
            seen: dict[tuple, list[int]] = {}
            for i, s in enumerate(sigs):
                seen.setdefault(s, []).append(i)
            keep = max(idx[1] if len(idx) > 1 else idx[0] for idx in seen.values()) + 1
            if keep >= len(lst):
                continue
            prefix = f"{name}." if name else ""
            members: dict[int, list[str]] = {i: [f"{prefix}{keys[i]}"] for i in range(keep)}
            for i in range(keep, len(lst)):
                last_same = max(j for j in seen[sigs[i]] if j < keep)
                members[last_same].append(f"{prefix}{keys[i]}")
            for i in range(keep):
                plan[f"{prefix}{keys[i]}"] = (len(members[i]), members[i])
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            restore.append((parent, attr, lst))
            setattr(parent, attr, nn.ModuleDict(items[:keep]) if isinstance(lst, nn.ModuleDict)
                    else nn.ModuleList([m for _, m in items[:keep]]))
            logger.debug("capture: %s shortened from %d to %d blocks", name, len(lst), keep)
    try:
        yield plan
    finally:
        for parent, attr, lst in restore:
            setattr(parent, attr, lst)


class _Returning(nn.Module):
    """Wraps a model so export sees one tensor out: the training loss, by the same convention as profile /
    verify / train (`loss_fn(output)`, default `treadle.loss.default_loss`: ``.loss`` when the model
    returns one, else the mean square of its first floating output)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any], torch.Tensor] | None = None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn or default_loss

    def forward(self, *args, **kwargs):
        return self.loss_fn(self.model(*args, **kwargs))


def _meta(v: Any) -> TensorMeta | tuple | None:
    if isinstance(v, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in v.shape), v.dtype)
    if isinstance(v, (list, tuple)):
        return tuple(_meta(x) if isinstance(x, torch.Tensor) else None for x in v)
    return None


def _export(model: nn.Module, args: tuple, kwargs: dict, loss_fn=None):
    wrapped = _Returning(model, loss_fn)
    try:
        with eager_masks(kwargs):  # NOTE [eager masks]
            return torch.export.export(wrapped, args, kwargs, strict=False)
    except Exception as exc:  # torch raises many types here; we re-raise as PlanError naming the model
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PlanError(f"capture of {type(model).__name__}: torch.export (non-strict) failed: {first}; "
                        f"disable the KV cache (config.use_cache=False) and pass tensors only") from exc


def capture(model: nn.Module, args: tuple, kwargs: dict | None = None, *,
            reduce_repeats: bool = True, loss_fn: Callable[[Any], torch.Tensor] | None = None,
            gpu_attention: bool = False) -> CapturedGraph:
    """Export `model(*args, **kwargs)` and return its forward graph with module paths and blocks.

    `args`/`kwargs` may be real or fake tensors (global shapes). With `reduce_repeats`, each
    ``nn.ModuleList`` of >= 3 entries is captured as its shortest prefix holding two instances of each
    distinct entry structure; `CapturedGraph.blocks` says how many real blocks each instance stands for.
    The captured output is the training loss, `loss_fn(output)` (default: `treadle.loss.default_loss`).
    The model is restored before returning. Raises PlanError when export fails.
    """
    kwargs = dict(kwargs or {})
    n_real_params = sum(p.numel() for p in model.parameters())
    facts = {f.name: x for f in forms() if (x := f.capture_facts(model)) is not None}  # before lists are shortened
    real_param_modules = {}
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            real_param_modules[f"{mname}.{pname}" if mname else pname] = mname
    heads: list[LossHead] = []
    with _shortened_lists(model, reduce_repeats) as block_plan, _watch_loss(model, heads):
        ep = _export(model, tuple(args), kwargs, loss_fn)
    measured, saved_error = _measure_saved(ep, args, kwargs, gpu_attention)
    graph = ep.graph_module.graph
    sig = ep.graph_signature
    param_of = {s.arg.name: s.target for s in sig.input_specs
                if s.kind.name in ("PARAMETER",) and hasattr(s.arg, "name")}
    buffer_of = {s.arg.name: s.target for s in sig.input_specs if s.kind.name == "BUFFER"}
    const_of = {s.arg.name: s.target for s in sig.input_specs if s.kind.name in ("CONSTANT_TENSOR", "CUSTOM_OBJ")}
    user_inputs = [s.arg.name for s in sig.input_specs if s.kind.name == "USER_INPUT" and hasattr(s.arg, "name")]

    def strip(path: str) -> str:  # paths relative to `model`, not the wrapper
        return path[len("model."):] if path.startswith("model.") else ("" if path == "model" else path)

    nodes: list[Node] = []
    index_of: dict[str, int] = {}

    def convert(a: Any, ins: list[int]) -> Any:
        if isinstance(a, torch.fx.Node):
            if a.name not in index_of:
                return None
            ins.append(index_of[a.name])
            return ("node", index_of[a.name])
        if isinstance(a, (list, tuple)):
            return type(a)(convert(x, ins) for x in a)
        return a

    def fake(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return a.meta.get("val")
        if isinstance(a, (list, tuple)):
            return type(a)(fake(x) for x in a)
        return a

    outputs: list[int] = []
    for fx in graph.nodes:
        if fx.op == "output":
            torch.fx.node.map_arg(fx.args, lambda x: outputs.append(index_of[x.name]) if x.name in index_of else None)
            continue
        val = fx.meta.get("val")
        if fx.op == "placeholder":
            name = fx.name
            if name in param_of:
                kind, pname = "param", strip(param_of[name])
            elif name in buffer_of:
                kind, pname = "buffer", strip(buffer_of[name])
            elif name in const_of:
                kind, pname = "const", strip(const_of[name])
            else:
                kind, pname = "input", None
            node = Node(len(nodes), name, kind, kind, (), {}, (), _meta(val),
                        module=real_param_modules.get(pname, "") if pname else "", param=pname,
                        input_index=user_inputs.index(name) if kind == "input" and name in user_inputs else None,
                        fake_out=val)
        elif fx.op == "call_function":
            opname = _op_name(fx.target)
            if opname in _SKIP_TARGETS or val is None and fx.target is not operator.getitem:
                continue
            ins: list[int] = []
            args_c = convert(tuple(fx.args), ins)
            kwargs_c = {k: convert(v, ins) for k, v in fx.kwargs.items()}
            stack = fx.meta.get("nn_module_stack") or {}
            path = strip(list(stack.values())[-1][0]) if stack else ""
            node = Node(len(nodes), fx.name, "op", fx.target, args_c, kwargs_c, tuple(dict.fromkeys(ins)),
                        _meta(val), module=path, fake_args=fake(tuple(fx.args)),
                        fake_kwargs={k: fake(v) for k, v in fx.kwargs.items()}, fake_out=val)
        else:
            raise PlanError(f"capture of {type(model).__name__}: unexpected graph node {fx.op} {fx.name}")
        index_of[fx.name] = node.index
        nodes.append(node)
    for n in nodes:
        for i in n.inputs:
            nodes[i].users.append(n.index)

    params = {n.param: n.out for n in nodes if n.kind == "param" and isinstance(n.out, TensorMeta)}
    param_modules = {p: real_param_modules.get(p, p.rpartition(".")[0]) for p in params}
    blocks = _find_blocks(nodes, block_plan)
    logger.info("captured %s: %d nodes, %d ops, %d block instances in %d templates", type(model).__name__,
                len(nodes), sum(1 for n in nodes if n.kind == "op"), len(blocks),
                len({b.template for b in blocks}))
    saved = fwd_ops = bwd_ops = packers = packs = saved_like = working = fwd_b = bwd_b = None
    if measured is not None:  # (working and the backward's figures: None when the backward failed)
        def idx(d):
            return None if d is None else {index_of[k]: v for k, v in d.items() if k in index_of}

        saved_like, working = by_index(measured.saved_like, index_of), by_index(measured.working, index_of)
        packers = frozenset(index_of[k] for k in measured.packers if k in index_of)
        packs, saved, fwd_ops, bwd_ops = (idx(d) for d in (measured.packs, measured.saved, measured.fwd_ops,
                                                            measured.bwd_ops))
        fwd_b, bwd_b = idx(measured.fwd_bytes), idx(measured.bwd_bytes)
    sac = None if measured is None else sac_facts(nodes, blocks, measured.trace, measured.packed)
    return CapturedGraph(nodes, blocks, params, param_modules, type(model).__name__, n_real_params, outputs,
                         saved, saved_error, heads[0] if heads else None, buffer_bytes(model), fwd_ops, bwd_ops,
                         facts, packers, packs, sac, saved_like, working, fwd_b, bwd_b)


def _measure_saved(ep, args: tuple, kwargs: dict, gpu_attention: bool = False) -> tuple[Any, str]:
    """NOTE [saved by autograd] and NOTE [ops per node] in saved.py: a `saved.NodeMeasure`, or (None, reason)
    when the exported module cannot run again. With `gpu_attention`, attention saves what a GPU's fused kernel
    saves (NOTE [attention as a GPU runs it])."""
    from ..profile.fused_attention import GpuAttention
    from .saved import measure_by_node

    try:
        with GpuAttention() if gpu_attention else contextlib.nullcontext():
            return measure_by_node(ep.module(), tuple(args), kwargs), ""
    except Exception as exc:  # any failure of the re-run: reported in the plan, per-op rules used instead
        logger.warning("capture: measuring saved activations failed (%s: %s); using per-op rules",
                       type(exc).__name__, exc)
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _within(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _find_blocks(nodes: list[Node], block_plan: dict[str, tuple[int, list[str]]]) -> list[Block]:
    """Assign op nodes (and parameters) to captured block instances; hash each instance's subgraph."""
    blocks: list[Block] = []
    for path, (weight, members) in sorted(block_plan.items(), key=lambda kv: _path_key(kv[0])):
        idx = [n.index for n in nodes if n.kind in ("op", "param") and _within(n.module, path)]
        if not idx:
            continue
        blocks.append(Block(path, idx, _digest(nodes, idx, path), weight, -1, members))
    by_digest: dict[str, int] = {}
    for bi, b in enumerate(blocks):
        b.template = by_digest.setdefault(b.digest, bi)
        for i in b.nodes:
            nodes[i].block = bi
    return blocks


def _path_key(path: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in path.split("."))


def _digest(nodes: list[Node], idx: list[int], path: str) -> str:
    """Hash of a block's subgraph: ops, shapes, dtypes, wiring (relative), parameter names (relative)."""
    local = {i: k for k, i in enumerate(idx)}
    h = hashlib.sha1()
    for i in idx:
        n = nodes[i]
        rel_inputs = tuple(("in", local[j]) if j in local else ("out", nodes[j].kind) for j in n.inputs)
        rel_param = n.param[len(path):] if n.param and n.param.startswith(path) else n.param
        h.update(repr((n.kind, n.op_name, str(n.target), n.out, rel_inputs, rel_param,
                       n.module[len(path):], _scalars(n.args))).encode())
    return h.hexdigest()[:16]


def _scalars(args: Any) -> Any:
    if isinstance(args, (list, tuple)):
        return tuple(_scalars(a) for a in args if not (isinstance(a, tuple) and len(a) == 2 and a[0] == "node"))
    return args if isinstance(args, (int, float, bool, str, type(None))) else type(args).__name__
