"""The schedule's log: one record per applied primitive, round-tripped through JSON and printed as Python.

A record is plain data: the primitive's name, the sub-schedule path it applies to, and its arguments.
Placements serialise as ``{"placement": "Shard", "dim": 0}``; callables and modules as import paths
(`Ref`) or, for a module instance, its pickled bytes, so a replay rebuilds the same thing.

NOTE [files are data]: reading a schedule or plan file runs no code the program did not allow. A `Ref` read
from JSON resolves only to ``treadle.*`` or to a target registered with `register_ref` (or passed in
`allow_refs`); a pickled module (a ``replace`` with a module instance) loads only with ``allow_pickle=True``.
A Ref made in code (`Ref.of`, a factory passed to ``replace``) is the program's own and needs no allowing.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..errors import ScheduleError

_T = TypeVar("_T")
_REGISTERED: set[str] = set()  # "package.module:attribute" targets the program allowed in files


def register_ref(obj: _T) -> _T:
    """Allow schedule and plan files to name `obj` (a module-level function or class) in a `Ref`.
    Usable as a decorator; returns `obj`. ``treadle.*`` targets are always allowed.
    Raises ScheduleError for a lambda or a local function (not importable by name)."""
    _REGISTERED.add(Ref.of(obj).target)
    return obj


def ref_allowed(target: str, extra: Iterable[str] = ()) -> bool:
    """True when a file may name `target`: under ``treadle``, registered, or in `extra`."""
    module = target.partition(":")[0]
    return module == "treadle" or module.startswith("treadle.") or target in _REGISTERED or target in set(extra)


def _check_allowed(target: str, what: str, extra: Iterable[str]) -> None:
    if not ref_allowed(target, extra):
        raise ScheduleError(
            f"schedule file names {what} {target!r}, which is not allowed: a file may only name treadle.* "
            f"and targets your code registered; if you trust it, call treadle.register_ref(<that object>) "
            f"before loading (NOTE [files are data])")


@dataclass(frozen=True)
class Ref:
    """A reference to an importable callable plus keyword arguments: ``Ref("pkg.mod:Name", axis="tp")``.

    `resolve()` imports the target and calls it with the kwargs. Used for values a schedule stores that
    are code (a loss function object, a module factory), so the log stays JSON.
    """

    target: str
    kwargs: dict = field(default_factory=dict)

    def __init__(self, target: str, **kwargs: Any):
        if ":" not in target:
            raise ScheduleError(f"Ref target must look like 'package.module:attribute', got {target!r}")
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "kwargs", dict(kwargs))

    def __hash__(self) -> int:
        return hash((self.target, json.dumps(self.kwargs, sort_keys=True, default=str)))

    def load(self) -> Any:
        mod_name, _, attr = self.target.partition(":")
        try:
            obj: Any = importlib.import_module(mod_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise ScheduleError(f"cannot import {self.target!r}: {exc}") from exc
        return obj

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
        torch.save(v, buf)
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


def decode(v: Any, *, allow_refs: Iterable[str] = (), allow_pickle: bool = False) -> Any:
    """Inverse of `encode`. Refs and types must pass the allow-list; pickled modules need `allow_pickle`
    (NOTE [files are data]). Raises ScheduleError naming the refused target or field."""
    kw = dict(allow_refs=allow_refs, allow_pickle=allow_pickle)
    if isinstance(v, list):
        return [decode(x, **kw) for x in v]
    if isinstance(v, dict):
        if "placement" in v:
            kind = v["placement"]
            if kind == "Shard":
                dim = v.get("dim")
                if not isinstance(dim, int) or isinstance(dim, bool):
                    raise ScheduleError(f"schedule JSON: Shard needs an integer dim, got {dim!r}")
                return Shard(dim)
            if kind == "Replicate":
                return Replicate()
            if kind == "Partial":
                return Partial(v.get("reduce_op", "sum"))
            raise ScheduleError(f"unknown placement {kind!r} in schedule JSON")
        if "ref" in v:
            if not isinstance(v["ref"], str):
                raise ScheduleError(f"schedule JSON: a ref must be a string, got {v['ref']!r}")
            _check_allowed(v["ref"], "the callable", allow_refs)
            return Ref(v["ref"], **{k: decode(x, **kw) for k, x in v.get("kwargs", {}).items()})
        if "module_pickle" in v:
            if not allow_pickle:
                raise ScheduleError(
                    f"schedule file holds a pickled module ({v.get('class', '?')}), and unpickling runs code; "
                    f"it is refused by default. If you wrote the file, load it in Python with "
                    f"load_schedule(..., allow_pickle=True), or replace with a registered factory instead")
            return torch.load(io.BytesIO(base64.b64decode(v["module_pickle"])), weights_only=False)
        if "type" in v:
            return _load_type(v["type"], allow_refs)
        if "dict" in v:
            return {k: decode(x, **kw) for k, x in v["dict"].items()}
    return v


def _load_type(target: str, allow_refs: Iterable[str]) -> type:
    """A class named by a file: allowed targets import as Refs do; any other is only looked up in a module
    the program has already imported (a model's own classes), never imported, and must be a class."""
    if ref_allowed(target, allow_refs):
        return Ref(target).load()
    mod_name, _, attr = target.partition(":")
    obj: Any = sys.modules.get(mod_name)
    for part in attr.split(".") if obj is not None else ():
        obj = getattr(obj, part, None)
    if not isinstance(obj, type):
        _check_allowed(target, "the type (not a class of an imported module)", allow_refs)
    return obj


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


def records_from_json(text: str, *, allow_refs: Iterable[str] = (), allow_pickle: bool = False,
                      source: str = "schedule JSON") -> tuple[dict, list[Record]]:
    """(mesh dict, records) from `records_to_json` text; `source` (e.g. the file name) prefixes errors.
    Raises ScheduleError on malformed JSON or a refused Ref / pickle (see `decode`)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"{source} does not parse: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != "treadle.schedule/1":
        raise ScheduleError(f"{source} is not a treadle schedule: expected a JSON object with format "
                            f"'treadle.schedule/1'")
    try:
        mesh = doc["mesh"]
        recs = [Record(r["op"], r["path"], {k: decode(a, allow_refs=allow_refs, allow_pickle=allow_pickle)
                                            for k, a in r["args"].items()}) for r in doc["records"]]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ScheduleError(f"{source} is malformed: missing or wrong field ({type(exc).__name__}: {exc})") from None
    except ScheduleError as exc:
        raise ScheduleError(f"{source}: {exc}") from None
    return mesh, recs
