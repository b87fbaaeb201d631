"""Rewrites of a captured graph: replace a match, decompose a leaf, fuse or checkpoint a region.

Every rewrite validates first and mutates after, so a rejected rewrite leaves the graph unchanged. Matched
ops are erased only after their results have been re-pointed to the replacement; the graph is then put back
in topological order and recompiled. Replacements must be module-level (classes or functions) so that a
schedule that uses them can be saved and replayed.
"""

from __future__ import annotations

import inspect
import logging
import operator
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..errors import ScheduleError
from ..lazy import load_registrations, qualified_name
from .pattern import Match, ParamRef

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ helpers
def _toposort(graph: fx.Graph) -> None:
    """Reorder nodes so every node follows its inputs, keeping the existing order where it is valid."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(n: fx.Node) -> None:
        stack = [(n, False)]
        while stack:
            node, done = stack.pop()
            if node in seen:
                continue
            if done:
                seen.add(node)
                order.append(node)
                continue
            stack.append((node, True))
            for inp in reversed(node.all_input_nodes):
                if inp not in seen:
                    stack.append((inp, False))

    for n in list(graph.nodes):
        visit(n)
    prev = order[0]
    for n in order[1:]:
        if prev.next is not n:
            prev.append(n)
        prev = n


def _unique_name(gm: nn.Module, base: str) -> str:
    i = 0
    while hasattr(gm, f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


def _value(gm: fx.GraphModule, v: Any, before: fx.Node) -> Any:
    if isinstance(v, ParamRef):
        with gm.graph.inserting_before(before):
            return gm.graph.get_attr(v.path)
    return v


def _check_region(match: Match) -> None:
    """The match still belongs to the graph. Inner values read outside the match (`Match.shared`) are allowed:
    `_install` erases only ops nobody reads any more, so those readers keep their value."""
    for n in match.nodes:
        if n.graph is not match.outputs[0].graph:
            raise ScheduleError(f"match at {match.path!r} belongs to a graph that was since rewritten; find again")


def _install(gm: fx.GraphModule, match: Match, make_node: Callable[[fx.Node], fx.Node]) -> fx.Node:
    """Insert the node `make_node` builds after the match's last op, re-point the outputs, erase the match."""
    last = match.nodes[-1]
    with gm.graph.inserting_after(last):
        new = make_node(last)
    outs = match.outputs
    if len(outs) == 1:
        outs[0].replace_all_uses_with(new)
    else:
        for i, o in reversed(list(enumerate(outs))):  # getitem 0, 1, ... right after the call
            with gm.graph.inserting_after(new):
                gi = gm.graph.call_function(operator.getitem, (new, i))
            o.replace_all_uses_with(gi)
    for n in reversed(match.nodes):
        if not n.users:
            gm.graph.erase_node(n)
    _toposort(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return new


# ------------------------------------------------------------------------------------------ replace
def check_binding(new: Callable, match: Match) -> inspect.Signature:
    """Bind the replacement's parameters to the match's inputs by name. Raises ScheduleError (and changes
    nothing) when a required parameter has no input of that name or an input would be dropped."""
    fn = new.forward if isinstance(new, nn.Module) else new
    what = type(new).__qualname__ if isinstance(new, nn.Module) else getattr(new, "__qualname__", repr(new))
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ScheduleError(f"replace at {match.path!r}: cannot read the signature of {what}: {exc}") from None
    params = sig.parameters
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    named = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    required = {n for n, p in params.items() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    missing = sorted(required - set(match.inputs))
    unused = sorted(set(match.inputs) - named) if not var_kw else []
    if missing or unused:
        parts = []
        if missing:
            parts.append(f"parameters {missing} have no match input of that name")
        if unused:
            parts.append(f"match inputs {unused} would be dropped")
        raise ScheduleError(f"replace at {match.path!r}: {what}{sig} cannot bind the match inputs "
                            f"{list(match.inputs)}: {'; '.join(parts)}; rename the parameters to the pattern's "
                            f"argument names")
    return sig


def replace_match(gm: fx.GraphModule, match: Match, new: nn.Module | Callable, *,
                  pre_hooks: dict[str, tuple[nn.Module, list]] | None = None,
                  post_hooks: dict[int, tuple[nn.Module, list, str]] | None = None,
                  takeover: set[str] = frozenset()) -> str | None:
    """Put `new` (module or function) in place of `match`, calling it with the match inputs by name.
    A module becomes a child of `gm`; returns its attribute name (None for a function).

    `pre_hooks` {match input: (leaf, forward pre-hooks)} run on that input before the replacement;
    `post_hooks` {output index: (leaf, forward hooks, match input)} run on that output, with that input as the
    hooks' ``args`` (after its pre-hooks), as they ran around the removed leaf (`LeafHooks`).
    `takeover`: parameters of removed leaves (targets such as ``fc1.weight``) whose reads go to the
    replacement's parameter of the same name."""
    _check_region(match)
    check_binding(new, match)
    pre_hooks, post_hooks = pre_hooks or {}, post_hooks or {}
    name = None
    if isinstance(new, nn.Module):
        name = _unique_name(gm, "replaced")
        gm.add_submodule(name, new)
    hooked: dict[str, fx.Node] = {}

    def hooks_module(leaf: nn.Module, pre: list, post: list) -> str:
        attr = _unique_name(gm, "leaf_hooks")
        gm.add_submodule(attr, LeafHooks(leaf, pre, post))
        return attr

    def make(last: fx.Node) -> fx.Node:
        kwargs = {k: _value(gm, v, last.next) for k, v in match.inputs.items()}
        for k, (leaf, hooks) in pre_hooks.items():
            kwargs[k] = hooked[k] = gm.graph.call_module(hooks_module(leaf, hooks, []), (kwargs[k],))
        if name is not None:
            return gm.graph.call_module(name, (), kwargs)
        return gm.graph.call_function(new, (), kwargs)

    leaves = {n.target for n in match.nodes if n.op == "call_module"}
    out = _install(gm, match, make)
    if name is not None:
        _retarget_owned(gm, leaves, name, takeover)
    _drop_unused_leaves(gm, leaves)
    if post_hooks:
        outs = [out] if len(match.outputs) == 1 else sorted((u for u in out.users if u.target is operator.getitem),
                                                            key=lambda u: u.args[1])
        for i, (leaf, hooks, in_name) in post_hooks.items():
            y = outs[i]
            x = hooked.get(in_name, match.inputs[in_name])
            users = list(y.users)
            with gm.graph.inserting_after(y):
                h = gm.graph.call_module(hooks_module(leaf, [], hooks), (x, y))
            for u in users:
                u.replace_input_with(y, h)
        _toposort(gm.graph)
        gm.graph.lint()
        gm.recompile()
    return name


def _retarget_owned(gm: fx.GraphModule, targets: set[str], name: str, takeover: set[str]) -> None:
    """Reads (get_attr) of a removed leaf that the replacement `name` now owns go through the replacement, so
    the leaf keeps one path in the model; reads of a removed leaf's parameter in `takeover` go to the
    replacement's parameter of the same name (relative to this module) and shape."""
    new = gm.get_submodule(name)
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    for t in targets - called:
        leaf = gm.get_submodule(t)
        rel = next((q for q, sub in new.named_modules() if sub is leaf), None)
        own = dict(new.named_parameters())
        for n in gm.graph.nodes:
            if n.op != "get_attr" or not n.target.startswith(t + "."):
                continue
            if rel is not None:
                n.target = f"{name}.{rel}{n.target[len(t):]}" if rel else f"{name}{n.target[len(t):]}"
            elif n.target in takeover and n.target in own and own[n.target].shape == _attr(gm, n.target).shape:
                n.target = f"{name}.{n.target}"  # the replacement takes the parameter over by name
    gm.recompile()


def _attr(gm: nn.Module, target: str) -> Any:
    parent, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(parent) if parent else gm, name)


def _drop_unused_leaves(gm: fx.GraphModule, targets: set[str]) -> None:
    """Remove the leaf modules in `targets` that no node calls or reads any more, so a leaf the replacement
    now owns has one path (its new one) and a removed one leaves no parameters behind."""
    used = set()
    for n in gm.graph.nodes:
        if n.op in ("call_module", "get_attr"):
            parts = n.target.split(".")
            used.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for t in sorted(targets - used):
        parent, _, name = t.rpartition(".")
        delattr(gm.get_submodule(parent) if parent else gm, name)


# ------------------------------------------------------------------------------------------ regions
def extract_region(gm: fx.GraphModule, match: Match) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The matched ops as a GraphModule of their own over the external values they read (in first-use
    order); parameters read through get_attr and leaf modules come along by reference."""
    _check_region(match)
    nodes = set(match.nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    ext: list[fx.Node] = []
    for n in match.nodes:
        for inp in n.all_input_nodes:
            if inp in nodes or inp in env:
                continue
            if inp.op == "get_attr":
                env[inp] = g.get_attr(inp.target)
            else:
                ext.append(inp)
                env[inp] = g.placeholder(f"in_{len(ext) - 1}_{inp.name}")
    for n in match.nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
    outs = [env[o] for o in match.outputs]
    g.output(outs[0] if len(outs) == 1 else tuple(outs))
    region = fx.GraphModule(gm, g, "Region")
    return region, ext


_FUNCTIONS: dict[str, Callable] = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh,
                                    "sigmoid": torch.sigmoid, "softmax": F.softmax, "dropout": F.dropout,
                                    "linear": F.linear, "layer_norm": F.layer_norm, "rms_norm": F.rms_norm}


def inline_leaf_forms(region: fx.GraphModule) -> int:
    """Replace leaf calls whose module has a functional form (activations, dropout, Linear, LayerNorm and the
    forms registered by treadle.models) by that function, so a compiled region holds plain ops and no module
    hooks. A dropout's training flag is taken as it is now. Returns how many leaves were inlined."""
    from .pattern import module_form

    n_done = 0
    for node in list(region.graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        mod = region.get_submodule(node.target)
        maker = module_form(mod)
        if maker is None:
            continue
        op, consts, pnames = maker(mod)
        fn = _FUNCTIONS.get(op)
        if fn is None:
            continue
        kwargs = dict(consts)
        with region.graph.inserting_before(node):
            for p in pnames:
                kwargs[p] = region.graph.get_attr(f"{node.target}.{p}") if getattr(mod, p, None) is not None else None
            new = region.graph.call_function(fn, (node.args[0],), kwargs)
        node.replace_all_uses_with(new)
        region.graph.erase_node(node)
        n_done += 1
    if n_done:
        region.graph.lint()
        region.recompile()
    return n_done


class FusedRegion(nn.Module):
    """A matched region compiled with `torch.compile(backend=compiler)` on first call (fullgraph)."""

    def __init__(self, region: fx.GraphModule, compiler: str):
        super().__init__()
        self.region = region
        self.compiler = compiler
        self._compiled: Any = None

    def forward(self, *args):
        if self._compiled is None:
            # compile the forward, not the module: module hooks (the region's own) stay outside the graph
            object.__setattr__(self, "_compiled", torch.compile(self.region.forward, backend=self.compiler,
                                                                fullgraph=True))
        return self._compiled(*args)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_compiled"] = None
        return state

    def __deepcopy__(self, memo):
        import copy

        out = FusedRegion(copy.deepcopy(self.region, memo), self.compiler)
        out.train(self.training)
        return out


class CheckpointRegion(nn.Module):
    """A matched region recomputed in backward (non-reentrant `torch.utils.checkpoint`)."""

    def __init__(self, region: fx.GraphModule):
        super().__init__()
        self.region = region

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.region, *args, use_reentrant=False)


def available_compilers() -> list[str]:
    import torch._dynamo

    return sorted(set(torch._dynamo.list_backends(exclude_tags=())) | {"inductor"})


def check_compiler(compiler: str, where: str) -> None:
    """Raise ScheduleError when `compiler` is not a usable torch.compile backend here."""
    names = available_compilers()
    if compiler not in names:
        raise ScheduleError(f"fuse at {where}: compiler {compiler!r} is not a torch.compile backend here; "
                            f"available: {names}")
    if compiler == "inductor" and not torch.cuda.is_available() and not (shutil.which("g++") or shutil.which("c++")
                                                                          or shutil.which("clang++")):
        raise ScheduleError(f"fuse at {where}: compiler 'inductor' needs a C++ compiler on CPU and none was found "
                            f"(g++, c++, clang++); install one or use compiler='aot_eager'")


def wrap_region(gm: fx.GraphModule, match: Match, make_module: Callable[[fx.GraphModule], nn.Module], base: str
                ) -> str:
    """Replace `match` by a module built from its extracted region; returns the module's attribute name."""
    region, ext = extract_region(gm, match)
    mod = make_module(region)
    name = _unique_name(gm, base)
    gm.add_submodule(name, mod)
    _install(gm, match, lambda last: gm.graph.call_module(name, tuple(ext)))
    return name


# ------------------------------------------------------------------------------------------ decompose
# module type or its qualified name -> (fn(graph, x_node, path) -> output node, weight dim of outputs, of inputs)
_DECOMPOSITIONS: dict[type | str, tuple[Callable[[fx.Graph, fx.Node, str], fx.Node], int, int]] = {}


def register_decomposition(module_type: type | str, *, out_dim: int, in_dim: int):
    """Register how a leaf of `module_type` (a class, or its qualified name: NOTE [registrations on first use])
    decomposes into matmul + bias add; `out_dim`/`in_dim`: the weight dims of its output / input features."""

    def deco(fn):
        if module_type in _DECOMPOSITIONS:
            raise ScheduleError(f"a decomposition for {getattr(module_type, '__qualname__', module_type)} is already registered")
        _DECOMPOSITIONS[module_type] = (fn, out_dim, in_dim)
        return fn

    return deco


def leaf_input(x: torch.Tensor, path: str) -> torch.Tensor:
    """Marks the input of a decomposed leaf `path` (identity; build inserts the input-gradient reduction a
    column-sharded weight needs here)."""
    return x


@register_decomposition(nn.Linear, out_dim=0, in_dim=1)
def _linear(graph: fx.Graph, x: fx.Node, path: str) -> fx.Node:
    w = graph.get_attr(f"{path}.weight")
    y = graph.call_function(F.linear, (x, w))
    return y


def _decomposition(mod: nn.Module) -> tuple[Callable[[fx.Graph, fx.Node, str], fx.Node], int, int] | None:
    load_registrations()  # its exact type's, by class or qualified name; else None
    return _DECOMPOSITIONS.get(type(mod)) or _DECOMPOSITIONS.get(qualified_name(type(mod)))


def decomposable(mod: nn.Module) -> bool:
    return _decomposition(mod) is not None


def decomposition_dims(mod: nn.Module) -> tuple[int, int]:
    return _decomposition(mod)[1:]  # (out_dim, in_dim)


class LeafHooks(nn.Module):
    """The forward pre-hooks and forward hooks a decomposed leaf had, run around its decomposition in the
    graph: ``forward(x)`` runs the pre-hooks on the input, ``forward(x, y)`` the forward hooks on the output.
    The leaf itself is held by reference, not as a child, so its parameters keep their one path."""

    def __init__(self, leaf: nn.Module, pre: list[Callable], post: list[Callable]):
        super().__init__()
        self.pre, self.post = list(pre), list(post)
        object.__setattr__(self, "_leaf", leaf)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if y is None:
            for hook in self.pre:
                r = hook(self._leaf, (x,))
                if r is not None:
                    x = r[0] if isinstance(r, tuple) else r
            return x
        for hook in self.post:
            r = hook(self._leaf, (x,), y)
            if r is not None:
                y = r
        return y


def leaf_hook_problems(mod: nn.Module) -> list[str]:
    """Hooks of a leaf that a graph of loose ops cannot run as the module would (empty: all carry over)."""
    out = []
    if getattr(mod, "_backward_hooks", None) or getattr(mod, "_backward_pre_hooks", None):
        out.append("backward hooks")
    if getattr(mod, "_forward_pre_hooks_with_kwargs", None) or getattr(mod, "_forward_hooks_with_kwargs", None):
        out.append("hooks registered with_kwargs=True")
    return out


class SyncBoundary(nn.Module):
    """Identity at the input or output of a decomposed leaf: the module the leaf's explicit syncs move to
    (build hangs them on it as it would on the leaf)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def decompose_node(gm: fx.GraphModule, node: fx.Node, *, full_path: str, boundary_in: bool = False,
                   boundary_out: bool = False) -> tuple[str | None, str | None]:
    """Replace leaf call `node` by its matmul (decomposition) followed by ``+ bias`` as a separate op. The
    leaf's forward pre-hooks and forward hooks keep running around it (`LeafHooks`); backward hooks or hooks
    with keyword arguments cannot, so they are a ScheduleError (the graph is unchanged)."""
    mod = gm.get_submodule(node.target)
    fn, _, _ = _decomposition(mod)
    if len(node.args) != 1 or node.kwargs:
        raise ScheduleError(f"decompose at {full_path!r}: the leaf is called with {len(node.args)} positional and "
                            f"{sorted(node.kwargs)} keyword arguments; only single-input calls decompose")
    bad = leaf_hook_problems(mod)
    if bad:
        raise ScheduleError(f"decompose at {full_path!r}: the leaf has {' and '.join(bad)}, which its loose ops "
                            f"could not run; remove them or do not decompose this leaf")
    g = gm.graph
    pre, post = list(mod._forward_pre_hooks.values()), list(mod._forward_hooks.values())
    hooks_name = None
    if pre or post:
        hooks_name = _unique_name(gm, f"{node.target.replace('.', '_')}_hooks")
        gm.add_submodule(hooks_name, LeafHooks(mod, pre, post))
    names: list[str | None] = []
    for want, side in ((boundary_in, "in"), (boundary_out, "out")):
        names.append(None)
        if want:
            names[-1] = _unique_name(gm, f"{node.target.replace('.', '_')}_sync_{side}")
            gm.add_submodule(names[-1], SyncBoundary())
    with g.inserting_before(node):
        x_in = node.args[0]
        if pre:
            x_in = g.call_module(hooks_name, (x_in,))
        if names[0]:  # the leaf's input syncs run after its pre-hooks, as build's hooks did on the leaf
            x_in = g.call_module(names[0], (x_in,))
        x = g.call_function(leaf_input, (x_in,), {"path": full_path})
        y = fn(g, x, node.target)
        if getattr(mod, "bias", None) is not None:
            b = g.get_attr(f"{node.target}.bias")
            y = g.call_function(operator.add, (y, b))
        if post:
            y = g.call_module(hooks_name, (x_in, y))
        if names[1]:
            y = g.call_module(names[1], (y,))
    # the leaf's output pytree was read through _tensor_leaves (export) or used directly (fx)
    from .capture import _tensor_leaves

    for u in list(node.users):
        if u.op == "call_function" and u.target is _tensor_leaves:
            for uu in list(u.users):
                uu.replace_all_uses_with(y)
                g.erase_node(uu)
            g.erase_node(u)
    node.replace_all_uses_with(y)
    g.erase_node(node)
    g.lint()
    gm.recompile()
    return names[0], names[1]
