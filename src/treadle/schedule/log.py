"""The schedule's log: one record per applied primitive, round-tripped through JSON and printed as Python.

A record is plain data: the primitive's name, the sub-schedule path it applies to, and its arguments.
Placements serialise as ``{"placement": "Shard", "dim": 0}``; callables and modules as import paths
(`Ref`) or, for a module instance, its pickled bytes, so a replay rebuilds the same thing.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..errors import ScheduleError


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


def decode(v: Any) -> Any:
    if isinstance(v, list):
        return [decode(x) for x in v]
    if isinstance(v, dict):
        if "placement" in v:
            kind = v["placement"]
            if kind == "Shard":
                return Shard(v["dim"])
            if kind == "Replicate":
                return Replicate()
            if kind == "Partial":
                return Partial(v.get("reduce_op", "sum"))
            raise ScheduleError(f"unknown placement {kind!r} in schedule JSON")
        if "ref" in v:
            return Ref(v["ref"], **{k: decode(x) for k, x in v["kwargs"].items()})
        if "module_pickle" in v:
            return torch.load(io.BytesIO(base64.b64decode(v["module_pickle"])), weights_only=False)
        if "type" in v:
            return Ref(v["type"]).load()
        if "dict" in v:
            return {k: decode(x) for k, x in v["dict"].items()}
    return v


def records_to_json(records: list[Record], *, mesh_shape: tuple[int, ...], mesh_names: tuple[str, ...]) -> str:
    doc = {
        "format": "treadle.schedule/1",
        "mesh": {"shape": list(mesh_shape), "names": list(mesh_names)},
        "records": [{"op": r.op, "path": r.path, "args": {k: encode(a) for k, a in r.args.items()}} for r in records],
    }
    return json.dumps(doc, indent=1)


def records_from_json(text: str) -> tuple[dict, list[Record]]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"schedule JSON does not parse: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != "treadle.schedule/1":
        raise ScheduleError("not a treadle schedule: expected a JSON object with format 'treadle.schedule/1'")
    recs = [Record(r["op"], r["path"], {k: decode(a) for k, a in r["args"].items()}) for r in doc["records"]]
    return doc["mesh"], recs
