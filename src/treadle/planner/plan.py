"""`plan_model`: capture, price, solve and emit — and the `Plan` it returns (data, JSON, diff, schedule).

The search is exact over *axis role assignments* (which mesh axis is data parallel, with or without
ZeRO-3; the others are tensor axes; axes can be forbidden) and, inside each, over every op's strategy and
each block template's checkpoint count (one MILP, `ilp.py`). ``mode="two_stage"`` instead fixes the
sharding ignoring activations and then picks checkpoints with the exact chain DP (`checkpoint_dp.py`).

A `Plan` is plain data: decisions (schedule primitives with the node that justifies each), the predicted
step time split by term, the peak memory, per-module rows, the binding constraint and solver statistics.
`Plan.schedule` applies the decisions to the model given to `plan_model` (or `schedule_for(model)` after
`Plan.load`). An infeasible budget raises PlanError stating the smallest budget any plan meets.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal

import torch
from torch import nn

from ..cost.cluster import ClusterSpec
from ..errors import PlanError
from ..form import forms
from ..mesh import Mesh
from ..pricing.result import Estimate
from ..profile.roofline import mfu as mfu_of
from .capture import CapturedGraph, capture
from .checkpoint_dp import ChainBlock, solve_chain
from .cost_graph import CostGraph, Roles, TrainSpec, build_cost_graph
from ..placement import R, placement_str
from ..units import GiB, fmt_bytes_exact as _fmt_bytes
from .dims import unknown_ops
from .ilp import Solution, evaluate, solve
from .to_schedule import Decision, apply_decisions, decisions_from_solution, decisions_python
from .validate import validate_plan_args

logger = logging.getLogger(__name__)

Mode = Literal["joint", "two_stage"]


# ----------------------------------------------------------------------------- runtime capabilities
def runtime_capabilities(model: nn.Module) -> tuple[Callable[[str], bool], Callable[[str], bool]]:
    """(is_leaf_param(param name), is_leaf_module(path)) for params/modules the runtime can shard
    (`treadle.sharding_rules.has_leaf_rule`)."""
    from ..sharding_rules import has_leaf_rule

    leaf_paths = {name for name, m in model.named_modules() if has_leaf_rule(m)}
    owners = {}
    for mname, m in model.named_modules():
        for pname, _ in m.named_parameters(recurse=False):
            owners[f"{mname}.{pname}" if mname else pname] = mname
    return (lambda p: owners.get(p) in leaf_paths), (lambda path: path in leaf_paths)


def attr_resolver(model: nn.Module) -> Callable[[str, int], Any]:
    """NOTE [fixed view sizes] in cost_graph.py: which int attribute of a module holds a reshape size."""
    cache: dict[tuple[str, int], Any] = {}

    def resolve(path: str, value: int, prefer: str | None = None):
        key = (path, value, prefer)
        if key in cache:
            return cache[key]
        try:
            mod = model.get_submodule(path) if path else model
        except AttributeError:
            cache[key] = "ok"
            return "ok"
        from ..sharding_rules import has_leaf_rule

        if has_leaf_rule(mod):  # the runtime replaces a sharded leaf's forward: its attributes are unused
            cache[key] = "ok"
            return "ok"
        names = [k for k, v in vars(mod).items()
                 if isinstance(v, int) and not isinstance(v, bool) and v == value and not k.startswith("_")]
        cfg = getattr(mod, "config", None)
        in_cfg = cfg is not None and any(isinstance(v, int) and not isinstance(v, bool) and v == value
                                         for v in vars(cfg).values())
        if len(names) > 1 and prefer:  # a split's size: the attribute named for it (GPT-2's split_size)
            names = [k for k in names if prefer in k] or names
        r: Any = ("attr", names[0]) if len(names) == 1 else ("forbid" if names else "config" if in_cfg else "ok")
        cache[key] = r
        return r

    return resolve


def tied_leaf_holders(model: nn.Module) -> dict[str, set[str]]:
    """Parameter name -> the paths of every leaf module the runtime can shard (`has_leaf_rule`) that holds that
    very parameter object under any name: a tied output embedding computes with the input embedding's shard."""
    from ..sharding_rules import has_leaf_rule

    paths: dict[int, set[str]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        if has_leaf_rule(m):
            for _, p in m.named_parameters(recurse=False):
                paths.setdefault(id(p), set()).add(mname)
    return {name: paths.get(id(p), set()) for name, p in model.named_parameters(remove_duplicate=False)}


def _shardable_fn(graph: CapturedGraph, is_leaf_param: Callable[[str], bool], n_tp: int,
                  holders: dict[str, set[str]] | None = None):
    """Per parameter: every placement over the tensor axes with each tensor dim on at most one axis
    (the runtime's leaf rules reject a dim split over several axes), for leaf parameters only, where the
    consuming module is the owner or another leaf holding the same parameter (`tied_leaf_holders`)."""
    cache: dict[tuple[str, str], set] = {}
    holders = holders or {}

    def fn(param: str, module: str) -> set:
        if (param, module) in cache:
            return cache[(param, module)]
        out: set = set()
        if is_leaf_param(param) and (graph.param_modules.get(param) == module or module in holders.get(param, ())):
            nd = len(graph.params[param].shape)
            for combo in itertools.product([R] + list(range(nd)), repeat=n_tp):
                dims = [d for d in combo if d >= 0]
                if dims and len(dims) == len(set(dims)):
                    out.add(tuple(combo))
        cache[(param, module)] = out
        return out

    return fn


# ----------------------------------------------------------------------------- plan data
@dataclass(slots=True)
class PlanRow:
    """One module of the explanation (costs over all real blocks it stands for)."""

    path: str
    count: int
    layout: str
    compute_s: float
    comm_s: float
    recompute_s: float
    memory_bytes: float


@dataclass(slots=True)
class Plan:
    """The planner's answer. See the module doc; `schedule` needs the model (`schedule_for`)."""

    model: dict | None
    cluster: ClusterSpec
    roles: str
    mode: str
    budget_bytes: float | None
    decisions: list[Decision]
    estimated: Estimate
    rows: list[PlanRow]
    binding: str
    solver: dict
    unknown_ops: dict[str, int] = field(default_factory=dict)
    price: dict | None = None  # `treadle.pricing.Price.to_dict()` of the schedule, once `estimate()` ran
    _model: Any = None  # nn.Module given to plan_model (not serialised)
    _schedule: Any = None
    _context: Any = None  # plan_model's inputs and arguments, for what_if (not serialised)

    # ------------------------------------------------------------------ schedule
    @property
    def schedule(self):
        """The Schedule of the planned model (built once). Raises PlanError after `load` (no model)."""
        if self._schedule is None:
            if self._model is None:
                raise PlanError("Plan.schedule: this plan was loaded from JSON and holds no model; "
                                "use plan.schedule_for(model)")
            self._schedule = self.schedule_for(self._model)
        return self._schedule

    def schedule_for(self, model: nn.Module):
        """A fresh Schedule of `model` with this plan's decisions applied."""
        from ..schedule.core import create_schedule

        sch = create_schedule(model, mesh=self.cluster.mesh)
        _, is_leaf_module = runtime_capabilities(model)
        return apply_decisions(sch, self.decisions, leaf_module=is_leaf_module)

    def what_if(self, **changes: Any) -> tuple["Plan", list[str]]:
        """Re-plan with some `plan_model` arguments changed — e.g. ``pins={"*.mlp.fc.weight": {"tp": 0}}``
        ("why not tensor parallelism on the MLP?") — and return the new plan and its `diff` from this one.
        Raises PlanError after `load` (no model) or when the changed problem has no plan."""
        if self._context is None:
            raise PlanError("Plan.what_if: this plan was loaded from JSON; re-plan with plan_model")
        kwargs = dict(self._context["kwargs"])
        kwargs.update(changes)
        other = plan_model(self._model, self._context["inputs"], **kwargs)
        return other, self.diff(other)

    def estimate(self) -> Estimate:
        """Predicted step time, peak memory and MFU per device: the price of `schedule`
        (`treadle.pricing.price`, one price for every schedule), computed on first call and kept in
        `price`. `estimated` stays the solver's own figure (its memory model is what the budget binds).
        A plan loaded from JSON without a stored price, or made from positional inputs, returns `estimated`.
        Raises PlanError when the schedule was built already (price an unbuilt schedule)."""
        if self.price is None and self._model is not None and self._context is not None \
                and isinstance(self._context["inputs"], dict):
            from ..pricing import price

            self.price = price(self.schedule, self._context["inputs"], self.cluster,
                               loss_fn=self._context["kwargs"].get("loss_fn")).to_dict()
        if self.price is None:
            return self.estimated
        p = self.price
        return Estimate(p["step_s"], p["peak_bytes"], p["mfu"], p["compute_s"], p["exposed_comm_s"],
                        p["recompute_s"], p["static_bytes"], p["activation_bytes"], p["transient_bytes"])

    def python_lines(self) -> list[str]:
        """The decisions as schedule calls, without the model (`treadle.planner.to_schedule.decisions_python`)."""
        return decisions_python(self.decisions)

    def explain(self) -> str:
        """A text table per module (layouts, compute / communication / recompute time, memory) and the
        binding constraint. `treadle.planner.explain.plan_table` gives the same as a rich Table."""
        from .explain import explain_text

        return explain_text(self)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        sch_json = None
        if self._model is not None or self._schedule is not None:
            sch_json = json.loads(self.schedule.to_json())
        return {
            "format": "treadle.plan/1",
            "model": self.model,
            "cluster": self.cluster.to_dict(),
            "roles": self.roles,
            "mode": self.mode,
            "budget_bytes": self.budget_bytes,
            "decisions": [d.to_dict() for d in self.decisions],
            "estimate": asdict(self.estimated),
            "rows": [asdict(r) for r in self.rows],
            "binding": self.binding,
            "solver": self.solver,
            "unknown_ops": self.unknown_ops,
            "price": self.price,
            "schedule": sch_json,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "plan") -> "Plan":
        """A plan read from a file, as data: every decision is checked and a Ref it names passes the schedule
        gate (NOTE [files are data]). Raises PlanError naming `source` (and the decision) for another format,
        a missing or malformed field, or a name a file may not hold."""
        from ..errors import TreadleError

        if not isinstance(d, dict) or d.get("format") != "treadle.plan/1":
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise PlanError(f"{source}: not a treadle plan (format {got!r:.80}, expected 'treadle.plan/1')")
        try:
            decisions = [Decision.from_dict(x, where=f"{source}: decision {i}") for i, x in enumerate(d["decisions"])]
            return cls(d["model"], ClusterSpec.from_dict(d["cluster"]), d["roles"], d["mode"], d["budget_bytes"],
                       decisions, Estimate(**d["estimate"]), [PlanRow(**r) for r in d["rows"]], d["binding"],
                       d["solver"], d.get("unknown_ops", {}), d.get("price"))
        except PlanError:
            raise
        except TreadleError as exc:
            raise PlanError(f"{source}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
            raise PlanError(f"{source} is malformed: missing or wrong field ({type(exc).__name__}: "
                            f"{str(exc)[:200]})") from None

    @classmethod
    def from_json(cls, text: str, *, source: str = "plan JSON") -> "Plan":
        from ..schedule.gate import parse_json

        return cls.from_dict(parse_json(text, source=source, error=PlanError), source=source)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path) as f:
            return cls.from_json(f.read(), source=str(path))

    # ------------------------------------------------------------------ diff
    def diff(self, other: "Plan") -> list[str]:
        """Human-readable differences: roles, decisions only in one plan, estimate changes."""
        out = []
        if self.roles != other.roles:
            out.append(f"roles: {self.roles} -> {other.roles}")
        mine = {str(d) for d in self.decisions}
        theirs = {str(d) for d in other.decisions}
        out += [f"- {d}" for d in sorted(mine - theirs)]
        out += [f"+ {d}" for d in sorted(theirs - mine)]
        a, b = self.estimated, other.estimated
        if abs(a.step_s - b.step_s) > 1e-12 or abs(a.peak_bytes - b.peak_bytes) > 0.5:
            out.append(f"step {a.step_s * 1e3:.3f} ms -> {b.step_s * 1e3:.3f} ms "
                       f"({(b.step_s / a.step_s if a.step_s else math.inf):.3f}x); "
                       f"peak {a.peak_bytes / GiB:.3f} GiB -> {b.peak_bytes / GiB:.3f} GiB")
        return out


# ----------------------------------------------------------------------------- roles and pins
def enumerate_roles(mesh: Mesh, *, batch: int | None,
                    dp_axis: str | tuple[str, ...] | None | Literal["auto"] = "auto", zero: bool | None = None,
                    forbid_axes: tuple[str, ...] = (), reshard_after_forward: bool | None = True,
                    replicate: tuple[str, ...] | None = None) -> list[Roles]:
    """Every role assignment of the mesh's axes: each parallel form proposes what it may do with the live axes
    (`treadle.form.Form.role_options`; data parallelism on any subset of them whose sizes' product divides the
    batch — `dp_axis` "auto"; None: on none; an axis or a tuple: on exactly those — as DDP, ZeRO-3 or HSDP,
    `replicate` fixing HSDP's replicate axes or None searching, `zero` None (both) / False (DDP) / True (ZeRO-3
    / HSDP), `reshard_after_forward` the FSDP2 flag or None (both)); the live axes no form takes are
    tensor-parallel; forbidden and size-1 axes are off. Raises PlanError for a data-parallel axis that is not
    live."""
    for a in forbid_axes:
        mesh.axis_index(a)
    live = tuple(a for a in mesh.names if mesh.size(a) > 1 and a not in forbid_axes)
    off = tuple(a for a in mesh.names if a not in live)
    request = _RoleRequest(dp_axis, zero, reshard_after_forward, replicate)
    options: list[dict] = [{}]
    for f in forms():
        mine = f.role_options(mesh, live, batch=batch, request=request)
        if mine is not None:
            options = [{**o, **m} for o in options for m in mine]
    out = []
    for opt in options:
        taken = set(opt.get("dp", ()))
        out.append(Roles(tp=tuple(a for a in live if a not in taken), off=off,
                         **{"dp": (), "zero": False, **opt}))
    return out


@dataclass(frozen=True, slots=True)
class _RoleRequest:
    """What `enumerate_roles` was asked (each form reads its own part)."""

    dp_axis: Any
    zero: bool | None
    reshard_after_forward: bool | None
    replicate: tuple[str, ...] | None


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


def _pins_for(graph: CapturedGraph, pins: dict[str, dict[str, int | str]], roles: Roles) -> dict | None:
    """Pins as {captured param: placement per tensor axis}; None when a pin cannot hold under `roles`."""
    out: dict[str, tuple[int, ...]] = {}
    for pattern, per_axis in pins.items():
        matched = [p for p in graph.params if fnmatch.fnmatchcase(p, pattern)]
        if not matched:
            raise PlanError(f"pin {pattern!r} matches no parameter; parameters look like {sorted(graph.params)[:4]}")
        for axis, val in per_axis.items():
            code = R if val in ("R", "replicate", None) else int(str(val).lstrip("S"))
            if axis not in roles.tp and code != R:
                return None
        pl = tuple((R if per_axis.get(a, "R") in ("R", "replicate", None) else int(str(per_axis[a]).lstrip("S")))
                   for a in roles.tp)
        for p in matched:
            out[p] = pl
    return out


def pins_from_schedule(sch) -> tuple[dict[str, dict[str, int]], dict[str, Any], list[str]]:
    """A partial schedule's records as constraints: shard -> pins, data_parallel -> role, checkpoint -> paths."""
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
        else:
            raise PlanError(f"partial schedule: primitive {op!r} at {path!r} cannot be a planner constraint; "
                            f"use shard, data_parallel and checkpoint in a partial schedule")
    return pins, role, ckpts


# ----------------------------------------------------------------------------- planning
def _two_stage(cg: CostGraph, budget: float | None, time_limit_s: float) -> Solution:
    sol = solve(cg, budget_bytes=budget, checkpoint=False, time_limit_s=time_limit_s, memory="static")
    if sol.status == "infeasible":
        return sol
    step, peak, terms = evaluate(cg, sol.choice, {})
    if budget is None or peak <= budget:
        return sol
    tids = list(cg.templates)
    blocks = []
    for t in tids:
        info = cg.templates[t]
        A = sum(cg.units[u].costs[sol.choice[u]].act_bytes for u in info.units)
        F = sum(cg.units[u].costs[sol.choice[u]].rec_s for u in info.units)
        In = info.input_bytes[sol.choice[info.input_unit]] if info.input_unit is not None else 0.0
        blocks.append(ChainBlock(info.count, A, In, F))
    base = peak - sum(b.count * b.act_bytes for b in blocks)  # everything but the blocks' activations
    res = solve_chain(blocks, base_bytes=base, budget_bytes=budget)
    ckpt = dict(zip(tids, res.counts))
    step, peak, terms = evaluate(cg, sol.choice, ckpt)
    status = sol.status if res.feasible else "infeasible"
    return Solution(sol.choice, ckpt, step, peak, status, sol.gap, sol.solve_s, sol.n_vars, sol.n_cons, terms)


def _min_ckpt(cg: CostGraph, paths: list[str]) -> dict[int, int]:
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


def plan_model(model: nn.Module, example_inputs: dict | tuple, *, cluster: ClusterSpec | list[ClusterSpec],
               memory_budget_bytes: float | None = None, mode: Mode = "joint",
               pins: dict[str, dict[str, int | str]] | None = None,
               dp_axis: str | tuple[str, ...] | None | Literal["auto"] = "auto", zero: bool | None = None,
               reshard_after_forward: bool | None = True, forbid_axes: tuple[str, ...] = (),
               partial_schedule: Any = None,
               train: TrainSpec = TrainSpec(), time_limit_s: float = 30.0, model_spec: dict | None = None,
               graph: CapturedGraph | None = None, checkpoint: Literal["auto", "all", "none"] = "auto",
               progress: Callable[[str], None] | None = None,
               loss_fn: Callable[[Any], torch.Tensor] | None = None, price_top: int | None = None) -> Plan:
    """Plan `model` on `cluster` under `memory_budget_bytes` per device (None: unlimited).

    `example_inputs`: keyword arguments (a dict, e.g. from `treadle.models.zoo.named_model`) or positional
    args; global batch, real or fake tensors. `pins`: {parameter glob: {axis: dim or "R"}}.
    `dp_axis`: "auto" (search every subset of the axes), None (no data parallelism), an axis name or a tuple
    of them (data parallelism on exactly those); `zero`: force ZeRO-3 / HSDP on or off (None: search);
    `reshard_after_forward`: the FSDP2 flag of ZeRO-3 roles (None: search both).
    `forbid_axes`: axes every op stays replicated on. `partial_schedule`: a Schedule whose shard /
    data_parallel / checkpoint records become constraints. `model_spec` is stored in the plan (e.g.
    {"name": "tiny-gpt2", "batch": 4, "seq": 16}) so `treadle verify plan.json` can rebuild the model.
    `cluster` may be a list (e.g. `treadle.cost.cluster.enumerate_meshes`): every mesh is searched and the
    best plan wins. `checkpoint`: "auto" (the solver decides), "all" (every repeated block), "none".
    `loss_fn(output)`: the training loss, as in verify / train / profile (default: ``.loss`` when the model
    returns one, else the mean square of its first floating output; `treadle.loss.default_loss`).
    `price_top`: NOTE [final choice by price] — the best plans of the `price_top` best role assignments (by the
    solver's step time) are each priced (`treadle.price`: the schedule as built, every term of the runtime) and
    the fastest whose priced peak fits the budget wins (one whose priced peak misses the budget is re-solved
    with the solver's budget corrected by the difference, 4 times at most; when none of them fits, the other
    role assignments are priced in turn, and PlanError says when none fits as built); 0 keeps the solver's
    choice (a price rehearses a step on fake tensors: ~1 s for a small model, ~10-40 s for a 8-70B one). Needs
    keyword `example_inputs`. Default (None): 1 when `memory_budget_bytes` is given — the returned plan fits the
    budget as built, not only in the solver's linear memory model, which misses a small model's peak by up to
    ~15% either way (the gradients beside DDP's buckets, the backward's temporaries) — else 0.
    Raises PlanError when no plan meets the budget (stating the smallest budget that any plan meets),
    when a pin matches nothing, or when the mesh's axes cannot take the batch.
    """
    validate_plan_args(model, cluster=cluster, memory_budget_bytes=memory_budget_bytes, pins=pins,
                       forbid_axes=forbid_axes, dp_axis=dp_axis)
    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    pins = dict(pins or {})
    ckpt_paths: list[str] = []
    replicate: tuple[str, ...] | None = None  # HSDP's replicate axes: searched unless a partial schedule fixes them
    if partial_schedule is not None:
        p2, role, ckpt_paths = pins_from_schedule(partial_schedule)
        for k, v in p2.items():
            pins.setdefault(k, {}).update(v)
        if role:
            dp_axis, zero = role["dp"], role["zero"]
            replicate, reshard_after_forward = role["replicate"], role["reshard_after_forward"]
    if isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (), dict(example_inputs)
    clusters = list(cluster) if isinstance(cluster, (list, tuple)) else [cluster]
    if not clusters:
        raise PlanError("plan_model: no cluster given")
    if graph is None:
        say("capture")
        # attention saves what the devices' kernels save (NOTE [attention as a GPU runs it])
        graph = capture(model, args, kwargs, loss_fn=loss_fn, gpu_attention=not any(c.is_cpu() for c in clusters))
    t_capture = time.perf_counter() - t0
    pins = tied_pins(model, pins, graph)
    batch = _batch_size(args, kwargs)
    is_leaf_param, _ = runtime_capabilities(model)
    holders = tied_leaf_holders(model)
    resolver = attr_resolver(model)
    if mode not in ("joint", "two_stage"):
        raise PlanError(f"unknown planning mode {mode!r}; use 'joint' or 'two_stage'")

    def solve_for(cg: CostGraph, budget: float | None) -> Solution:
        """The best plan of one role assignment under `budget` (the planning mode, pins and checkpoint policy)."""
        min_ck = _min_ckpt(cg, ckpt_paths) if ckpt_paths else {}
        if checkpoint == "all":
            min_ck = {t: info.count for t, info in cg.templates.items()}
        if mode == "joint":
            return solve(cg, budget_bytes=budget, time_limit_s=time_limit_s, min_ckpt=min_ck,
                         checkpoint=checkpoint != "none")
        return _two_stage(cg, budget, time_limit_s)

    results: list[tuple[Solution, CostGraph]] = []
    t_build = t_solve = 0.0
    tried_roles = 0
    unbuilt: list = []  # role assignments whose cost graph has an op without a strategy (`pin_check.Attempt`)
    for cl in clusters:
        mesh = cl.mesh
        if len(clusters) > 1 and dp_axis not in ("auto", None) and not set(
                (dp_axis,) if isinstance(dp_axis, str) else dp_axis) <= set(mesh.names):
            continue
        candidates = enumerate_roles(mesh, batch=batch, dp_axis=dp_axis, zero=zero,
                                     forbid_axes=tuple(a for a in forbid_axes if a in mesh.names),
                                     reshard_after_forward=reshard_after_forward, replicate=replicate)
        tried_roles += len(candidates)
        for roles in candidates:
            rpins = _pins_for(graph, pins, roles)
            if rpins is None:
                continue
            where = f"{mesh} {roles}" if len(clusters) > 1 else str(roles)
            say(f"{where}: cost graph")
            tb = time.perf_counter()
            try:
                cg = build_cost_graph(graph, cl, roles, train=train, pins=rpins,
                                      shardable=_shardable_fn(graph, is_leaf_param, len(roles.tp), holders),
                                      attr_resolver=resolver)
            except PlanError as exc:
                logger.info("%s skipped: %s", where, exc)
                unbuilt.append((cl, roles, None, getattr(exc, "node_index", None), str(exc)))
                continue
            t_build += time.perf_counter() - tb
            say(f"{where}: solve ({len(cg.units)} units)")
            ts = time.perf_counter()
            sol = solve_for(cg, memory_budget_bytes)
            t_solve += time.perf_counter() - ts
            logger.info("%s: %s step %.4g s peak %.4g GiB", where, sol.status, sol.step_s, sol.peak_bytes / GiB)
            results.append((sol, cg))
    if not tried_roles:
        raise PlanError(f"no axis role assignment of {[str(c.mesh) for c in clusters]} fits batch {batch}: a "
                        f"data-parallel axis must divide the batch; use a divisible batch or dp_axis=None")
    feasible = [(s, c) for s, c in results if s.status != "infeasible"]
    if not feasible:
        smallest = _smallest_budget(results, time_limit_s)
        if pins and smallest == math.inf:  # no plan even without the memory row: a pin cannot hold
            _raise_pin_conflict(model, graph, pins, unbuilt + [(c.cluster, c.roles, c, None, "") for _, c in results],
                                train=train, is_leaf_param=is_leaf_param, resolver=resolver, time_limit_s=time_limit_s)
        where = clusters[0] if len(clusters) == 1 else f"{len(clusters)} meshes"
        raise PlanError(f"no plan of {graph.model_class} on {where} fits {_fmt_bytes(memory_budget_bytes)} per "
                        f"device (constraint 'memory' binds for every role assignment tried: "
                        f"{[str(c.roles) for _, c in results]}); the smallest budget any plan meets is "
                        f"{_fmt_bytes(smallest)} — raise the budget to at least that, or add devices")
    feasible.sort(key=lambda sc: (sc[0].step_s, sc[0].peak_bytes))
    sol, cg = feasible[0]
    priced: list[dict] = []
    chosen_price = None
    if price_top is None:  # a budget is a promise about the plan as built: check it by its price
        price_top = 1 if memory_budget_bytes is not None else 0
    if price_top > 0 and kwargs and not args:
        say("price the best role assignments")
        sol, cg, chosen_price, priced = _choose_by_price(model, kwargs, feasible[:price_top], is_leaf_param,
                                                         memory_budget_bytes, loss_fn, solve_for)
        # none of the K fits as built: the next role assignments, one at a time, until one does
        for extra in feasible[price_top:] if memory_budget_bytes is not None and chosen_price is None else []:
            s2, c2, p2, rows2 = _choose_by_price(model, kwargs, [extra], is_leaf_param, memory_budget_bytes,
                                                 loss_fn, solve_for)
            priced += rows2
            if p2 is not None:
                sol, cg, chosen_price = s2, c2, p2
                break
        if memory_budget_bytes is not None and chosen_price is None and priced:
            low = min(priced, key=lambda r: r["peak_bytes"])
            raise PlanError(f"plan_model: no plan fits {_fmt_bytes(memory_budget_bytes)} per device as built: "
                            f"every role assignment's plan, priced (`treadle.price`) and re-solved, needs more; the "
                            f"smallest is {_fmt_bytes(low['peak_bytes'])} ({low['roles']} on {low['mesh']}) — raise "
                            f"the budget to at least that, or add devices")
    # NOTE [exact budget] in ilp.py: the plan's memory as built (its price) when priced, else the solver's
    if memory_budget_bytes is not None and chosen_price is None and sol.peak_bytes > memory_budget_bytes:
        raise PlanError(f"plan_model: the solver's plan needs {_fmt_bytes(sol.peak_bytes)} per device, over the "
                        f"budget {_fmt_bytes(memory_budget_bytes)} by {sol.peak_bytes - memory_budget_bytes:.0f} B; "
                        f"this is a solver tolerance problem, please report it")
    cluster = cg.cluster
    decisions = decisions_from_solution(cg, sol.choice, sol.ckpt, leaf_param=is_leaf_param)
    hw = cluster.rank_hardware()
    dtype = next((m.dtype for m in graph.params.values()), torch.float32)
    est = Estimate(sol.step_s, sol.peak_bytes,
                   mfu_of(int(cg.model_flops / cluster.world_size), sol.step_s, hw, dtype) if sol.step_s else 0.0,
                   sol.terms["compute_s"], sol.terms["comm_s"], sol.terms["recompute_s"], sol.terms["static_bytes"],
                   sol.terms["activation_bytes"], sol.terms["transient_bytes"])
    binding = _binding(cg, sol, memory_budget_bytes, time_limit_s, checkpoint)
    alternatives = sorted(({"mesh": str(c.cluster.mesh), "roles": str(c.roles), "status": s.status,
                            "step_s": s.step_s, "peak_bytes": s.peak_bytes} for s, c in results),
                          key=lambda a: a["step_s"])
    solver = {"status": sol.status, "gap": sol.gap, "n_vars": sol.n_vars, "n_constraints": sol.n_cons,
              "capture_s": t_capture, "cost_graph_s": t_build, "solve_s": t_solve,
              "planning_s": time.perf_counter() - t0, "alternatives": alternatives,
              "checkpoints": {cg.templates[t].path: c for t, c in sol.ckpt.items()},
              "unknown_flops": cg.unknown_flops, "device": asdict(cluster.rank_device()), "priced": priced,
              "param_dtype": str(dtype).removeprefix("torch.")}
    context = {"inputs": example_inputs,
               "kwargs": dict(cluster=clusters if len(clusters) > 1 else clusters[0],
                              memory_budget_bytes=memory_budget_bytes, mode=mode, pins=pins, dp_axis=dp_axis,
                              zero=zero, reshard_after_forward=reshard_after_forward, forbid_axes=forbid_axes,
                              train=train, time_limit_s=time_limit_s,
                              model_spec=model_spec, graph=graph, checkpoint=checkpoint,
                              partial_schedule=partial_schedule, loss_fn=loss_fn)}
    plan = Plan(model_spec, cluster, str(cg.roles), mode, memory_budget_bytes, decisions, est,
                _rows(cg, sol), binding, solver, unknown_ops(graph.nodes), price=chosen_price, _model=model,
                _context=context)
    logger.info("plan %s: %s; %s", graph.model_class, cg.roles, est)
    return plan


PRICE_RESOLVES = 4  # NOTE [final choice by price]: re-solves of a candidate whose priced peak misses the budget
PRICE_SLACK = 0.02  # a priced peak this close under the budget (fraction of it) is not re-solved


def _resolve_by_price(sol: Solution, p, cg: CostGraph, budget: float, solve_for, price_of) -> list:
    """[(solution, price)] of one role assignment, re-solved until its priced peak is within PRICE_SLACK under
    `budget` (NOTE [final choice by price]). The solver's budget moves by the price's error,
    ``solver peak + (budget - priced peak)``; once a solver budget whose plan fits (lo) and one whose plan does
    not (hi) are known, a proposal outside (lo, hi) bisects it instead; an infeasible solver budget (floor)
    stands in for lo until one fits. Plans seen before are not priced again."""
    key = lambda s_: (tuple(s_.choice), tuple(sorted(s_.ckpt.items())))  # noqa: E731
    seen = {key(sol): p}
    tried = [(sol, p)]
    lo, hi, floor, target = -math.inf, math.inf, 0.0, budget  # floor: the largest solver budget found infeasible
    for _ in range(PRICE_RESOLVES):
        if target is not None:  # (None: the last proposal was infeasible; `p` is still the older plan's)
            if p.peak_bytes <= budget:
                lo = max(lo, target)
            else:
                hi = min(hi, target)
        slack = budget - p.peak_bytes
        if 0 <= slack <= PRICE_SLACK * budget:
            break
        proposal = sol.peak_bytes + slack
        below = lo if not math.isinf(lo) else floor
        if not max(lo, floor) < proposal < hi:
            if (math.isinf(lo) and not floor) or math.isinf(hi) or hi - below <= PRICE_SLACK * budget:
                break
            proposal = (below + hi) / 2
        target = proposal
        again = solve_for(cg, target) if target > 0 else None
        logger.debug("re-solve %s at solver budget %.0f B (priced %.0f B against %.0f B): %s", cg.roles, target,
                     p.peak_bytes, budget, "infeasible" if again is None or again.status == "infeasible"
                     else f"solver peak {again.peak_bytes:.0f} B")
        if again is None or again.status == "infeasible":
            floor, target = max(floor, proposal), None  # too small for the solver: bisect above it
            continue
        if key(again) in seen:
            sol, p = again, seen[key(again)]
            continue
        try:
            p = price_of(again, cg)
        except PlanError as exc:
            logger.info("price of %s (re-solved) failed: %s", cg.roles, exc)
            break
        sol = again
        seen[key(sol)] = p
        tried.append((sol, p))
    return tried


def _choose_by_price(model: nn.Module, inputs: dict, candidates: list[tuple[Solution, CostGraph]],
                     is_leaf_param: Callable[[str], bool], budget: float | None, loss_fn,
                     solve_for: Callable[[CostGraph, float | None], Solution] | None = None):
    """NOTE [final choice by price]: the solver's cost graph is linear and per-op; `price` runs the built schedule.
    Each candidate (best plan of one role assignment) is turned into its schedule on a copy of `model` and
    priced; the fastest whose priced peak fits `budget` wins (none fits: the solver's best and no price; `plan_model`
    then prices the other role assignments, and raises PlanError when none fits).
    A candidate whose priced peak misses the budget — over it, or under it by more than PRICE_SLACK — is solved
    again (`solve_for`, at most PRICE_RESOLVES times) with the solver's budget moved by the difference,
    ``solver peak + (budget - priced peak)``: the linear memory model's error on that role assignment, measured
    by the price, corrects its budget (over: less memory, so the plan fits as built; under: more, so it
    checkpoints no more than the budget needs), bisecting between a solver budget that fit and one that did not
    once both are known (`_resolve_by_price`; a solver budget found infeasible bounds the bisection from below).
    Each new plan is priced; the fastest that fits is the candidate's plan.
    Returns (solution, cost graph, its price dict, [{roles, mesh, solver_step_s, step_s, peak_bytes, resolves}])."""
    from ..pricing import price

    def price_of(sol: Solution, cg: CostGraph):
        import copy

        from ..schedule.core import create_schedule

        m = copy.deepcopy(model)
        _, is_leaf_module = runtime_capabilities(m)
        decisions = decisions_from_solution(cg, sol.choice, sol.ckpt, leaf_param=is_leaf_param)
        sch = apply_decisions(create_schedule(m, mesh=cg.cluster.mesh), decisions, leaf_module=is_leaf_module)
        return price(sch, inputs, cg.cluster, loss_fn=loss_fn)

    rows, best = [], None
    for sol, cg in candidates:
        try:
            p = price_of(sol, cg)
        except PlanError as exc:
            logger.info("price of %s failed: %s", cg.roles, exc)
            continue
        tried = [(sol, p)]
        if budget is not None and solve_for is not None:
            tried = _resolve_by_price(sol, p, cg, budget, solve_for, price_of)
        fitting = [(s_, p_) for s_, p_ in tried if budget is None or p_.peak_bytes <= budget]
        sol, p = min(fitting, key=lambda sp: sp[1].step_s) if fitting else tried[-1]
        rows.append({"mesh": str(cg.cluster.mesh), "roles": str(cg.roles), "solver_step_s": sol.step_s,
                     "step_s": p.step_s, "peak_bytes": p.peak_bytes, "resolves": len(tried) - 1})
        fits = budget is None or p.peak_bytes <= budget
        if fits and (best is None or p.step_s < best[2].step_s):
            best = (sol, cg, p)
    if best is None:  # no candidate fits by its price: the solver's own choice (its memory model binds)
        sol, cg = candidates[0]
        return sol, cg, None, rows
    return best[0], best[1], best[2].to_dict(), rows


def _raise_pin_conflict(model: nn.Module, graph: CapturedGraph, pins: dict, attempts: list, *, train: TrainSpec,
                        is_leaf_param: Callable[[str], bool], resolver, time_limit_s: float) -> None:
    """Raise PlanError naming the pin that cannot hold and the op that blocks it (`pin_check`)."""
    from .pin_check import pin_conflict

    def probe(sub: dict, cl: ClusterSpec, roles: Roles):
        rp = _pins_for(graph, sub, roles) or {}
        try:
            cg = build_cost_graph(graph, cl, roles, train=train, pins=rp,
                                  shardable=_shardable_fn(graph, is_leaf_param, len(roles.tp)), attr_resolver=resolver)
        except PlanError as exc:
            return (cl, roles, None, getattr(exc, "node_index", None), str(exc))
        free = solve(cg, budget_bytes=None, time_limit_s=time_limit_s, minimise="memory")
        return None if free.status != "infeasible" else (cl, roles, cg, None, "")

    def module_type(path: str) -> str:
        try:
            return type(model.get_submodule(path) if path else model).__name__
        except AttributeError:
            return "?"

    raise PlanError(pin_conflict(graph, pins, attempts, pins_for=lambda sub, roles: _pins_for(graph, sub, roles),
                                 probe=probe, is_leaf_param=is_leaf_param, module_type=module_type))


def _binding(cg: CostGraph, sol: Solution, budget: float | None, time_limit_s: float, checkpoint: str) -> str:
    """Which constraint binds: re-solve the chosen mesh and roles without the budget and compare."""
    if budget is None:
        return "none (no memory budget)"
    slack = budget - sol.peak_bytes
    free = solve(cg, budget_bytes=None, time_limit_s=time_limit_s, checkpoint=checkpoint != "none")
    if free.status != "infeasible" and free.step_s < sol.step_s * (1 - 1e-6):
        return (f"memory binds: peak {_fmt_bytes(sol.peak_bytes)} of {_fmt_bytes(budget)} (slack {_fmt_bytes(slack)}); "
                f"without the budget this mesh and roles would take {free.step_s * 1e3:.3f} ms instead of "
                f"{sol.step_s * 1e3:.3f} ms (+{(sol.step_s / free.step_s - 1) * 100:.1f}%) at peak "
                f"{_fmt_bytes(free.peak_bytes)}")
    return (f"none: memory slack {_fmt_bytes(slack)} ({slack / budget:.0%} of the budget); the plan is the "
            f"fastest for its mesh and roles without a memory limit")


def _smallest_budget(results: list[tuple[Solution, CostGraph]], time_limit_s: float) -> float:
    best = math.inf
    for _, cg in results:
        s = solve(cg, budget_bytes=None, time_limit_s=time_limit_s, minimise="memory")
        best = min(best, s.peak_bytes)
    return best


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return int(v.shape[0])
    return None


def _rows(cg: CostGraph, sol: Solution) -> list[PlanRow]:
    """Per-module rows of the chosen strategies. Each op is billed to its own module, also when it was merged
    into another module's decision unit (NOTE [billing by module] in cost_graph.py)."""
    g = cg.graph
    rows: dict[str, PlanRow] = {}
    ck = {t: c for t, c in sol.ckpt.items()}
    for u, unit in enumerate(cg.units):
        k = sol.choice[u]
        parts = unit.parts[k] if unit.parts is not None else {unit.module: unit.costs[k]}
        members = unit.strategies[k]
        layouts: dict[str, list[str]] = {}
        out_l: dict[str, str] = {}
        for i, (combo, pub) in members.items():  # leader first, then followers in graph order
            n = g.nodes[i]
            for pos, j in enumerate(n.inputs):
                if g.nodes[j].kind == "param":
                    pl = tuple(o.ins[pos] for o in combo)
                    if any(p != R for p in pl):
                        layouts.setdefault(n.module, []).append(f"{g.nodes[j].param.rsplit('.', 1)[-1]}:" +
                                                                ",".join(placement_str(p) for p in pl))
            if n.module not in out_l or n.module != unit.module:  # the leader's layout on its own row
                out_l[n.module] = ",".join(placement_str(p) for p in pub) if pub else "-"
        for module, c in parts.items():
            path = module or "<root>"
            rec = ck[unit.template] * c.rec_s if unit.template is not None and ck.get(unit.template) else 0.0
            row = rows.get(path)
            if row is None:
                row = rows[path] = PlanRow(path, unit.count, "", 0.0, 0.0, 0.0, 0.0)
            row.compute_s += unit.count * c.compute_s
            row.comm_s += unit.count * (c.comm_s + c.dp_comm_s)  # data-parallel sync before overlap
            row.recompute_s += rec
            row.memory_bytes += unit.count * (c.static_bytes + c.act_bytes)
            desc = " ".join(layouts.get(module, []) + [f"out:{out_l.get(module, '-')}"])
            if desc not in row.layout:
                row.layout = (row.layout + " " + desc).strip() if len(row.layout) < 60 else row.layout
    shared: dict = {}
    for f in forms():  # each form's terms (tensor parallelism: the input-gradient sums, each billed once to its
        f.adjust_rows(cg, sol.choice, rows, shared)  # first user; sequence: the gathers' credit, where billed)
    return list(rows.values())
