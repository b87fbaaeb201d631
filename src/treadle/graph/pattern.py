r"""Subgraph patterns written as Python functions, matched along data-flow edges of a captured graph.

A pattern is a function such as ``lambda x, bias: F.gelu(x + bias)``; it is captured with `torch.fx` and
its placeholders name the match's inputs. Matching starts at the pattern's outputs and walks *backwards*
over operands, so a diamond, a tree or several outputs match whatever order the ops have in the graph.

Ops are compared in a canonical form (NOTE [canonical ops]): ``F.relu``, ``torch.relu``, ``x.relu()``,
``aten.relu.default`` and an ``nn.ReLU`` leaf are all ``relu``; arguments are bound by name (aten schema or
Python signature, defaults applied), tensors are compared as edges and constants by value (``x * 0.5`` does
not match ``x * 2.0``). A parameter-owning leaf (``nn.Linear``) reads as its functional form with its
parameters as inputs (`ParamRef`), so ``lambda x, w, b: F.linear(x, w, b)`` finds Linear leaves too.

A matched op other than the outputs may have users outside the match (`Match.shared`): rewrites keep that op
in the graph for them, so the outside users keep reading the inner value (computed once more there). A match
whose shared op is random (dropout) is not offered: a second run would draw a different mask. Matches do not
overlap and come in graph order (q, k, v projections come out as q, k, v).

``module_call(path_regex, *args)`` inside a pattern matches a call of any leaf module of the traced graph whose
path (relative to the traced module) fully matches the regular expression, with those arguments, beside
ordinary ops: ``lambda x: F.gelu(module_call(r"fc\d", x))``.
"""

from __future__ import annotations

import inspect
import logging
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..errors import ScheduleError
from ..lazy import load_registrations, qualified_name

logger = logging.getLogger(__name__)
aten = torch.ops.aten


@dataclass(frozen=True)
class ParamRef:
    """A parameter read by a leaf module, bound to a pattern input: `path` relative to the traced module."""

    path: str

    def __str__(self) -> str:
        return f"param:{self.path}"


# ---------------------------------------------------------------------------------------- canonical ops
# NOTE [canonical ops]: one name per operation, whatever form it takes in a graph.
_OPS = ("add", "sub", "mul", "div", "matmul", "mm", "bmm", "addmm", "relu", "gelu", "silu", "tanh", "sigmoid",
        "softmax", "log_softmax", "dropout", "layer_norm", "linear", "transpose", "view", "reshape", "permute",
        "split", "pow", "neg", "exp", "rsqrt", "mean", "sum", "cat", "scaled_dot_product_attention", "t",
        "contiguous", "embedding", "baddbmm", "masked_fill", "where", "clone")
_OPERATOR = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
             operator.matmul: "matmul", operator.neg: "neg", operator.pow: "pow", operator.iadd: "add",
             operator.imul: "mul"}
_ALIASES = {"truediv": "div", "true_divide": "div", "_softmax": "softmax", "native_dropout": "dropout",
            "_unsafe_view": "view"}
_COMMUTATIVE = {"add", "mul"}
_IGNORED_CONSTS = {"inplace", "_stacklevel", "cudnn_enable", "dtype", "alpha", "memory_format"}
_ARG_ALIASES = {"self": "input", "train": "training", "other": "other", "mat1": "input", "mat2": "other"}


def _name_of(op: str) -> str:
    return _ALIASES.get(op, op)


def canonical_op(node: fx.Node) -> str | None:
    """The canonical name of a call_function / call_method node's op (NOTE [canonical ops]); None otherwise."""
    return _canon_target(node)


def _canon_target(node: fx.Node) -> str | None:
    t = node.target
    if node.op == "call_method":
        return _name_of(t)
    if node.op != "call_function":
        return None
    if t in _OPERATOR:
        return _OPERATOR[t]
    if isinstance(t, torch._ops.OpOverload):
        return _name_of(t.overloadpacket.__name__.rstrip("_"))
    if isinstance(t, torch._ops.OpOverloadPacket):
        return _name_of(t.__name__)
    name = getattr(t, "__name__", None)
    mod = getattr(t, "__module__", "") or ""
    if name and (t is getattr(F, name, None) or t is getattr(torch, name, None) or mod.startswith("torch")):
        return _name_of(name.rstrip("_"))
    return None


# module type (or its qualified name: NOTE [registrations on first use]) -> (canonical op, constants from the
# module, parameter names as inputs after the input)
_MODULE_FORMS: dict[type | str, Callable[[nn.Module], tuple[str, dict[str, Any], tuple[str, ...]]]] = {
    nn.ReLU: lambda m: ("relu", {}, ()),
    nn.GELU: lambda m: ("gelu", {"approximate": m.approximate}, ()),
    nn.SiLU: lambda m: ("silu", {}, ()),
    nn.Tanh: lambda m: ("tanh", {}, ()),
    nn.Sigmoid: lambda m: ("sigmoid", {}, ()),
    nn.Softmax: lambda m: ("softmax", {"dim": m.dim}, ()),
    nn.Dropout: lambda m: ("dropout", {"p": float(m.p), "training": m.training}, ()),
    nn.Linear: lambda m: ("linear", {}, ("weight", "bias")),
    nn.LayerNorm: lambda m: ("layer_norm", {"normalized_shape": list(m.normalized_shape), "eps": m.eps},
                             ("weight", "bias")),
}


def register_module_form(module_type: type | str,
                         form: Callable[[nn.Module], tuple[str, dict[str, Any], tuple[str, ...]]]) -> None:
    """Declare that a leaf of `module_type` (a class, or its qualified name: registering imports nothing)
    computes a canonical op: ``form(module) -> (op, constants, parameter names passed as inputs after the
    module's input)``. Model-specific forms live in treadle.models."""
    if module_type in _MODULE_FORMS:
        name = module_type if isinstance(module_type, str) else module_type.__qualname__
        raise ScheduleError(f"a module form for {name} is already registered")
    _MODULE_FORMS[module_type] = form


FormMaker = Callable[[nn.Module], tuple[str, dict[str, Any], tuple[str, ...]]]
# functions module -> form maker or None, asked for a module type without a registered form (NOTE [forms by
# behaviour] in treadle.models.kernels); registered at import, so every process has the same ones
_FORM_PROBES: list[Callable[[nn.Module], FormMaker | None]] = []


def register_form_probe(probe: Callable[[nn.Module], FormMaker | None]) -> None:
    """Add a probe that recognises a leaf's functional form from what it computes (not its class name)."""
    if probe not in _FORM_PROBES:
        _FORM_PROBES.append(probe)


def module_form(mod: nn.Module) -> FormMaker | None:
    """The form maker of a leaf: registered for its exact type, else the first probe that recognises it."""
    load_registrations()
    maker = _MODULE_FORMS.get(type(mod)) or _MODULE_FORMS.get(qualified_name(type(mod)))
    if maker is None:
        for probe in _FORM_PROBES:
            maker = probe(mod)
            if maker is not None:
                break
    return maker


@dataclass
class _Form:
    op: str
    inputs: list[tuple[str, Any]]  # (argument name, fx.Node | ParamRef) in argument order
    consts: dict[str, Any]


def _schema_bind(op: str, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    packet = getattr(aten, op, None)
    if packet is None:
        return None
    for ov_name in ("Tensor", "default", "int", "Scalar", "Tensor_Scalar", "Tensor_Tensor"):
        ov = getattr(packet, ov_name, None) if ov_name in packet.overloads() else None
        if ov is None:
            continue
        bound = _bind_schema(ov, args, kwargs)
        if bound is not None:
            return bound
    return None


def _bind_schema(ov: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    schema = ov._schema
    out: dict[str, Any] = {}
    pos = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(pos):
        return None
    for a, v in zip(pos, args):
        out[a.name] = v
    names = {a.name for a in schema.arguments}
    for k, v in kwargs.items():
        if k not in names and _ARG_ALIASES.get(k) not in names:
            return None
        out[k] = v
    for a in schema.arguments:
        if a.name not in out:
            if a.has_default_value():
                out[a.name] = a.default_value
            else:
                return None
    return out


def _py_bind(fn: Callable, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    try:
        sig = inspect.signature(fn)
        b = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    b.apply_defaults()
    return {k: v for k, v in b.arguments.items() if not k.startswith("_")}


def node_form(node: fx.Node, gm: nn.Module | None) -> _Form | None:
    """The canonical form of a graph node, or None for nodes that are not ops (placeholders, get_attr...)."""
    if node.op == "call_module":
        if gm is None:
            return None
        mod = gm.get_submodule(node.target)
        maker = module_form(mod)
        if maker is None or len(node.args) != 1 or node.kwargs:
            return _Form(f"module:{type(mod).__qualname__}", [(f"arg{i}", a) for i, a in enumerate(node.args)
                                                              if isinstance(a, fx.Node)], {})
        op, consts, pnames = maker(mod)
        inputs = [("input", node.args[0])]
        for p in pnames:
            if getattr(mod, p, None) is not None:
                inputs.append((p, ParamRef(f"{node.target}.{p}")))
            else:
                consts[p] = None
        return _Form(op, inputs, dict(consts))
    op = _canon_target(node)
    if op is None:
        return None
    bound = None
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        bound = _bind_schema(node.target, node.args, node.kwargs)
    elif node.op == "call_function" and node.target not in _OPERATOR and not isinstance(
            node.target, torch._ops.OpOverloadPacket):
        bound = _py_bind(node.target, node.args, node.kwargs)
    if bound is None:
        bound = _schema_bind(op, node.args, node.kwargs)
    if bound is None:  # positional fallback
        bound = {f"arg{i}": a for i, a in enumerate(node.args)} | dict(node.kwargs)
    inputs, consts = [], {}
    for k, v in bound.items():
        k = _ARG_ALIASES.get(k, k)
        if isinstance(v, fx.Node):
            inputs.append((k, v))
        elif isinstance(v, (list, tuple)) and any(isinstance(x, fx.Node) for x in v):
            for i, x in enumerate(v):
                if isinstance(x, fx.Node):
                    inputs.append((f"{k}.{i}", x))
        elif k not in _IGNORED_CONSTS:
            consts[k] = list(v) if isinstance(v, tuple) else v
    return _Form(op, inputs, consts)


def _const_eq(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_const_eq(x, y) for x, y in zip(a, b))
    return a == b


# ---------------------------------------------------------------------------------------- patterns
def module_call(path_regex: str, *args: Any) -> Any:
    """In a pattern: a call of a leaf module whose relative path fully matches `path_regex` (Slapo's
    call_module patterns). Only meaningful inside a pattern function (it records itself while the pattern is
    captured); called directly it is an error."""
    proxies = [a for a in args if isinstance(a, fx.Proxy)]
    if not proxies:
        raise ScheduleError("module_call(...) is a pattern element: use it inside a pattern function for find")
    try:
        re.compile(path_regex)
    except re.error as exc:
        raise ScheduleError(f"module_call: {path_regex!r} is not a regular expression ({exc})") from None
    return proxies[0].tracer.create_proxy("call_function", module_call, (path_regex, *args), {})


_RANDOM_OPS = {"dropout", "rand", "randn", "bernoulli", "rand_like", "randn_like", "randint"}


@dataclass
class Pattern:
    """A captured pattern: its graph, input names (placeholders, in order) and output nodes."""

    fn: Callable
    graph: fx.Graph
    input_names: tuple[str, ...]
    outputs: tuple[fx.Node, ...]

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


def capture_pattern(fn: Callable) -> Pattern:
    """Capture a pattern function with torch.fx. Raises ScheduleError when it cannot be captured (data-dependent
    control flow, Python side effects) or computes nothing."""
    if isinstance(fn, Pattern):
        return fn
    if not callable(fn):
        raise ScheduleError(f"a pattern must be a function of tensors, got {type(fn).__name__}")
    try:
        gm = fx.symbolic_trace(fn)
    except Exception as exc:
        raise ScheduleError(f"pattern {getattr(fn, '__qualname__', fn)!r} cannot be captured by torch.fx "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); write it as straight-line "
                            f"tensor code without branches on tensor values") from exc
    g = gm.graph
    names = tuple(n.target for n in g.nodes if n.op == "placeholder")
    out = next(n for n in g.nodes if n.op == "output").args[0]
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if not outs or not all(isinstance(o, fx.Node) and o.op not in ("placeholder", "get_attr") for o in outs):
        raise ScheduleError(f"pattern {getattr(fn, '__qualname__', fn)!r} computes nothing from its inputs; "
                            f"a pattern must return the result of at least one op")
    for n in g.nodes:
        if n.op == "get_attr":
            raise ScheduleError(f"pattern {getattr(fn, '__qualname__', fn)!r} reads attribute {n.target!r}; "
                                f"pass tensors as pattern arguments instead")
    return Pattern(fn, g, names, outs)


@dataclass
class Match:
    """One occurrence of a pattern in the graph of the traced module at `path`.

    `inputs` maps each pattern argument name to the graph value bound to it (an fx.Node or a `ParamRef`),
    `outputs` are the graph nodes producing the pattern's results (in the pattern's return order), and
    `nodes` every matched op node (graph order)."""

    path: str
    pattern: str
    nodes: tuple[fx.Node, ...]
    inputs: dict[str, Any]
    outputs: tuple[fx.Node, ...]
    shared: tuple[fx.Node, ...] = ()  # matched ops (not outputs) that ops outside the match also read

    def spec(self) -> dict[str, Any]:
        """JSON form (node names), which `replace_match`/`fuse`/`checkpoint_match` record for replay."""
        return {"nodes": [n.name for n in self.nodes],
                "inputs": {k: (str(v) if isinstance(v, ParamRef) else v.name) for k, v in self.inputs.items()},
                "outputs": [n.name for n in self.outputs], "pattern": self.pattern}

    def __repr__(self) -> str:
        ins = ", ".join(f"{k}={v if isinstance(v, ParamRef) else v.name}" for k, v in self.inputs.items())
        return f"Match({self.pattern} at {self.path!r}: ({ins}) -> {[o.name for o in self.outputs]})"


def match_from_spec(path: str, gm: fx.GraphModule, spec: dict[str, Any]) -> Match:
    """Rebuild a Match from its JSON form on a graph captured the same way (replay)."""
    by_name = {n.name: n for n in gm.graph.nodes}

    def get(name: str) -> fx.Node:
        if name not in by_name:
            raise ScheduleError(f"match at {path!r}: graph node {name!r} does not exist (was the module traced "
                                f"differently?)")
        return by_name[name]

    inputs = {k: (ParamRef(v[6:]) if v.startswith("param:") else get(v)) for k, v in spec["inputs"].items()}
    nodes = tuple(get(n) for n in spec["nodes"])
    outputs = tuple(get(n) for n in spec["outputs"])
    return Match(path, spec.get("pattern", "?"), nodes, inputs, outputs, _shared(nodes, outputs))


def _shared(nodes: tuple[fx.Node, ...], outputs: tuple[fx.Node, ...]) -> tuple[fx.Node, ...]:
    inside = set(nodes)
    return tuple(n for n in nodes if n not in outputs and any(u not in inside for u in n.users))


class _Matcher:
    def __init__(self, pat: Pattern, gm: fx.GraphModule):
        self.pat = pat
        self.gm = gm
        self.pforms = {n: node_form(n, None) for n in pat.graph.nodes if n.op in ("call_function", "call_method")}
        self.gforms: dict[fx.Node, _Form | None] = {}
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def gform(self, n: fx.Node) -> _Form | None:
        if n not in self.gforms:
            self.gforms[n] = node_form(n, self.gm)
        return self.gforms[n]

    def match_node(self, p: fx.Node, g: Any, m: dict, bind: dict) -> list[tuple[dict, dict]]:
        """All extensions of (m: pattern op -> graph node, bind: placeholder -> value) mapping p to g."""
        if p.op == "placeholder":
            if p in bind:
                return [(m, bind)] if bind[p] == g else []
            return [(m, {**bind, p: g})]
        if not isinstance(g, fx.Node):
            return []
        if p in m:
            return [(m, bind)] if m[p] is g else []
        if g in m.values():
            return []
        if p.op == "call_function" and p.target is module_call:
            if g.op != "call_module" or g.kwargs or len(g.args) != len(p.args) - 1 \
                    or not re.fullmatch(p.args[0], g.target):
                return []
            states = [({**m, p: g}, bind)]
            for pin, gin in zip(p.args[1:], g.args):
                states = [st for mm, bb in states for st in self.match_node(pin, gin, mm, bb)]
            return states
        pf, gf = self.pforms.get(p), self.gform(g)
        if pf is None or gf is None or pf.op != gf.op or len(pf.inputs) != len(gf.inputs):
            return []
        for k, v in pf.consts.items():
            if k in gf.consts and not _const_eq(v, gf.consts[k]):
                return []
        m = {**m, p: g}
        orders = [list(range(len(pf.inputs)))]
        if pf.op in _COMMUTATIVE and len(pf.inputs) == 2:
            orders.append([1, 0])
        results = []
        for order in orders:
            states = [(m, bind)]
            for i, j in enumerate(order):
                pin, gin = pf.inputs[i][1], gf.inputs[j][1]
                nxt = []
                for mm, bb in states:
                    nxt.extend(self.match_node(pin, gin, mm, bb))
                states = nxt
                if not states:
                    break
            results.extend(states)
        return results

    def valid(self, m: dict) -> bool:
        """Inner values read outside the match stay in the graph for those readers; a random op cannot be
        computed twice with the same result, so such a match is not offered."""
        matched = set(m.values())
        outs = {m[o] for o in self.pat.outputs}
        for p, g in m.items():
            if g in outs or all(u in matched for u in g.users):
                continue
            form = self.gform(g)
            if g.op == "call_module" or (form is not None and form.op in _RANDOM_OPS):
                return False  # a leaf (hooks, state) or a random op must not run twice
        return True

    def find(self) -> list[tuple[dict, dict]]:
        first, rest = self.pat.outputs[0], self.pat.outputs[1:]
        found = []
        for g in self.gm.graph.nodes:
            states = self.match_node(first, g, {}, {})
            for o in rest:
                nxt = []
                for mm, bb in states:
                    for g2 in self.gm.graph.nodes:
                        nxt.extend(self.match_node(o, g2, mm, bb))
                states = nxt
            for mm, bb in states:
                if self.valid(mm):
                    found.append((mm, bb))
                    break
        return found


def find_matches(pattern: Callable | Pattern, gm: fx.GraphModule, *, path: str) -> list[Match]:
    """Non-overlapping matches of `pattern` in `gm`, ordered by the graph position of their first op."""
    pat = capture_pattern(pattern)
    matcher = _Matcher(pat, gm)
    used: set[fx.Node] = set()
    out = []
    cands = sorted(matcher.find(), key=lambda mb: min(matcher.order[g] for g in mb[0].values()))
    for m, bind in cands:
        nodes = set(m.values())
        if nodes & used:
            continue
        used |= nodes
        inputs = {p.target: v for p, v in bind.items()}
        ordered = tuple(sorted(nodes, key=matcher.order.__getitem__))
        outputs = tuple(m[o] for o in pat.outputs)
        out.append(Match(path, pat.name, ordered, {k: inputs[k] for k in pat.input_names if k in inputs},
                         outputs, _shared(ordered, outputs)))
    logger.debug("pattern %s at %r: %d matches", pat.name, path, len(out))
    return out
