"""Constraints a user states: pins on parameters (tied parameters pinned together), and a partial schedule's shard /
data_parallel / checkpoint records turned into pins, a fixed data-parallel role and minimum checkpoints."""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from ..errors import PlanError
from ..placement import ANY_SHARD, R
from .capture import CapturedGraph
from .cost_graph import CostGraph, Roles


def tied_pins(model: nn.Module, pins: dict[str, dict[str, int | str]],
              graph: CapturedGraph | None = None) -> dict[str, dict[str, int | str]]:
    """`pins` plus, for a tied parameter one of whose names a pin matches, the same pin on its other names (those
    `graph` holds, when given): the captured graph reads a tied parameter under one of them (GPT-2's embedding
    and head both read ``lm_head.weight``), so a pin on another name would bind nothing. Raises PlanError when
    two pins give one tied parameter different placements."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    out = dict(pins)
    for names in (g for g in groups.values() if len(g) > 1):
        hits = {pat: per for pat, per in pins.items() if any(fnmatch.fnmatchcase(n, pat) for n in names)}
        if not hits:
            continue
        placements = {tuple(sorted(per.items(), key=str)) for per in hits.values()}
        if len(placements) > 1:
            raise PlanError(f"pins {sorted(hits)} give the tied parameter {names} different placements "
                            f"{[dict(p) for p in placements]}; pin it once")
        per = next(iter(hits.values()))
        for n in names:
            if graph is None or n in graph.params:
                out.setdefault(n, dict(per))
        if graph is not None:  # a pattern bound only through a tied twin: the twin's pin stands for it
            for pat in hits:
                if not any(fnmatch.fnmatchcase(gp, pat) for gp in graph.params):
                    out.pop(pat, None)
    return out


def pins_for(graph: CapturedGraph, pins: dict[str, dict[str, int | str]], roles: Roles) -> dict | None:
    """Pins as {captured param: placement per tensor axis}; None when a pin cannot hold under `roles`."""
    out: dict[str, tuple[int, ...]] = {}
    for pattern, per_axis in pins.items():
        matched = [p for p in graph.params if fnmatch.fnmatchcase(p, pattern)]
        if not matched:
            raise PlanError(f"pin {pattern!r} matches no parameter; parameters look like {sorted(graph.params)[:4]}")
        for axis, val in per_axis.items():
            if axis not in roles.tp and pin_code(val) != R:
                return None
        pl = tuple(pin_code(per_axis.get(a, "R")) for a in roles.tp)
        for p in matched:
            out[p] = pl
    return out


def pin_code(val: Any) -> int:
    """A pin value's code on one axis: R ("R", "replicate", None), ANY_SHARD ("S": sharded, the solver picks the
    dim) or the dim (an int, "S<dim>")."""
    if val in ("R", "replicate", None):
        return R
    if isinstance(val, str) and val.strip().upper() == "S":
        return ANY_SHARD
    return int(str(val).lstrip("S"))



def pins_from_schedule(sch) -> tuple[dict[str, dict[str, int]], dict[str, Any], list[str]]:
    """A partial schedule's records as constraints: shard -> pins, data_parallel -> role, checkpoint -> paths,
    cut_pipeline_stage -> stage boundaries every pipelined plan keeps, pipeline -> its axis, schedule and
    micro-batch count (role keys pp_axis, pp_cuts, pp_schedule, pp_microbatches), float8 -> its recipe in every plan
    (role key float8; the blocks the planner converts are its own: the recorded path is not kept)."""
    pins: dict[str, dict[str, int]] = {}
    role: dict[str, Any] = {}
    ckpts: list[str] = []
    for r in sch.records:
        op, path, args = r.op, r.path, dict(r.args)
        if op == "shard":
            names = args.get("*")
            for nm in ([names] if isinstance(names, str) else names):
                full = f"{path}.{nm}" if path else nm
                pins.setdefault(full, {})[args["axis"]] = int(args["dim"])
        elif op == "data_parallel":
            axis, rep = args.get("axis", "dp"), args.get("replicate") or ()
            axes = [axis] if isinstance(axis, str) else list(axis)
            reps = [rep] if isinstance(rep, str) else list(rep)
            role = {"dp": tuple(axes + reps), "zero": bool(args.get("shard", False)), "replicate": tuple(reps),
                    "reshard_after_forward": bool(args.get("reshard_after_forward", True))}
        elif op == "checkpoint":
            ckpts.append(path)
        elif op == "cut_pipeline_stage":  # a stage boundary every pipeline plan keeps (NOTE [pipeline in the plan])
            role["pp_cuts"] = (*role.get("pp_cuts", ()), path)
        elif op == "pipeline":  # the pipeline's axis, schedule and micro-batches
            role.update(pp_axis=args["axis"], pp_schedule=args["schedule"], pp_microbatches=int(args["n_microbatches"]))
        elif op == "float8":  # every plan uses float8 (NOTE [execution and float8 in the plan])
            role["float8"] = args.get("recipe", "tensorwise")
        else:
            raise PlanError(f"partial schedule: primitive {op!r} at {path!r} cannot be a planner constraint; "
                            f"use shard, data_parallel, checkpoint, cut_pipeline_stage, pipeline and float8 in a "
                            f"partial schedule")
    return pins, role, ckpts


def min_ckpt(cg: CostGraph, paths: list[str]) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in paths:
        for t, info in cg.templates.items():
            if p in info.members:
                out[t] = out.get(t, 0) + 1
                break
        else:
            raise PlanError(f"partial schedule checkpoints {p!r}, which is not a repeated block the planner "
                            f"decides; blocks look like {[i.path for i in cg.templates.values()][:3]}")
    return out
