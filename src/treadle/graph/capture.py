"""Capture one module as an FX graph, keeping chosen sub-modules as opaque leaf calls.

Two methods (NOTE [capture]):

* ``"fx"`` — `torch.fx` symbolic tracing, for simple user modules. Leaves are ordinary FX leaf modules.
* ``"export"`` — `torch.export` (non-strict), for model code one did not write (transformers 5 modules cannot
  be symbolically traced). It needs the real call: the arguments the module receives inside the model,
  recorded by running the model once on example inputs (`record_call`). Leaves are kept by swapping each
  leaf's ``forward`` during export for a call of the opaque custom op ``treadle::leaf_call`` (whose fake
  kernel runs the real forward), and afterwards rewriting every such op back into a ``call_module`` node.

Either way the result is a `TracedModule`: a `GraphModule` whose ``forward`` takes the same arguments as the
original module (pytree-flattened to the graph's tensor placeholders), whose leaves are the *original* child
module objects (so their parameters, hooks and schedules are untouched), and whose parameters are the
original `nn.Parameter` objects (tied and recorded parameters stay the same objects).

Inputs the export cannot take (objects that are not tensors or constants, such as a KV cache) are handed to
the leaves that receive them at run time; a non-leaf op that uses such an object cannot be captured.
Failures raise ScheduleError naming the module and the reason; nothing falls back silently.
"""

from __future__ import annotations

import copy
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from ..errors import ScheduleError

from .traced import (_ACTIVE_LEAF_CALLS, _CALL_IDS, _is_const, _LeafCallRecord, _Opaque, _TensorSlot, TracedModule)

logger = logging.getLogger(__name__)



# ------------------------------------------------------------------------------------------ recording calls
class _Stop(Exception):
    pass


def record_call(model: nn.Module, path: str, inputs: dict[str, Any]) -> tuple[tuple, dict]:
    """The (args, kwargs) module `path` receives on its first call when `model(**inputs)` runs (no grad).
    The run stops right after that call. Raises ScheduleError if the module is never called."""
    target = model.get_submodule(path) if path else model
    if not path:
        return (), dict(inputs)
    seen: list[tuple[tuple, dict]] = []

    def hook(mod, args, kwargs):
        seen.append((args, kwargs))
        raise _Stop

    h = target.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    try:
        with torch.no_grad():
            model(**inputs)
    except _Stop:
        pass
    except Exception as exc:
        raise ScheduleError(f"trace at {path!r}: running the model on the example inputs to record the module's "
                            f"call failed: {type(exc).__name__}: {exc}") from exc
    finally:
        h.remove()
    if not seen:
        raise ScheduleError(f"trace at {path!r}: the module is not called when the model runs on the example inputs")
    return seen[0]


# ------------------------------------------------------------------------------------------ leaves
def resolve_leaves(mod: nn.Module, *, flatten: bool, leaves: Sequence[type | str] = ()) -> list[str]:
    """Relative paths of the modules kept as leaf calls: the direct children unless `flatten`, plus every
    module listed by type or by relative path (the outermost wins: a leaf's descendants are inside it)."""
    types = tuple(x for x in leaves if isinstance(x, type))
    paths = {x for x in leaves if isinstance(x, str)}
    names = {n for n, _ in mod.named_modules() if n}
    missing = sorted(paths - names)
    if missing:
        raise ScheduleError(f"trace: leaves {missing} are not sub-modules of {type(mod).__name__}; "
                            f"its children: {[n for n, _ in mod.named_children()]}")
    # direct children, looking through containers that are never called (ModuleList / ModuleDict)
    direct: set[str] = set()
    if not flatten:
        todo = [("", mod)]
        while todo:
            prefix, m = todo.pop()
            for n, c in m.named_children():
                full = f"{prefix}.{n}" if prefix else n
                if isinstance(c, (nn.ModuleList, nn.ModuleDict)):
                    todo.append((full, c))
                else:
                    direct.add(full)
    out: list[str] = []
    for name, sub in mod.named_modules():
        if not name or any(name.startswith(p + ".") for p in out):
            continue
        if name in direct or name in paths or (types and isinstance(sub, types)):
            out.append(name)
    return out


# ------------------------------------------------------------------------------------------ fx
class _LeafTracer(fx.Tracer):
    def __init__(self, leaf_paths: set[str]):
        super().__init__()
        self.leaf_paths = leaf_paths

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaf_paths


def capture_fx(mod: nn.Module, leaf_paths: list[str], *, where: str) -> TracedModule:
    """Symbolic trace of `mod` with `leaf_paths` as leaf modules."""
    tracer = _LeafTracer(set(leaf_paths))
    try:
        graph = tracer.trace(mod)
    except Exception as exc:
        raise ScheduleError(f"trace at {where}: torch.fx cannot capture {type(mod).__name__} "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); pass example_inputs= "
                            f"(keyword inputs of the whole model) to capture it with torch.export instead") from exc
    return TracedModule(mod, graph, in_spec=None, in_kinds=[], out_spec=None, out_flat=[], method="fx",
                        source=type(mod).__name__)


# ------------------------------------------------------------------------------------------ export
class _FlatCall(nn.Module):
    """What torch.export sees: the module called with its tensor inputs only (opaques and constants closed over)."""

    def __init__(self, mod: nn.Module, in_spec: Any, in_kinds: list[Any], opaques: list[Any], holder: dict):
        super().__init__()
        self.m = mod
        self._spec = in_spec
        self._kinds = in_kinds
        self._opaques = opaques
        self._holder = holder

    def forward(self, *tensors):
        flat = [tensors[k.index] if isinstance(k, _TensorSlot) else
                self._opaques[k.index] if isinstance(k, _Opaque) else k for k in self._kinds]
        args, kwargs = pytree.tree_unflatten(flat, self._spec)
        out = self.m(*args, **kwargs)
        oflat, ospec = pytree.tree_flatten(out)
        kinds, touts = [], []
        for x in oflat:
            if torch.is_tensor(x):
                kinds.append(_TensorSlot(len(touts)))
                touts.append(x)
            elif _is_const(x):
                kinds.append(x)
            else:
                raise ScheduleError(f"the module returns a {type(x).__name__}, which a graph cannot return")
        self._holder["out"] = (ospec, kinds)
        return tuple(touts)


def _split_call(args: tuple, kwargs: dict) -> tuple[Any, list[Any], list[torch.Tensor], list[Any]]:
    flat, spec = pytree.tree_flatten((args, kwargs))
    kinds, tensors, opaques = [], [], []
    for x in flat:
        if torch.is_tensor(x):
            kinds.append(_TensorSlot(len(tensors)))
            tensors.append(x)
        elif _is_const(x):
            kinds.append(x)
        else:
            kinds.append(_Opaque(len(opaques)))
            opaques.append(x)
    return spec, kinds, tensors, opaques


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


_DATA_DEPENDENT = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)


def record_leaf_outputs(model: nn.Module, leaf_paths: Sequence[str], kwargs: dict) -> dict[str, list[Any]]:
    """Run ``model(**kwargs)`` eagerly once (no grad, RNG state restored afterwards) and return, per leaf path,
    the shapes, dtypes and devices of its outputs in call order, for `capture_export(eager_outputs=...)`."""
    out: dict[str, list[Any]] = {p: [] for p in leaf_paths}
    handles = []
    for p in leaf_paths:
        def hook(mod, a, o, p=p):
            out[p].append(pytree.tree_map(lambda t: _TensorMeta(tuple(t.shape), t.dtype, t.device)
                                          if torch.is_tensor(t) else t, o))
        handles.append(model.get_submodule(p).register_forward_hook(hook))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(**kwargs)
    finally:
        for h in handles:
            h.remove()
    return out


def capture_export(mod: nn.Module, leaf_paths: list[str], args: tuple, kwargs: dict, *, where: str,
                   dynamic: bool = True, eager_outputs: dict[str, list[Any]] | None = None) -> TracedModule:
    """torch.export (non-strict) of ``mod(*args, **kwargs)`` with `leaf_paths` kept as leaf calls.
    With `dynamic`, every tensor dim is exported as `Dim.AUTO` (batch and sequence stay symbolic).

    `eager_outputs` (from `record_leaf_outputs`, static shapes only): the leaves' outputs are made from the
    recorded shapes instead of running their code on fake tensors, so a leaf whose code branches on tensor
    values captures (it runs eagerly at run time). Without a recording such a leaf is a ScheduleError naming
    it."""
    calls_seen: dict[str, int] = {}
    in_spec, in_kinds, tensors, real_opaques = _split_call(args, kwargs)
    # leaves may mutate what they are handed (a KV cache): trace on copies so the caller's objects never hold
    # fake tensors
    opaques = [copy.deepcopy(o) for o in real_opaques]
    opaque_ids = {id(o): j for j, o in enumerate(opaques)}
    records: dict[int, _LeafCallRecord] = {}
    holder: dict[str, Any] = {}
    saved: dict[str, Any] = {}

    def make_forward(path: str, child: nn.Module):
        orig = child.forward

        def forward(*a, **k):
            flat, spec = pytree.tree_flatten((a, k))
            kinds, ts = [], []
            for x in flat:
                if torch.is_tensor(x):
                    kinds.append(_TensorSlot(len(ts)))
                    ts.append(x)
                elif _is_const(x):
                    kinds.append(x)
                elif id(x) in opaque_ids:
                    kinds.append(_Opaque(opaque_ids[id(x)]))
                else:
                    raise ScheduleError(f"trace at {where}: leaf {path!r} receives a {type(x).__name__} made inside "
                                        f"the module; only tensors, constants and objects passed into the module "
                                        f"can reach a leaf (a model that builds a KV cache needs use_cache=False "
                                        f"in the example inputs)")
            cid = next(_CALL_IDS)
            rec = _LeafCallRecord(path, spec, kinds)
            records[cid] = rec
            k_call = calls_seen[path] = calls_seen.get(path, -1) + 1

            def run(real_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
                fl = [real_tensors[kd.index] if isinstance(kd, _TensorSlot) else
                      opaques[kd.index] if isinstance(kd, _Opaque) else kd for kd in rec.in_flat]
                aa, kk = pytree.tree_unflatten(fl, rec.in_spec)
                seen = (eager_outputs or {}).get(path, [])
                if k_call < len(seen):  # shapes from the eager run: the leaf's code never sees a fake tensor
                    out = pytree.tree_map(lambda m: torch.empty(m.shape, dtype=m.dtype, device=m.device)
                                          if isinstance(m, _TensorMeta) else m, seen[k_call])
                else:
                    try:
                        out = orig(*aa, **kk)
                    except _DATA_DEPENDENT as exc:
                        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
                        raise ScheduleError(f"trace at {where}: leaf {path!r} branches on tensor values "
                                            f"({type(exc).__name__}: {first}), so it cannot run on fake tensors; "
                                            f"capture with static shapes and recorded leaf outputs "
                                            f"(record_leaf_outputs), as a pipeline does") from exc
                oflat, ospec = pytree.tree_flatten(out)
                okinds, outs = [], []
                in_ids = {id(t) for t in real_tensors}
                for x in oflat:
                    if torch.is_tensor(x):
                        okinds.append(_TensorSlot(len(outs)))
                        outs.append(x.clone() if id(x) in in_ids or x._base is not None else x)
                    elif _is_const(x):
                        okinds.append(x)
                    else:
                        raise ScheduleError(f"trace at {where}: leaf {path!r} returns a {type(x).__name__}; "
                                            f"leaves must return tensors and constants")
                rec.out_spec, rec.out_flat = ospec, okinds
                return outs

            _ACTIVE_LEAF_CALLS[cid] = run
            outs = torch.ops.treadle.leaf_call(ts, cid)
            fl = [outs[kd.index] if isinstance(kd, _TensorSlot) else kd for kd in rec.out_flat]
            return pytree.tree_unflatten(fl, rec.out_spec)

        return forward

    flat_mod = _FlatCall(mod, in_spec, in_kinds, opaques, holder)
    for p in leaf_paths:
        child = mod.get_submodule(p)
        saved[p] = child.__dict__.get("forward")
        child.forward = make_forward(p, child)
    dyn = tuple({d: torch.export.Dim.AUTO for d in range(t.dim())} for t in tensors) if dynamic else None
    try:
        ep = torch.export.export(flat_mod, tuple(tensors), strict=False,
                                 dynamic_shapes=(dyn,) if dynamic else None)
    except ScheduleError:
        raise
    except Exception as exc:
        msg = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        if real_opaques and "fake tensor in the exported program constant" in str(exc):
            msg = (f"its own code uses a {type(real_opaques[0]).__name__} input, which a graph cannot hold; "
                   f"run the model with use_cache=False (or without that input), or keep the sub-module that "
                   f"uses it as a leaf")
        raise ScheduleError(f"trace at {where}: torch.export cannot capture {type(mod).__name__} "
                            f"({type(exc).__name__}: {msg}); list the part that fails as a leaf "
                            f"(trace(leaves=[...])) or capture a smaller module") from exc
    finally:
        for p in leaf_paths:
            child = mod.get_submodule(p)
            if saved[p] is None:
                child.__dict__.pop("forward", None)
            else:
                child.forward = saved[p]
        for cid in records:
            _ACTIVE_LEAF_CALLS.pop(cid, None)
    handed = {k.index for rec in records.values() for k in rec.in_flat if isinstance(k, _Opaque)}
    kept_out = [j for j, o in enumerate(opaques) if j not in handed]
    if kept_out:
        raise ScheduleError(f"trace at {where}: its own code uses a {type(real_opaques[kept_out[0]]).__name__} input "
                            f"(not only its leaves), which a graph cannot hold: the graph would silently skip what "
                            f"it does with it; run the model with use_cache=False (or without that input), or keep "
                            f"the sub-module that uses it as a leaf")
    out_spec, out_kinds = holder["out"]
    return _graph_from_export(ep, mod, records, in_spec, in_kinds, len(tensors), len(opaques), out_spec, out_kinds,
                              where=where)


def _graph_from_export(ep, mod: nn.Module, records: dict[int, _LeafCallRecord], in_spec, in_kinds, n_tensors: int,
                       n_opaques: int, out_spec, out_kinds, *, where: str) -> TracedModule:
    """Turn the exported program into a graph over (tensors..., opaques...) with get_attr for parameters,
    call_module for leaves, and the exported ops in between."""
    sig = ep.graph_signature
    src = ep.graph_module.graph
    if getattr(sig, "buffers_to_mutate", None):
        raise ScheduleError(f"trace at {where}: the module mutates buffers {sorted(sig.buffers_to_mutate.values())} "
                            f"in forward; capture cannot keep that (make the mutating module a leaf)")
    param_of = dict(sig.inputs_to_parameters)
    param_of.update(sig.inputs_to_buffers)
    const_of = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    user_inputs = list(sig.user_inputs)
    g = fx.Graph()
    env: dict[fx.Node, Any] = {}
    attrs: dict[str, Any] = {}
    direct: dict[fx.Node, fx.Node] = {}
    t_nodes = [g.placeholder(f"in_{i}") for i in range(n_tensors)]
    o_nodes = [g.placeholder(f"opaque_{j}") for j in range(n_opaques)]
    ui = iter(range(n_tensors))
    for node in src.nodes:
        if node.op == "placeholder":
            if node.name in param_of:
                fqn = param_of[node.name]
                fqn = fqn[2:] if fqn.startswith("m.") else fqn
                attrs[fqn] = _resolve(mod, fqn)
                env[node] = g.get_attr(fqn)
            elif node.name in const_of:
                name = "_const_" + const_of[node.name].replace(".", "_")
                attrs[name] = ep.constants[const_of[node.name]]
                env[node] = g.get_attr(name)
            elif node.name in user_inputs:
                env[node] = t_nodes[next(ui)]
            else:
                raise ScheduleError(f"trace at {where}: unexpected exported input {node.name!r}")
        elif node.op == "output":
            outs = node.args[0]
            g.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outs))
        elif node.op == "call_function" and node.target is torch.ops.treadle.leaf_call.default:
            tensors_arg, cid = node.args
            rec = records[cid]
            tin = [env[t] for t in tensors_arg]
            fl = [tin[k.index] if isinstance(k, _TensorSlot) else o_nodes[k.index] if isinstance(k, _Opaque) else k
                  for k in rec.in_flat]
            a, k = pytree.tree_unflatten(fl, rec.in_spec)
            attrs[rec.path] = mod.get_submodule(rec.path)
            cm = g.call_module(rec.path, tuple(a), dict(k))
            cm.meta["treadle_leaf"] = rec.path
            if rec.out_spec is not None and rec.out_spec.is_leaf() and len(rec.out_flat) == 1:
                direct[node] = cm  # a single-tensor leaf: its call is the value (no unpacking nodes)
            else:
                env[node] = g.call_function(_tensor_leaves, (cm,))
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in direct:
            env[node] = direct[node.args[0]]
        elif node.op == "get_attr":
            attrs[node.target] = getattr(ep.graph_module, node.target)
            env[node] = g.get_attr(node.target)
        else:
            new = g.node_copy(node, lambda n: env[n])
            env[node] = new
    gm = TracedModule(attrs, g, in_spec=in_spec, in_kinds=in_kinds, out_spec=out_spec, out_flat=out_kinds,
                      method="export", source=type(mod).__name__)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    _relink(gm, mod)
    gm.train(mod.training)
    return gm


def _tensor_leaves(out: Any) -> list[torch.Tensor]:
    """The tensors of a leaf module's output, in pytree order (what the graph indexes into)."""
    return [x for x in pytree.tree_leaves(out) if torch.is_tensor(x)]


def _resolve(mod: nn.Module, fqn: str) -> Any:
    obj: Any = mod
    for part in fqn.split("."):
        obj = getattr(obj, part)
    return obj


def _relink(gm: nn.Module, mod: nn.Module) -> None:
    """Make intermediate containers of flattened paths carry the original modules' training flag."""
    for name, sub in gm.named_modules():
        if name:
            try:
                sub.train(mod.get_submodule(name).training)
            except AttributeError:
                pass


def leaf_call_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module"]


__all__ = ["TracedModule", "record_call", "resolve_leaves", "capture_fx", "capture_export"]
