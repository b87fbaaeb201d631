"""What `Schedule.data_parallel` records: which mesh axes are data-parallel, and how parameters live on them.

Three forms, all over any set of mesh axes (the batch is split over their flattened group, row-major in
mesh order, so rank coordinates (i, j) on axes of sizes (n, m) take batch part i * m + j):

- DDP (``shard=False``): parameters replicated over every data-parallel axis, gradients averaged over their
  flattened group (`torch.nn.parallel.DistributedDataParallel` on one process group);
- FSDP2 / ZeRO-3 (``shard=True``): parameters, gradients and optimizer state sharded over the flattened
  group of the shard axes (`torch.distributed.fsdp.fully_shard` on a 1-D mesh);
- HSDP (``shard=True, replicate=(...)``): sharded over the shard axes and replicated over the replicate
  axes (`fully_shard` on a 2-D (replicate, shard) mesh: reduce-scatter over the shard group, then
  all-reduce of the shard over the replicate group).

``reshard_after_forward=False`` (FSDP2 only) keeps each unit's gathered parameters from forward to
backward (ZeRO-2-like: no backward all-gather, more memory).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ScheduleError
from ..mesh import Mesh


@dataclass(frozen=True)
class DataParallel:
    """A data-parallel role. `axes`: every data-parallel mesh axis, in mesh order (the batch splits over
    them); `shard_axes`: the axes FSDP2 shards parameters over (a subset, mesh order; empty for DDP);
    `reshard_after_forward`: FSDP2 frees gathered parameters after forward (True) or keeps them (False)."""

    axes: tuple[str, ...]
    shard_axes: tuple[str, ...] = ()
    reshard_after_forward: bool = True

    @property
    def shard(self) -> bool:
        """True for FSDP2 / HSDP, False for DDP."""
        return bool(self.shard_axes)

    @property
    def replicate_axes(self) -> tuple[str, ...]:
        """Axes the parameters are replicated over: all of `axes` for DDP, HSDP's replicate axes else."""
        return tuple(a for a in self.axes if a not in self.shard_axes)

    @property
    def kind(self) -> str:
        """"ddp", "fsdp2" or "hsdp"."""
        if not self.shard:
            return "ddp"
        return "hsdp" if self.replicate_axes else "fsdp2"

    def size(self, mesh: Mesh) -> int:
        """Number of data-parallel replicas: the product of the axes' sizes (the batch divisor)."""
        return math.prod(mesh.size(a) for a in self.axes)

    def shard_size(self, mesh: Mesh) -> int:
        """Ranks one FSDP2 shard group spans (1 for DDP)."""
        return math.prod(mesh.size(a) for a in self.shard_axes)

    def replicate_size(self, mesh: Mesh) -> int:
        """Ranks one parameter copy is replicated over (DDP: `size`; HSDP: the replicate axes)."""
        return math.prod(mesh.size(a) for a in self.replicate_axes)

    def index(self, coords: Mapping[str, int], mesh: Mesh) -> int:
        """This rank's batch part, from its coordinate per axis: row-major over `axes` in mesh order."""
        i = 0
        for a in self.axes:
            i = i * mesh.size(a) + coords[a]
        return i

    def local_index(self, mesh: Mesh) -> int:
        """`index` of the calling rank (binds `mesh`: inside a launched job)."""
        return self.index({a: mesh.local_rank(a) for a in self.axes}, mesh)

    def label(self) -> str:
        """The axes as one name ("dp" or "dp,tp"), as cost rows and timelines name a channel."""
        return ",".join(self.axes)

    def __str__(self) -> str:
        if self.kind == "ddp":
            return f"ddp over {self.label()}"
        keep = "" if self.reshard_after_forward else ", no reshard after forward"
        if self.kind == "fsdp2":
            return f"fsdp2 over {','.join(self.shard_axes)}{keep}"
        return f"hsdp: shard {','.join(self.shard_axes)} x replicate {','.join(self.replicate_axes)}{keep}"


def _axis_tuple(v: object, what: str) -> tuple[str, ...]:
    if isinstance(v, str):
        return (v,)
    if isinstance(v, (tuple, list)) and all(isinstance(a, str) for a in v):
        return tuple(v)
    raise ScheduleError(f"data_parallel: {what} must be a mesh axis name or a tuple of them, got {v!r}")


def make_data_parallel(mesh: Mesh, *, axis: str | tuple[str, ...] | list[str], shard: bool,
                       replicate: str | tuple[str, ...] | list[str] = (),
                       reshard_after_forward: bool = True) -> DataParallel:
    """Check `Schedule.data_parallel`'s arguments and return the spec (axes put in mesh order).

    Raises: ScheduleError for no axis, an axis named twice (within or across `axis` and `replicate`), an
    axis the mesh lacks (listing its axes), `replicate` or ``reshard_after_forward=False`` without
    ``shard=True``, or a non-bool flag."""
    if not isinstance(shard, bool) or not isinstance(reshard_after_forward, bool):
        raise ScheduleError(f"data_parallel: shard and reshard_after_forward must be bools, got "
                            f"shard={shard!r}, reshard_after_forward={reshard_after_forward!r}")
    main = _axis_tuple(axis, "axis")
    rep = _axis_tuple(replicate, "replicate") if replicate else ()
    if not main:
        raise ScheduleError(f"data_parallel: axis names no mesh axis; use one or more of {list(mesh.names)}")
    every = main + rep
    dup = sorted({a for a in every if every.count(a) > 1})
    if dup:
        raise ScheduleError(f"data_parallel: mesh axes {dup} are named twice (axis={main}, replicate={rep}); "
                            f"name each data-parallel axis once")
    unknown = [a for a in every if a not in mesh.names]
    if unknown:
        raise ScheduleError(f"data_parallel: mesh axes {unknown} do not exist; {mesh} has axes {list(mesh.names)}")
    if rep and not shard:
        raise ScheduleError(f"data_parallel: replicate={rep} needs shard=True (HSDP: shard over axis={main}, "
                            f"replicate over {rep}); DDP already replicates over every axis: write "
                            f"data_parallel(axis={every})")
    if not reshard_after_forward and not shard:
        raise ScheduleError("data_parallel: reshard_after_forward=False applies to FSDP2 (shard=True); DDP keeps "
                            "whole parameters anyway")
    order = {a: i for i, a in enumerate(mesh.names)}
    axes = tuple(sorted(every, key=order.__getitem__))
    shard_axes = tuple(sorted(main, key=order.__getitem__)) if shard else ()
    return DataParallel(axes, shard_axes, reshard_after_forward)


__all__ = ["DataParallel", "make_data_parallel"]
