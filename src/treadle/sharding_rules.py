"""The one registry of sharding rules, read by the planner and the runtime alike.

A sharding rule says how one kind of computation runs on shards:

- an ATen op's *dimension rule* (`register_dims`): the letters of its tensors' dims, from which the planner's
  dimension algebra enumerates every way the op can run on a mesh axis (`treadle.planner.dims`);
- a module type's *leaf rule* (`register_leaf_rule`): given the layout of the leaf's parameters, the layout
  of its output and the local forward `build` installs (`LeafPlan`). The planner may shard a parameter only
  where a leaf rule runs its module on shards (`computes_on_shards`); build also shards a leaf whose subclass has
  its own forward, on gathered weights (`has_leaf_rule`, NOTE [exact leaf rules]).

The parallel forms register their rules here (the tensor-parallel form: Linear, Conv1D, Conv2d, BatchNorm2d; the
vocab-parallel form: Embedding), and the dimension algebra registers one rule per op family. A second rule for
one op or one module type is refused (RuleError).

NOTE [exact leaf rules]: a rule reproduces one class's forward. It applies to that class and to subclasses
that keep its forward; a subclass with its own forward (Gemma's scaled embedding multiplies the lookup) runs
that forward on weights gathered to full size in forward (`LeafPlan.gathered`), so its output is Replicate
and its own computation is kept; sharding it saves parameter memory, not compute.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import BuildError, PlanError
from .lazy import load_registrations, qualified_name

logger = logging.getLogger(__name__)


class RuleError(PlanError, BuildError):
    """A sharding rule registered twice, or asked of a module or op that has none."""


# ------------------------------------------------------------------------------------------ dimension rules
DimRule = Callable[..., Any]  # (node, nodes) -> treadle.planner.dims.DimSpec | None
_DIMS: dict[str, DimRule] = {}


def register_dims(*op_names: str) -> Callable[[DimRule], DimRule]:
    """Register one dimension rule for ATen op names (overload packets, e.g. ``"linear"``).
    Raises RuleError (a PlanError) when a name already has a rule."""

    def deco(fn: DimRule) -> DimRule:
        for name in op_names:
            if name in _DIMS:
                raise RuleError(f"dimension rule for op {name!r} is already registered ({_DIMS[name].__name__})")
            _DIMS[name] = fn
        return fn

    return deco


def dims_rule(op_name: str) -> DimRule | None:
    """The dimension rule of an ATen op (None: it has none, and runs replicated)."""
    load_registrations()
    return _DIMS.get(op_name)


# ------------------------------------------------------------------------------------------ leaf rules
@dataclass
class LeafPlan:
    """What a sharded leaf needs at build (a leaf rule's answer). Axes not named keep Replicate.

    `out`: the output's layout per axis; `grad_partial_axes`: the axes on which the input's gradient is a
    pending sum (a replicated input to a column-sharded weight); `pending_bias`: a bias to add once, after the
    row reduction; `row_axes`: the axes a row-sharded weight reduces over; `forward`: the local
    ``forward(module, x)`` replacing the module's own; `bind`: when the local forward depends on the rank,
    ``bind(builder) -> forward`` (build calls it with its coordinates and groups); `vocab_axis`: the axis a
    vocab-sharded embedding splits its ids over; `gathered`: run the class's own forward on these parameters,
    gathered in forward (NOTE [exact leaf rules])."""

    out: dict[str, Any] = field(default_factory=dict)
    grad_partial_axes: tuple[str, ...] = ()
    pending_bias: str | None = None
    row_axes: tuple[str, ...] = ()
    forward: Callable[..., Any] | None = None
    bind: Callable[[Any], Callable[..., Any]] | None = None
    vocab_axis: str | None = None
    gathered: dict[str, list] | None = None


LeafRule = Callable[[str, Any, dict[str, list]], LeafPlan]  # (path, module, {parameter: [ParamShard]}) -> plan
_LEAVES: dict[type | str, LeafRule] = {}  # a class, or its qualified name (a class of an optional library)


def register_leaf_rule(*types: type | str) -> Callable[[LeafRule], LeafRule]:
    """Register a leaf rule for module types, each a class or its qualified name (``"transformers.pytorch_utils.
    Conv1D"``: registering it imports nothing; NOTE [registrations on first use]). Raises RuleError (a
    BuildError) for a second rule of one type."""

    def deco(fn: LeafRule) -> LeafRule:
        for t in types:
            same = [k for k in _LEAVES
                    if k == t or (isinstance(t, str) != isinstance(k, str) and _name(k) == _name(t))]
            if same:
                raise RuleError(f"a leaf rule for {_short(t)} is already registered ({_LEAVES[same[0]].__name__})")
            _LEAVES[t] = fn
        return fn

    return deco


def _name(t: type | str) -> str:
    return t if isinstance(t, str) else qualified_name(t)


def _short(t: type | str) -> str:
    return t.rpartition(".")[2] if isinstance(t, str) else t.__qualname__


def _rule_class(cls: type) -> type | None:
    """The class of `cls`'s MRO that has a leaf rule (by class or by qualified name), nearest first."""
    load_registrations()
    for t in cls.__mro__:
        if t in _LEAVES or qualified_name(t) in _LEAVES:
            return t
    return None


def _rule_of(t: type) -> LeafRule:
    return _LEAVES[t] if t in _LEAVES else _LEAVES[qualified_name(t)]


def has_leaf_rule(mod: Any) -> bool:
    """True when build can compute `mod` with sharded parameters: a rule for its class or a base class."""
    return _rule_class(type(mod)) is not None


def computes_on_shards(mod: Any) -> bool:
    """True when build runs `mod` on its shards by a rule (NOTE [exact leaf rules]): its class's, or a base class's
    whose forward it keeps. A subclass with its own forward runs on gathered weights (its output Replicate), which
    the planner, costing a leaf as the rule computes it, does not model: it shards only these
    (`planner.capabilities`)."""
    t = _rule_class(type(mod))
    return t is not None and (t is type(mod) or getattr(type(mod), "forward", None) is getattr(t, "forward", None))


def leaf_plan(path: str, mod: Any, shards: dict[str, list]) -> LeafPlan:
    """The plan for leaf `mod` whose direct parameters have `shards` (NOTE [exact leaf rules]). Raises BuildError
    for a module type without a rule or a layout the rule does not support, naming path, parameter and axis."""
    t = _rule_class(type(mod))
    if t is not None:
        if computes_on_shards(mod):
            return _rule_of(t)(path, mod, shards)
        logger.info("build: %r is a %s with its own forward; it runs on gathered weights (no %s rule for it)",
                    path, type(mod).__qualname__, t.__qualname__)
        return gathered_plan(path, mod, shards)
    known = sorted(_short(t) for t in _LEAVES)
    raise RuleError(f"build: {path!r} ({type(mod).__name__}) has sharded parameters {sorted(shards)} but "
                    f"treadle has no sharded-compute rule for that module type (rules exist for {known}); "
                    f"shard its children instead, or replace it with a module of a supported type")


def gathered_plan(path: str, mod: Any, shards: dict[str, list]) -> LeafPlan:
    """A leaf that keeps its own forward: each sharded parameter is all-gathered to its global shape in forward
    (gradient: this rank's slice, exact because the input and output are Replicate on the gathered axes).
    Output: Replicate on every axis. Build fills `forward` with `treadle.runtime.build.gathered_forward`."""
    import torch

    for name in shards:
        if not isinstance(getattr(mod, name, None), torch.Tensor):
            raise RuleError(f"build: {path!r}: sharded {name!r} is not a tensor attribute of "
                            f"{type(mod).__qualname__}")
    return LeafPlan(gathered=dict(shards))
