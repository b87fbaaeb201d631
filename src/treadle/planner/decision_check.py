"""A plan file's decisions are data: each decision's op and arguments checked by kind, before any is applied.

`check_decision` is what `Decision.from_dict` runs on every decision a plan file holds, and `apply_decisions`
resolves a ``set_attr`` Ref through the same gate as a schedule file's records (`Ref.from_file`, NOTE [files
are data] in treadle.schedule.gate): a decision can name only what a schedule file can.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import PlanError, ScheduleError
from ..schedule.expert_primitive import is_load_imbalance
from ..schedule.checkpoint_policies import POLICY_NAMES

_PLACEMENT = re.compile(r"R|P|S\d{1,4}")  # Replicate, Partial, Shard(dim)
_MODES = ("fwd_post", "fwd_pre", "bwd_post")
_SCALARS = (str, int, float, bool, type(None))


def _str(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 1000


def _strs(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= 10_000 and all(_str(x) for x in v)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31


def _count(v: Any) -> bool:
    return _int(v) and v >= 1


def _placement(v: Any) -> bool:
    return isinstance(v, str) and _PLACEMENT.fullmatch(v) is not None


def _layout(v: Any) -> bool:
    return (isinstance(v, dict) and set(v) == {"from", "to"}
            and all(isinstance(m, dict) and all(_str(a) and _placement(p) for a, p in m.items()) for m in v.values()))


def _kwargs(v: Any) -> bool:
    return isinstance(v, dict) and all(_str(k) and isinstance(x, _SCALARS) and not _nan(x) for k, x in v.items())


def _nan(x: Any) -> bool:
    return isinstance(x, float) and not math.isfinite(x)


def _inputs(v: Any) -> bool:
    """Example inputs as a spec: name -> {"shape": [ints >= 0], "dtype": name} or a JSON scalar (the sizes and the
    dtype's name are checked again where inputs are made: `treadle.schedule.graph_primitives.make_inputs`)."""
    def one(x: Any) -> bool:
        if isinstance(x, dict):
            return (set(x) == {"shape", "dtype"} and isinstance(x["shape"], list)
                    and all(_int(d) and d >= 0 for d in x["shape"]) and _str(x["dtype"]))
        return x is None or (isinstance(x, _SCALARS) and not _nan(x))
    return isinstance(v, dict) and all(_str(k) and one(x) for k, x in v.items())


_CHECKS = {"str": _str, "strs": _strs, "str|strs": lambda v: _str(v) or _strs(v), "int": _int, "count": _count,
           "bool": lambda v: isinstance(v, bool), "mode": lambda v: v in _MODES, "placement": _placement,
           "layout": _layout, "kwargs": _kwargs, "inputs": _inputs,
           "load": is_load_imbalance, "policy name": lambda v: isinstance(v, str) and v in POLICY_NAMES}
# op -> argument -> kind; a kind ending in "?" is optional
DECISION_ARGS: dict[str, dict[str, str]] = {
    "shard": {"names": "str", "dim": "int", "axis": "str", "blocks": "count?"},
    "sync": {"mode": "mode", "to": "placement", "from_": "placement", "axis": "str", "layout": "layout?"},
    "reduce_grads": {"axis": "str", "names": "strs"},
    "fork_rng": {"axis": "str"},
    "shard_attr": {"name": "str", "axis": "str"},
    "checkpoint": {"policy": "policy name?"},
    "set_attr": {"name": "str", "ref": "str", "kwargs": "kwargs"},
    "data_parallel": {"axis": "str|strs", "shard": "bool", "replicate": "str|strs?", "reshard_after_forward": "bool?"},
    "expert_parallel": {"axis": "str|strs", "tensor": "str?", "load_imbalance": "load?"},
    "float8": {"recipe": "str", "all_gather": "bool", "skip": "strs?"},
    "cut_pipeline_stage": {},
    "pipeline": {"axis": "str", "schedule": "str", "n_microbatches": "count", "example_inputs": "inputs",
                 "target": "str?"},
}


def check_decision(op: Any, path: Any, args: Any, why: Any, *, where: str) -> None:
    """Raise PlanError naming `where` (file and decision index), the op and the argument unless the decision
    is one `apply_decisions` knows with arguments of the kinds it takes (`DECISION_ARGS`), and a ``set_attr``
    names a Ref a file may name (treadle.schedule.gate)."""
    if op not in DECISION_ARGS:
        raise PlanError(f"{where}: unknown decision op {op!r:.80}; a plan holds only {sorted(DECISION_ARGS)}")
    if not _str(path) or not isinstance(why, str):
        raise PlanError(f"{where} ({op}): path and why must be strings, got {path!r:.80} and {why!r:.80}")
    if not isinstance(args, dict):
        raise PlanError(f"{where} ({op} at {path!r}): args must be an object, got {type(args).__name__}")
    if op == "set_attr":  # the name first: a refusal of the name says so, whatever else is wrong
        decision_ref({"ref": args.get("ref"), "kwargs": {}}, where=f"{where} ({op} at {path!r})")
    spec = DECISION_ARGS[op]
    extra = sorted(set(args) - set(spec))
    if extra:
        raise PlanError(f"{where} ({op} at {path!r}): unknown arguments {extra[:5]}; {op} takes {sorted(spec)}")
    for name, kind in spec.items():
        if name not in args:
            if not kind.endswith("?"):
                raise PlanError(f"{where} ({op} at {path!r}): missing argument {name!r}")
            continue
        if not _CHECKS[kind.rstrip("?")](args[name]):
            raise PlanError(f"{where} ({op} at {path!r}): argument {name!r} must be {kind.rstrip('?')}, got "
                            f"{args[name]!r:.80}")
    if op == "set_attr":
        decision_ref(args, where=f"{where} ({op} at {path!r})")


def decision_ref(args: dict, *, where: str) -> Any:
    """The `treadle.Ref` of a ``set_attr`` decision, through the gate (pinned to the object it names).
    Raises PlanError naming `where` and the Ref's target when a file may not name it."""
    from ..schedule.gate import check_call
    from ..schedule.log import Ref

    try:
        ref = Ref.from_file(args.get("ref"), args.get("kwargs", {}), where=where)
        check_call(ref.load(), (), ref.kwargs, name=ref.target, where=where)  # build calls it with these
    except ScheduleError as exc:
        raise PlanError(str(exc)) from None
    return ref


__all__ = ["check_decision", "decision_ref", "DECISION_ARGS"]
