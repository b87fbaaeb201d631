"""What the runtime can build, as the planner asks it of a model: which parameters and modules a leaf rule shards
(`treadle.sharding_rules`), which module attribute holds a reshape size, and which placements each parameter may
take."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

from torch import nn

from ..form import forms
from ..placement import R
from ..sharding_rules import computes_on_shards
from .capture import CapturedGraph


def runtime_capabilities(model: nn.Module) -> tuple[Callable[[str], bool], Callable[[str], bool]]:
    """(is_leaf_param(param name), is_leaf_module(path)) for params/modules the runtime computes on shards
    (`treadle.sharding_rules.computes_on_shards`: not a subclass with its own forward, which build runs gathered:
    the planner would cost its output split where build makes it whole, and state syncs build refuses)."""
    leaf_paths = {name for name, m in model.named_modules() if computes_on_shards(m)}
    owners = {}
    for mname, m in model.named_modules():
        for pname, _ in m.named_parameters(recurse=False):
            owners[f"{mname}.{pname}" if mname else pname] = mname
    return (lambda p: owners.get(p) in leaf_paths), (lambda path: path in leaf_paths)


def attr_resolver(model: nn.Module) -> Callable[[str, int], Any]:
    """NOTE [fixed view sizes] in `treadle.planner.views`: which int attribute of a module holds a reshape size."""
    cache: dict[tuple[str, int], Any] = {}

    def resolve(path: str, value: int, prefer: str | None = None):
        key = (path, value, prefer)
        if key in cache:
            return cache[key]
        try:
            mod = model.get_submodule(path) if path else model
        except AttributeError:
            cache[key] = "ok"
            return "ok"
        if computes_on_shards(mod):  # the runtime replaces a sharded leaf's forward: its attributes are unused
            cache[key] = "ok"
            return "ok"
        names = [k for k, v in _fields(mod).items()
                 if isinstance(v, int) and not isinstance(v, bool) and v == value and not k.startswith("_")]
        cfg = getattr(mod, "config", None)
        in_cfg = cfg is not None and any(isinstance(v, int) and not isinstance(v, bool) and v == value
                                         for v in _fields(cfg).values())
        if len(names) > 1 and prefer:  # a split's size: the attribute named for it (GPT-2's split_size)
            names = [k for k in names if prefer in k] or names
        r: Any = ("attr", names[0]) if len(names) == 1 else ("forbid" if names else "config" if in_cfg else "ok")
        cache[key] = r
        return r

    return resolve


def _fields(obj: Any) -> dict[str, Any]:
    """An object's attributes by name: its ``__dict__``, a slotted dataclass's fields, a dict's items, else none
    (a model's `config` may be any of them: torchtitan's model args are a dataclass)."""
    if isinstance(obj, dict):
        return dict(obj)
    if hasattr(obj, "__dict__"):
        return vars(obj)
    names = ([f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj)
             else getattr(obj, "__slots__", ()))
    return {n: getattr(obj, n) for n in ([names] if isinstance(names, str) else names) if hasattr(obj, n)}


def tied_leaf_holders(model: nn.Module) -> dict[str, set[str]]:
    """Parameter name -> the paths of every leaf module the runtime computes on shards (`computes_on_shards`) that
    holds that very parameter object under any name: a tied output embedding computes with the input embedding's
    shard."""
    paths: dict[int, set[str]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        if computes_on_shards(m):
            for _, p in m.named_parameters(recurse=False):
                paths.setdefault(id(p), set()).add(mname)
    return {name: paths.get(id(p), set()) for name, p in model.named_parameters(remove_duplicate=False)}


def shardable_fn(graph: CapturedGraph, is_leaf_param: Callable[[str], bool], n_tp: int,
                  holders: dict[str, set[str]] | None = None):
    """Per parameter: every placement over the tensor axes with each tensor dim on at most one axis
    (the runtime's leaf rules reject a dim split over several axes), for leaf parameters only, where the
    consuming module is the owner or another leaf holding the same parameter (`tied_leaf_holders`); and the
    placements a parallel form builds its own way (`treadle.form.Form.param_placements`: the experts' split)."""
    cache: dict[tuple[str, str], set] = {}
    holders = holders or {}

    def fn(param: str, module: str) -> set:
        if (param, module) in cache:
            return cache[(param, module)]
        out: set = set()
        if is_leaf_param(param) and (graph.param_modules.get(param) == module or module in holders.get(param, ())):
            nd = len(graph.params[param].shape)
            for combo in itertools.product([R] + list(range(nd)), repeat=n_tp):
                dims = [d for d in combo if d >= 0]
                if dims and len(dims) == len(set(dims)):
                    out.add(tuple(combo))
        for f in forms():
            out |= f.param_placements(graph.facts, param, module, n_tp)
        cache[(param, module)] = out
        return out

    return fn
