"""The schedule's log: one record per applied primitive, round-tripped through JSON and printed as Python.

A record is plain data: the primitive's name, the sub-schedule path it applies to, and its arguments.
Placements serialise as ``{"placement": "Shard", "dim": 0}``; callables and modules as import paths
(`Ref`) or, for a module instance, its pickled bytes, so a replay rebuilds the same thing.

NOTE [files are data] (stated in treadle.schedule.gate): reading a schedule or plan file runs no code the
program did not allow. Every name a file holds passes the gate (`treadle.schedule.gate.resolve_callable`,
`resolve_class`): treadle's exported names, names registered with `register_ref`, classes of imported
modules where a class is expected, or the `allow_refs` a program passes for its own schedule; a Ref read
from a file is pinned to the object the gate found, so nothing is imported later either. A pickled module
(a ``replace`` with a module instance) loads only with ``allow_pickle=True``. A Ref made in code (`Ref.of`, a
factory passed to ``replace``) is the program's own and needs no allowing.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..transport import restore_after_load, sendable
from ..errors import ScheduleError
from . import gate

_T = TypeVar("_T")


def register_ref(obj: _T) -> _T:
    """Allow schedule and plan files to name `obj` (a module-level function or class) in a `Ref`, by its
    exact ``module:QualName``; a file naming it gets this very object (nothing is imported). Usable as a
    decorator; returns `obj`. Raises ScheduleError for a lambda or a local function (not nameable)."""
    gate.register(Ref.of(obj).target, obj)
    return obj


@dataclass(frozen=True)
class Ref:
    """A reference to an importable callable plus keyword arguments: ``Ref("pkg.mod:Name", axis="tp")``.

    `resolve()` imports the target and calls it with the kwargs. Used for values a schedule stores that
    are code (a loss function object, a module factory), so the log stays JSON.
    """

    target: str
    kwargs: dict = field(default_factory=dict)
    _obj: Any = field(default=None, compare=False, repr=False)  # what the gate resolved a file's Ref to

    def __init__(self, target: str, **kwargs: Any):
        if not isinstance(target, str) or ":" not in target:
            raise ScheduleError(f"Ref target must look like 'package.module:attribute', got {target!r}")
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "kwargs", dict(kwargs))
        object.__setattr__(self, "_obj", None)

    @staticmethod
    def from_file(target: Any, kwargs: Any = None, *, where: str, trusted: Collection[str] = ()) -> "Ref":
        """A Ref that a file names, through the gate (NOTE [files are data]): `target` must be exported,
        registered or `trusted`; the Ref keeps the object found (`load` imports nothing) and its `kwargs` must
        bind to its signature. Raises ScheduleError naming `where` and the target."""
        obj = gate.resolve_callable(target, where=where, trusted=trusted)
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ScheduleError(f"{where}: the keyword arguments of {target!r} must be an object, got {kwargs!r}")
        gate.check_call(obj, (), kwargs, name=target, where=where, partial=True)
        ref = Ref(target, **kwargs)
        object.__setattr__(ref, "_obj", obj)
        return ref

    def __hash__(self) -> int:
        return hash((self.target, json.dumps(self.kwargs, sort_keys=True, default=str)))

    def load(self) -> Any:
        """The target object: for a Ref read from a file, the one the gate found; for a Ref made in code,
        imported by its name (the program's own)."""
        if self._obj is not None:
            return self._obj
        return gate.import_by_name(self.target)

    def resolve(self) -> Any:
        return self.load()(**self.kwargs)

    def __repr__(self) -> str:
        args = "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
        return f"Ref({self.target!r}{args})"

    @staticmethod
    def of(fn: Any) -> "Ref":
        """A Ref to a module-level function or class (raises ScheduleError for lambdas and locals)."""
        qual = getattr(fn, "__qualname__", "")
        mod = getattr(fn, "__module__", None)
        if not mod or "<" in qual:
            raise ScheduleError(f"{fn!r} is not importable by name (a lambda or a local function); "
                                f"define it at module level so the schedule can be saved and replayed")
        return Ref(f"{mod}:{qual}")


@dataclass(frozen=True)
class Record:
    """One applied primitive: ``sch[path].<op>(**args)`` (path "" is the root)."""

    op: str
    path: str
    args: dict

    def to_python(self) -> str:
        target = "sch" if not self.path else f"sch[{self.path!r}]"
        parts = []
        for k, v in self.args.items():
            if k.startswith("_"):
                continue
            parts.append(repr(v) if k == "*" else f"{k}={_py(v)}")
        return f"{target}.{self.op}({', '.join(parts)})"


def _py(v: Any) -> str:
    if isinstance(v, Placement):
        return repr(v) if not isinstance(v, Shard) else f"Shard({v.dim})"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(_py(x) for x in v)
        return f"[{inner}]" if isinstance(v, list) else f"({inner}{',' if len(v) == 1 else ''})"
    if isinstance(v, torch.nn.Module):
        return f"<{type(v).__name__} module>"
    if isinstance(v, type):
        return f"{v.__module__}.{v.__qualname__}"
    return repr(v)


# ---------------------------------------------------------------------------------------------- JSON
def encode(v: Any) -> Any:
    """Plain-JSON form of a record argument."""
    if isinstance(v, Shard):
        return {"placement": "Shard", "dim": v.dim}
    if isinstance(v, Replicate):
        return {"placement": "Replicate"}
    if isinstance(v, Partial):
        return {"placement": "Partial", "reduce_op": v.reduce_op}
    if isinstance(v, Ref):
        return {"ref": v.target, "kwargs": {k: encode(x) for k, x in v.kwargs.items()}}
    if isinstance(v, torch.nn.Module):
        buf = io.BytesIO()
        torch.save(sendable(v), buf)
        return {"module_pickle": base64.b64encode(buf.getvalue()).decode("ascii"), "class": type(v).__qualname__}
    if isinstance(v, type):
        return {"type": f"{v.__module__}:{v.__qualname__}"}
    if isinstance(v, (list, tuple)):
        return [encode(x) for x in v]
    if isinstance(v, dict):
        return {"dict": {k: encode(x) for k, x in v.items()}}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise ScheduleError(f"cannot serialise schedule argument {v!r} of type {type(v).__name__}; "
                        f"use JSON values, placements, treadle.Ref or modules")


# Record arguments that hold a class, and those that hold code (a Ref or a module) a replay calls.
TYPE_ARGS = {("replace_all", "module_type"), ("trace", "leaves")}


def decode(v: Any, *, allow_refs: Collection[str] = (), allow_pickle: bool = False, where: str = "schedule JSON",
           types: bool = True) -> Any:
    """Inverse of `encode`. Every Ref and type passes the gate (NOTE [files are data]); a type only where
    `types` (a class argument, `TYPE_ARGS`) or when the caller trusts it (`allow_refs`); pickled modules need
    `allow_pickle`. Raises ScheduleError naming `where` and the refused target or field."""
    kw = dict(allow_refs=allow_refs, allow_pickle=allow_pickle, where=where, types=types)
    if isinstance(v, list):
        return [decode(x, **kw) for x in v]
    if isinstance(v, dict):
        if "placement" in v:
            kind = v["placement"]
            if kind == "Shard":
                dim = v.get("dim")
                if not isinstance(dim, int) or isinstance(dim, bool) or not -64 <= dim < 64:
                    raise ScheduleError(f"{where}: Shard needs an integer dim, got {dim!r:.40} (a tensor dim, "
                                        f"-64 <= dim < 64)")
                return Shard(dim)
            if kind == "Replicate":
                return Replicate()
            if kind == "Partial":
                op = v.get("reduce_op", "sum")
                if op not in ("sum", "avg", "max", "min", "product"):
                    raise ScheduleError(f"{where}: Partial reduce_op {op!r} is not one of sum, avg, max, min, product")
                return Partial(op)
            raise ScheduleError(f"{where}: unknown placement {kind!r}; use Shard, Replicate or Partial")
        if "ref" in v:
            kwargs = v.get("kwargs", {})
            if not isinstance(kwargs, dict):
                raise ScheduleError(f"{where}: the kwargs of ref {v['ref']!r} must be an object, got {kwargs!r}")
            return Ref.from_file(v["ref"], {k: decode(x, **kw) for k, x in kwargs.items()}, where=where,
                                 trusted=allow_refs)
        if "module_pickle" in v:
            if not allow_pickle:
                raise ScheduleError(
                    f"{where}: holds a pickled module ({v.get('class', '?')!s:.80}), and unpickling runs code; "
                    f"it is refused by default. If you wrote the file, load it in Python with "
                    f"load_schedule(..., allow_pickle=True), or replace with a registered factory instead")
            module = torch.load(io.BytesIO(base64.b64decode(v["module_pickle"])), weights_only=False)
            restore_after_load(module)  # NOTE [registrations lost in transport]
            return module
        if "type" in v:
            if not types and not (isinstance(v["type"], str) and v["type"] in allow_refs):
                raise ScheduleError(f"{where}: names the type {v['type']!r:.80} where no class is expected; a file "
                                    f"may name a class only as replace_all's module_type or trace's leaves")
            return gate.resolve_class(v["type"], where=where, trusted=allow_refs)
        if "dict" in v:
            if not isinstance(v["dict"], dict):
                raise ScheduleError(f"{where}: an encoded dict must hold an object, got {type(v['dict']).__name__}")
            return {k: decode(x, **kw) for k, x in v["dict"].items()}
    return v


def ref_targets(records: list[Record]) -> set[str]:
    """Every Ref and type target in `records` (a program's own schedule: what its ranks may load)."""
    out: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, Ref):
            out.add(v.target)
            for x in v.kwargs.values():
                walk(x)
        elif isinstance(v, type):
            out.add(f"{v.__module__}:{v.__qualname__}")
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    for r in records:
        walk(r.args)
    return out


def records_to_json(records: list[Record], *, mesh_shape: tuple[int, ...], mesh_names: tuple[str, ...]) -> str:
    doc = {
        "format": "treadle.schedule/1",
        "mesh": {"shape": list(mesh_shape), "names": list(mesh_names)},
        "records": [{"op": r.op, "path": r.path, "args": {k: encode(a) for k, a in r.args.items()}} for r in records],
    }
    return json.dumps(doc, indent=1)


def records_from_json(text: str, *, allow_refs: Collection[str] = (), allow_pickle: bool = False,
                      source: str = "schedule JSON") -> tuple[dict, list[Record]]:
    """(mesh dict, records) from `records_to_json` text; `source` (e.g. the file name) and the record's
    index, op and path prefix errors. Raises ScheduleError on malformed or too deeply nested JSON, an unknown
    field, or a refused name or pickle (see `decode`, NOTE [files are data])."""
    doc = gate.parse_json(text, source=source)
    if not isinstance(doc, dict) or doc.get("format") != "treadle.schedule/1":
        raise ScheduleError(f"{source} is not a treadle schedule: expected a JSON object with format "
                            f"'treadle.schedule/1'")
    allow_refs = frozenset(allow_refs)
    mesh, raw = doc.get("mesh"), doc.get("records")
    if not isinstance(mesh, dict) or not isinstance(raw, list):
        raise ScheduleError(f"{source} is malformed: missing or wrong field (it needs a 'mesh' object and a "
                            f"'records' list)")
    recs = []
    for i, r in enumerate(raw):
        if not (isinstance(r, dict) and isinstance(r.get("op"), str) and isinstance(r.get("path"), str)
                and isinstance(r.get("args"), dict)):
            raise ScheduleError(f"{source} is malformed: missing or wrong field in record {i} (it needs a string "
                                f"'op', a string 'path' and an 'args' object), got {json.dumps(r)[:120]}")
        where = f"{source}: record {i} ({r['op']!s:.40} at {r['path']!r:.80})"
        args = {k: decode(a, allow_refs=allow_refs, allow_pickle=allow_pickle, where=where,
                          types=(r["op"], k) in TYPE_ARGS) for k, a in r["args"].items()}
        recs.append(Record(r["op"], r["path"], args))
    return mesh, recs
