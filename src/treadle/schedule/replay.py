"""Replaying a schedule log on a model: `replay` (records, in order) and `load_schedule` (a JSON file).

A log read from a file is data (NOTE [files are data] in treadle.schedule.gate): its names passed the gate
when it was decoded (`treadle.schedule.log.records_from_json`); here only the primitives in `PRIMITIVES` are
applied, and a factory or Ref a record calls must bind to the arguments it will get. What replay refuses is a
ScheduleError naming the file, the record and the argument; a primitive's own error names its path and is
followed by the file and the record.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from ..errors import MeshError, ScheduleError, TreadleError
from ..mesh import Mesh
from .core import Schedule, create_schedule
from .gate import check_call
from .log import Record, Ref, records_from_json, ref_targets

# The primitives a log may hold (every method that records itself); `replay` calls nothing else.
PRIMITIVES = frozenset({
    "replace", "replace_all", "shard", "sync", "checkpoint", "fork_rng", "reduce_grads", "annotate", "set_attr",
    "shard_attr", "data_parallel",  # module-level (core.py)
    "expert_parallel",  # expert_primitive.py
    "float8",  # float8_primitive.py
    "trace", "replace_match", "decompose", "fuse", "checkpoint_match", "checkpoint_selective",
    "cut_pipeline_stage", "pipeline",  # graph-level (graph_primitives.py)
})
# what a malformed file's arguments raise inside a primitive; replay names the record instead
_BAD_ARGUMENT_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError)


def replay(sch: Schedule, records: list[Record], *, source: str = "schedule log") -> Schedule:
    """Apply logged records to a schedule, in order. Only `PRIMITIVES` are applied; a factory a record calls
    (``replace``, ``replace_all``) and a Ref ``set_attr`` resolves at build must bind to the arguments they
    will get (NOTE [files are data]). Raises ScheduleError naming `source`, the record and what is wrong."""
    for i, r in enumerate(records):
        where = f"{source}: record {i} ({r.op} at {r.path!r})"
        if r.op not in PRIMITIVES:
            raise ScheduleError(f"{where}: unknown primitive {r.op!r}; a schedule log holds only "
                                f"{sorted(PRIMITIVES)}")
        try:
            _apply(sch, r, where)
        except TreadleError as exc:  # a primitive's own error names its path; the record follows it
            if source in str(exc) or type(exc).__init__ is not Exception.__init__:  # named already, or own fields
                raise
            raise type(exc)(f"{exc} (in {where})") from None
        except _BAD_ARGUMENT_ERRORS as exc:
            raise ScheduleError(f"{where}: bad arguments {_short(r.args)} ({type(exc).__name__}: "
                                f"{str(exc)[:200]})") from None
    return sch


def _short(args: dict) -> str:
    text = repr(args)
    return text if len(text) <= 160 else text[:160] + "..."


def _apply(sch: Schedule, r: Record, where: str) -> None:
    sub = sch[r.path] if r.path else sch
    args = dict(r.args)
    pos = args.pop("*", None)
    fn = getattr(sub, r.op)
    if r.op in ("replace", "replace_match"):
        new = args.pop("new", None)
        if isinstance(new, Ref):
            new = new.load()
            if r.op == "replace":  # replace_match binds the match's inputs by name itself
                check_call(new, (sub.mod,), name="replace factory", where=where)
        elif not isinstance(new, nn.Module):
            raise ScheduleError(f"{where}: {r.op} needs new= a factory Ref or a module, got {_short({'new': new})}")
        fn(new, **args)
    elif r.op == "replace_all":
        factory = args.pop("factory", None)
        if not isinstance(factory, Ref):
            raise ScheduleError(f"{where}: replace_all needs factory= a Ref, got {_short({'factory': factory})}")
        factory = factory.load()
        check_call(factory, (sub.mod,), {k: v for k, v in args.items() if k != "module_type"},
                   name="replace_all factory", where=where, partial=True)
        fn(args.pop("module_type", None), factory, **args)
    elif r.op == "set_attr":
        value = args.get("value")
        if isinstance(value, Ref):
            check_call(value.load(), (), value.kwargs, name=value.target, where=where)
        fn(pos, **args)
    elif pos is not None:
        fn(pos, **args)
    else:
        fn(**args)


def load_schedule(model: nn.Module, json_text: str, mesh: Mesh | None = None, *, allow_refs: Iterable[str] = (),
                  allow_pickle: bool = False, source: str = "schedule JSON") -> Schedule:
    """Replay a schedule saved with `Schedule.to_json` on a fresh `model`. `mesh` defaults to the saved one;
    a different mesh must have the same axis names.

    The text is data (NOTE [files are data] in treadle.schedule.gate): a name it holds must be one treadle
    exports for files, one registered with `treadle.register_ref`, a class of an already imported module
    where a class is expected, or listed in `allow_refs` (exact names the caller trusts, e.g. from
    `trusted_load_args`); a pickled module loads only with ``allow_pickle=True``.
    Raises ScheduleError naming `source`, the record and the refused name."""
    saved, records = records_from_json(json_text, allow_refs=allow_refs, allow_pickle=allow_pickle, source=source)
    try:
        saved_mesh = Mesh(tuple(saved["shape"]), tuple(saved["names"]))
    except (KeyError, TypeError, ValueError, OverflowError, MeshError) as exc:
        raise ScheduleError(f"{source}: bad mesh {saved!r} ({exc})") from None
    if mesh is None:
        mesh = saved_mesh
    elif set(mesh.names) != set(saved_mesh.names):
        raise ScheduleError(f"load_schedule: the schedule was written for {saved_mesh}; {mesh} lacks axes "
                            f"{sorted(set(saved_mesh.names) - set(mesh.names))}")
    return replay(create_schedule(model, mesh=mesh), records, source=source)


def trusted_load_args(sch: Schedule) -> dict[str, Any]:
    """Keyword arguments for `load_schedule` that let a program's own schedule round-trip to its ranks
    (its Refs and pickled modules came from its code, not from a file)."""
    return {"allow_refs": sorted(ref_targets(sch._state.records)), "allow_pickle": True}
