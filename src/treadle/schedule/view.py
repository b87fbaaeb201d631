"""`ScheduleView`: a read-only, typed picture of what a schedule recorded, for the layers that act on it.

`build`, the price, `verify`, `treadle.run` and the planner read a schedule through `Schedule.view()` and
never through its private state; what build changes in the schedule it says through `Schedule.mark_built`
and `Schedule.rebind_param`. A view is a snapshot: primitives applied after it was taken are not in it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from torch import nn

from ..mesh import Mesh
from .data_parallel import DataParallel
from .log import Record

if TYPE_CHECKING:  # (the state module imports this one's siblings only)
    from .state import ParamShard, SyncSpec, _State


@dataclass(frozen=True, slots=True)
class ScheduleView:
    """What one schedule recorded. Paths are module paths of `model` ("" the root); shapes are global.

    `param_shards` maps ``id(parameter)`` of `model`'s parameters to their splits in order (`shards_of` takes
    the parameter); `syncs` are the layout changes at module boundaries; `checkpoints` the checkpointed paths;
    `fork_rngs` (path, axis); `reduce_grads` (path, axis, parameter names); `attrs` (path, name, value) set at
    build; `shard_attrs` (path, int attribute, axis); `annotations` ``id(parameter)`` -> tags; `data_parallel`
    the recorded data parallelism (None: none); `extras` the graph-level primitives' state (fused regions,
    selective checkpoints, pipeline cuts); `original` the model before its first `replace` (None when nothing
    was replaced), `reference` whichever of the two verify compares against."""

    model: nn.Module
    mesh: Mesh
    records: tuple[Record, ...]
    param_shards: Mapping[int, tuple["ParamShard", ...]]
    syncs: tuple["SyncSpec", ...]
    checkpoints: tuple[str, ...]
    fork_rngs: tuple[tuple[str, str], ...]
    reduce_grads: tuple[tuple[str, str, tuple[str, ...]], ...]
    attrs: tuple[tuple[str, str, Any], ...]
    shard_attrs: tuple[tuple[str, str, str], ...]
    annotations: Mapping[int, Mapping[str, Any]]
    data_parallel: DataParallel | None
    extras: Mapping[str, Any]
    built: bool
    original: nn.Module | None

    @classmethod
    def of(cls, st: "_State") -> "ScheduleView":
        return cls(st.model, st.mesh, tuple(st.records),
                   MappingProxyType({k: tuple(v) for k, v in st.param_shards.items()}), tuple(st.syncs),
                   tuple(st.checkpoints), tuple(st.fork_rngs), tuple(st.reduce_grads), tuple(st.attrs),
                   tuple(st.shard_attrs), MappingProxyType({k: MappingProxyType(dict(v)) for k, v in
                                                            st.annotations.items()}),
                   st.data_parallel, MappingProxyType(dict(st.extras)), st.built, st.original)

    @property
    def reference(self) -> nn.Module:
        """The model as written: `original` when a `replace` changed the tree, else `model`."""
        return self.original if self.original is not None else self.model

    def shards_of(self, param: nn.Parameter) -> tuple["ParamShard", ...]:
        """The splits recorded for `param` (a parameter of `model`), in order; () when it is not sharded."""
        return self.param_shards.get(id(param), ())

    def shards_by_name(self) -> dict[str, tuple["ParamShard", ...]]:
        """Parameter name (every alias of a tied one) -> its splits, for the sharded parameters of `model`."""
        return {n: self.param_shards[id(p)] for n, p in self.model.named_parameters(remove_duplicate=False)
                if id(p) in self.param_shards}

    def ops(self) -> set[str]:
        """The primitives the log holds (e.g. {"shard", "pipeline"})."""
        return {r.op for r in self.records}
