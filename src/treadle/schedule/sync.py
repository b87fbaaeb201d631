"""The `sync` primitive: a layout change at a module boundary, stated by its collective (Slapo style) or by the
layout wanted (typed), recorded as a `SyncSpec` for build to derive or check (a mixin of `Schedule`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..errors import ScheduleError
from .state import SyncSpec

if TYPE_CHECKING:  # (annotations only: core's Schedule mixes this class in)
    from .core import Schedule

SyncMode = Literal["fwd_pre", "fwd_post", "bwd_post"]
SYNC_MODES = ("fwd_pre", "fwd_post", "bwd_post")
# op -> keyword arguments it requires
SYNC_OPS: dict[str, tuple[str, ...]] = {
    "all_reduce": (),
    "all_gather": ("dim",),
    "reduce_scatter": ("dim",),
    "split": ("dim",),
    "all_to_all": ("split_dim", "concat_dim"),
}
# op -> keyword arguments it may take: all_gather's backward; split of the inner factor of a flattened dim
# (``inner=h``: dim is (outer x h) flattened, each rank keeps its h/n of every outer entry, e.g. ALiBi's
# batch x heads)
_SYNC_OPTIONS: dict[str, tuple[str, ...]] = {"all_gather": ("grad",), "split": ("inner",)}


class SyncPrimitive:
    """`Schedule.sync` and its checks (the schedule provides `_state`, `mesh`, `_where`, `_check_axis`,
    `_check_not_built`, `_record`)."""

    def sync(self, mode: SyncMode, *, op: str | None = None, axis: str | None = None,
             to: Placement | list[Placement] | None = None, from_: Placement | list[Placement] | None = None,
             arg: int | str = 0, out: int = 0, **kwargs: Any) -> "Schedule":
        """Change the layout of a tensor at this module's boundary.

        Modes: ``fwd_pre`` (an input, before forward), ``fwd_post`` (the output, after forward), ``bwd_post``
        (the gradient of an input, after backward). Explicit ops: ``all_reduce``, ``all_gather(dim)``,
        ``reduce_scatter(dim)``, ``split(dim)`` (``inner=h``: split the inner factor h of a flattened dim),
        ``all_to_all(split_dim, concat_dim)``, each over `axis`,
        each with its adjoint in backward (see `treadle.runtime.collectives`). Typed form:
        ``to=Replicate()`` (with `axis`) or ``to=[...]`` (one placement per mesh axis) derives the
        collective(s) from the layout this module produces (sharded Linear/Conv1D/Embedding leaves) or
        from ``from_``; a fwd_pre input is Replicate unless ``from_`` says otherwise.
        `arg` picks the input (position or parameter name; default the first), `out` the output of a tuple.
        Raises ScheduleError on an unknown mode, op, axis, or a missing dim.
        """
        self._check_not_built("sync")
        if mode not in SYNC_MODES:
            raise ScheduleError(f"sync at {self._where()}: unknown mode {mode!r}; use one of {list(SYNC_MODES)}")
        if (op is None) == (to is None):
            raise ScheduleError(f"sync at {self._where()}: give exactly one of op= (explicit collective) "
                                f"or to= (target layout)")
        if not isinstance(out, int) or isinstance(out, bool) or out < 0:
            raise ScheduleError(f"sync at {self._where()}: out= must be an output index >= 0, got {out!r}")
        if out and mode != "fwd_post":
            raise ScheduleError(f"sync at {self._where()}: out= picks an output, so it needs mode 'fwd_post'")
        if not isinstance(arg, (int, str)) or isinstance(arg, bool) or (isinstance(arg, int) and arg < 0):
            raise ScheduleError(f"sync at {self._where()}: arg= must be an input position >= 0 or a name, got {arg!r}")
        for k in ("dim", "split_dim", "concat_dim"):
            if k in kwargs and (not isinstance(kwargs[k], int) or isinstance(kwargs[k], bool)):
                raise ScheduleError(f"sync at {self._where()}: {k} must be an integer tensor dim, got {kwargs[k]!r}")
        args: dict[str, Any] = {"*": mode}
        to_t = from_t = None
        if op is not None:
            if op not in SYNC_OPS:
                raise ScheduleError(f"sync at {self._where()}: unknown op {op!r}; use one of {list(SYNC_OPS)}")
            if axis is None:
                raise ScheduleError(f"sync at {self._where()}: op={op!r} needs axis= (a mesh axis: {list(self.mesh.names)})")
            self._check_axis(axis, "sync")
            missing = [k for k in SYNC_OPS[op] if k not in kwargs]
            if missing:
                raise ScheduleError(f"sync at {self._where()}: op={op!r} needs {missing}")
            allowed = set(SYNC_OPS[op]) | set(_SYNC_OPTIONS.get(op, ()))
            extra = sorted(set(kwargs) - allowed)
            if extra:
                raise ScheduleError(f"sync at {self._where()}: op={op!r} takes {sorted(allowed)}, not {extra}")
            inner = kwargs.get("inner")
            if op == "split" and inner is not None and (not isinstance(inner, int) or isinstance(inner, bool) or inner < 1
                                  or inner % self.mesh.size(axis)):
                raise ScheduleError(f"sync at {self._where()}: split inner={inner!r} must be a positive multiple of the "
                                    f"size {self.mesh.size(axis)} of axis {axis!r}")
            if op == "all_gather" and kwargs.get("grad", "split") not in ("split", "reduce_scatter"):
                raise ScheduleError(f"sync at {self._where()}: all_gather grad must be 'split' or 'reduce_scatter'")
            args.update(op=op, axis=axis, **kwargs)
        else:
            if kwargs:
                raise ScheduleError(f"sync at {self._where()}: typed form takes to=/from_=/axis=, not {sorted(kwargs)}")
            to_t = self._placements(to, axis, "to")
            from_t = self._placements(from_, axis, "from_") if from_ is not None else None
            args.update(to=to)
            if axis is not None:
                args["axis"] = axis
            if from_ is not None:
                args["from_"] = from_
        if arg != 0:
            args["arg"] = arg
        if out != 0:
            args["out"] = out
        spec = SyncSpec(self.path, mode, axis, op, tuple(sorted(kwargs.items())), to_t, from_t, arg, out)
        self._state.syncs.append(spec)
        self._record("sync", args)
        return self

    def _placements(self, p: Placement | list[Placement], axis: str | None, what: str) -> tuple:
        if isinstance(p, (list, tuple)):
            if axis is not None:
                raise ScheduleError(f"sync at {self._where()}: {what}= is a list (one placement per mesh axis), "
                                    f"so leave axis= out")
            if len(p) != self.mesh.ndim:
                raise ScheduleError(f"sync at {self._where()}: {what}= has {len(p)} placements but {self.mesh} "
                                    f"has {self.mesh.ndim} axes")
            pairs = tuple(zip(self.mesh.names, p))
        else:
            if axis is None:
                if self.mesh.ndim != 1:
                    raise ScheduleError(f"sync at {self._where()}: give axis= with a single placement on {self.mesh}")
                axis = self.mesh.names[0]
            self._check_axis(axis, "sync")
            pairs = ((axis, p),)
        for ax, pl in pairs:
            if not isinstance(pl, (Shard, Replicate, Partial)):
                raise ScheduleError(f"sync at {self._where()}: {what}= for axis {ax!r} must be Shard(dim), "
                                    f"Replicate() or Partial(), got {pl!r}")
        return pairs
