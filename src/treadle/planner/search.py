"""`plan_model`: the planner's search as a short sequence of named steps over one request — capture the model,
enumerate the role assignments of every mesh, solve each, choose by price, emit the `Plan`.

The search is exact over *axis role assignments* (what each parallel form does with which mesh axis: data
parallelism on some axes, with or without ZeRO-3; the others tensor axes; axes can be forbidden;
`treadle.planner.roles`) and, inside each, over every op's strategy and each block template's checkpoint count
(one MILP, `ilp.py`). ``mode="two_stage"`` instead fixes the sharding ignoring activations and then picks
checkpoints with the exact chain DP (`checkpoint_dp.py`). An infeasible budget raises PlanError stating the
smallest budget any plan meets.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Literal

import torch
from torch import nn

from ..cost.cluster import ClusterSpec
from ..errors import PlanError
from ..pricing.result import Estimate
from ..profile.roofline import mfu as mfu_of
from ..units import GiB, fmt_bytes_exact as _fmt_bytes
from .by_price import choose_by_price
from .capabilities import attr_resolver, runtime_capabilities, shardable_fn, tied_leaf_holders
from .capture import CapturedGraph, capture
from .checkpoint_dp import two_stage
from .cost_graph import CostGraph, Roles, TrainSpec, build_cost_graph
from .floors import OverMemoryFloor
from .dims import unknown_ops
from .ilp import Solution, solve
from .pins import min_ckpt, pins_for, pins_from_schedule, tied_pins
from .plan import Plan
from .candidates import (VARIANT_BAND, collector_paused, cutoff_for, pipeline_on_slowest_link, price_variants,
                         priced_candidates)
from .roles import alike_key, enumerate_roles, why_replicated
from .rows import binding_constraint, plan_rows
from .to_schedule import decisions_from_solution
from .validate import execution_and_float8, expert_load_of, validate_plan_args

logger = logging.getLogger(__name__)

Mode = Literal["joint", "two_stage"]


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What `plan_model` was asked, besides the model and its inputs (the arguments of `plan_model`, checked; a
    partial schedule's records already turned into `pins`, a fixed data-parallel role and `ckpt_paths`).

    `clusters`: every mesh to search. `memory_budget_bytes`: per device (None: unlimited). `pins`: {parameter
    glob: {axis: dim or "R"}}. `dp_axis`: "auto" (search every subset of the axes), None (no data parallelism),
    an axis or a tuple (exactly those); `zero`: force ZeRO-3 / HSDP on or off (None: search); `replicate`:
    HSDP's replicate axes (None: search); `reshard_after_forward`: the FSDP2 flag (None: search both).
    `forbid_axes`: axes every op stays replicated on. `pp_axis`: "auto" (a pipeline over any live axis is weighed),
    None (no pipeline), an axis (a pipeline over it); `pp_cuts`, `pp_schedule`, `pp_microbatches`: a partial
    schedule's stage boundaries and pipeline(...) record, pinned. `ckpt_paths`: blocks that must be checkpointed.
    `checkpoint`: "auto" (the solver decides), "all" (every repeated block), "none". `price_top`: NOTE [final
    choice by price] — the best plans of that many role assignments (of each kind, pipelined and unpipelined: NOTE
    [pipelined against unpipelined]) are priced as built and the fastest that fits wins (0: the solver's choice). `given`: the keyword arguments as given (`Plan.what_if` re-plans)."""

    clusters: tuple[ClusterSpec, ...]
    memory_budget_bytes: float | None = None
    mode: Mode = "joint"
    pins: dict = field(default_factory=dict)
    dp_axis: Any = "auto"
    zero: bool | None = None
    replicate: tuple[str, ...] | None = None
    reshard_after_forward: bool | None = True
    forbid_axes: tuple[str, ...] = ()
    pp_axis: Any = "auto"
    pp_cuts: tuple[str, ...] = ()
    pp_schedule: str | None = None
    pp_microbatches: int | None = None
    ckpt_paths: tuple[str, ...] = ()
    train: TrainSpec = TrainSpec()
    time_limit_s: float = 30.0
    model_spec: dict | None = None
    checkpoint: str = "auto"
    loss_fn: Any = None
    price_top: int = 0
    say: Callable[[str], None] = lambda s: None
    given: dict = field(default_factory=dict)
    execution: str = "eager"  # how plans are priced and run (NOTE [execution and float8 in the plan])
    float8: tuple[str, bool] | None = None  # (recipe, forced by a partial schedule) or None
    expert_load: float = 1.0  # the busiest expert rank's rows over the mean (NOTE [expert load in a rehearsal])
    ep_axis: Any = "auto"  # the experts' split: "auto" (weighed), None (never), an axis or axes (always that group)


@dataclass(slots=True)
class _Search:
    """What every step of one search reads: the model, its captured graph, the request, the runtime's
    capabilities on the model, the batch and the step timings."""

    model: nn.Module
    graph: CapturedGraph
    req: PlanRequest
    batch: int | None
    is_leaf_param: Callable[[str], bool]
    holders: dict
    resolver: Any
    timing: dict = field(default_factory=lambda: {"capture_s": 0.0, "cost_graph_s": 0.0, "solve_s": 0.0})
    pruned: list = field(default_factory=list)  # role assignments cut off (NOTE [a cutoff from the best plan found])
    # role assignments whose memory floor is over the budget, not built: (cluster, roles, pins, floor bytes)
    # (NOTE [a memory floor before the costs] in floors.py)
    over_floor: list = field(default_factory=list)
    memo: dict = field(default_factory=dict)  # the cost graphs' per-op strategies (`build_cost_graph`)


def plan_model(model: nn.Module, example_inputs: dict | tuple, *, cluster: ClusterSpec | list[ClusterSpec],
               memory_budget_bytes: float | None = None, mode: Mode = "joint",
               pins: dict[str, dict[str, int | str]] | None = None,
               dp_axis: str | tuple[str, ...] | None | Literal["auto"] = "auto", zero: bool | None = None,
               reshard_after_forward: bool | None = True, forbid_axes: tuple[str, ...] = (),
               partial_schedule: Any = None, train: TrainSpec = TrainSpec(), time_limit_s: float = 30.0,
               model_spec: dict | None = None, graph: CapturedGraph | None = None,
               checkpoint: Literal["auto", "all", "none"] = "auto", progress: Callable[[str], None] | None = None,
               loss_fn: Callable[[Any], torch.Tensor] | None = None, price_top: int | None = None,
               pp_axis: str | None | Literal["auto"] = "auto", pp_schedule: str | None = None, execution: str = "eager",
               float8: str | None = None, expert_load_imbalance: float = 1.0, ep_axis: Any = "auto") -> Plan:
    """Plan `model` on `cluster` (one ClusterSpec, or a list: every mesh is searched) under
    `memory_budget_bytes` per device. `example_inputs`: keyword arguments (a dict) or positional args, global
    batch, real or fake tensors. The other arguments are `PlanRequest`'s; `partial_schedule`: a Schedule whose
    shard / data_parallel / checkpoint records become constraints; `graph`: a capture to reuse; `progress`: a
    callback told each step; `loss_fn(output)`: the loss, as in verify / train (`treadle.loss.default_loss`);
    `price_top` defaults to 1 with a budget (a promise about the plan as built), compiled or float8, else 0; `model_spec`
    (e.g. {"name": "tiny-gpt2", "batch": 4, "seq": 16}) is kept in the plan for `treadle verify plan.json`;
    `execution` ("eager", "compiled": the blocks under torch.compile, as `treadle.run --compile` runs them) is how the
    plans are priced and what the plan states (NOTE [execution and float8 in the plan]); `float8` a recipe the plan
    may use for the blocks' linears (None: none; NOTE [float8 recipes]); `expert_load_imbalance` the busiest rank's
    routed rows over the mean that an expert-parallel plan is charged and states (NOTE [expert load in a
    rehearsal]; 1.0: balanced); `pp_schedule` a pipeline's schedule, pinned (None: the planner weighs each of
    `treadle.forms.pipeline.cuts.SCHEDULES` that builds); `ep_axis` the experts' split: "auto" (weighed), None (never), an axis or a tuple
    (that group in every plan).
    Raises PlanError when no plan meets the budget (stating the smallest budget any plan meets, also as its
    attribute ``smallest_budget_bytes``), when a pin
    matches nothing or cannot hold (naming the op that blocks it), or when the axes cannot take the batch."""
    given = dict(cluster=cluster, memory_budget_bytes=memory_budget_bytes, mode=mode, pins=pins, dp_axis=dp_axis,
                 zero=zero, reshard_after_forward=reshard_after_forward, forbid_axes=forbid_axes,
                 partial_schedule=partial_schedule, train=train, time_limit_s=time_limit_s, model_spec=model_spec,
                 checkpoint=checkpoint, progress=progress, loss_fn=loss_fn, price_top=price_top, pp_axis=pp_axis,
                 pp_schedule=pp_schedule, execution=execution, float8=float8, expert_load_imbalance=expert_load_imbalance, ep_axis=ep_axis)
    t0 = time.perf_counter()
    req = make_request(model, given)
    args, kwargs = _split_inputs(example_inputs)
    with collector_paused():  # NOTE [the collector paused while planning]
        search = capture_model(model, args, kwargs, req, graph)
        results, unbuilt = solve_roles(search)
        sol, cg, chosen_price, priced = choose(search, results, unbuilt, kwargs if not args else None)
        plan = emit(search, sol, cg, chosen_price, priced, results, planning_s=time.perf_counter() - t0)
    kwargs_used = {**given, "graph": search.graph}  # what_if re-plans from these (the capture reused)
    plan._context = {"inputs": example_inputs, "kwargs": kwargs_used,
                     "replan": lambda **changes: plan_model(model, example_inputs, **{**kwargs_used, **changes})}
    return plan


# ----------------------------------------------------------------------------- the steps
def make_request(model: nn.Module, given: dict) -> PlanRequest:
    """Check the arguments and resolve a partial schedule into constraints. Raises PlanError naming the
    argument at fault (`validate_plan_args`)."""
    validate_plan_args(model, cluster=given["cluster"], memory_budget_bytes=given["memory_budget_bytes"],
                       pins=given["pins"], forbid_axes=given["forbid_axes"], dp_axis=given["dp_axis"])
    if given["mode"] not in ("joint", "two_stage"):
        raise PlanError(f"unknown planning mode {given['mode']!r}; use 'joint' or 'two_stage'")
    cluster = given["cluster"]
    clusters = tuple(cluster) if isinstance(cluster, (list, tuple)) else (cluster,)
    if not clusters:
        raise PlanError("plan_model: no cluster given")
    pins = dict(given["pins"] or {})
    role: dict[str, Any] = {}
    ckpt_paths: list[str] = []
    if given["partial_schedule"] is not None:
        p2, role, ckpt_paths = pins_from_schedule(given["partial_schedule"])
        for k, v in p2.items():
            pins.setdefault(k, {}).update(v)
    budget = given["memory_budget_bytes"]
    execution, float8 = execution_and_float8(given, role)
    pinned = given.get("pp_schedule")
    if pinned is not None and role.get("pp_schedule", pinned) != pinned:
        raise PlanError(f"plan_model: pp_schedule={pinned!r}, but the partial schedule's pipeline(...) states "
                        f"{role['pp_schedule']!r}; give one")
    if pinned is not None and (given.get("pp_axis", "auto") is None or execution != "eager"):
        raise PlanError(f"plan_model: pp_schedule={pinned!r} pins a pipeline's schedule, but "
                        f"{'pp_axis=None' if given.get('pp_axis', 'auto') is None else 'compiled execution'} plans "
                        f"no pipeline")
    expert_load = expert_load_of(given)
    weigh = budget is not None or execution != "eager" or (float8 is not None and not float8[1])
    price_top = given["price_top"] if given["price_top"] is not None else (1 if weigh else 0)
    if float8 is not None and not float8[1] and price_top < 1:
        raise PlanError("plan_model: float8 is weighed by the price of the plans as built (NOTE [execution and "
                        "float8 in the plan]); price_top must be >= 1 with float8")
    return PlanRequest(
        clusters=clusters, memory_budget_bytes=budget, mode=given["mode"], pins=pins,
        dp_axis=role.get("dp", given["dp_axis"]), zero=role.get("zero", given["zero"]),
        replicate=role.get("replicate"), reshard_after_forward=role.get("reshard_after_forward",
                                                                        given["reshard_after_forward"]),
        forbid_axes=tuple(given["forbid_axes"]), pp_axis=role.get("pp_axis", given.get("pp_axis", "auto") if execution == "eager" else None),
        pp_cuts=tuple(role.get("pp_cuts", ())), pp_schedule=role.get("pp_schedule", given.get("pp_schedule")),
        pp_microbatches=role.get("pp_microbatches"),
        ckpt_paths=tuple(ckpt_paths), train=given["train"],
        time_limit_s=given["time_limit_s"], model_spec=given["model_spec"], checkpoint=given["checkpoint"],
        loss_fn=given["loss_fn"], price_top=price_top, say=given["progress"] or (lambda s: None), given=given,
        execution=execution, float8=float8, expert_load=expert_load, ep_axis=given.get("ep_axis", "auto"))


def capture_model(model: nn.Module, args: tuple, kwargs: dict, req: PlanRequest,
                  graph: CapturedGraph | None = None) -> _Search:
    """Capture `model` (unless `graph` is given) and read what the runtime can build of it."""
    t0 = time.perf_counter()
    if graph is None:
        req.say("capture")
        # attention saves what the devices' kernels save (NOTE [attention as a GPU runs it])
        graph = capture(model, args, kwargs, loss_fn=req.loss_fn,
                        gpu_attention=not any(c.is_cpu() for c in req.clusters))
    t_capture = time.perf_counter() - t0
    req = replace(req, pins=tied_pins(model, req.pins, graph))
    search = _Search(model, graph, req, _batch_size(args, kwargs), runtime_capabilities(model)[0],
                     tied_leaf_holders(model), attr_resolver(model))
    search.timing["capture_s"] = t_capture
    return search


def candidates(search: _Search, *, distinct: bool = True) -> list[tuple[ClusterSpec, Roles]]:
    """Every (mesh, role assignment) to solve, in search order, the first of each that solve alike kept
    (`distinct`, NOTE [role assignments that solve alike]). Raises PlanError when no role assignment fits the
    batch."""
    req, out, tried = search.req, [], 0
    for cl in req.clusters:
        mesh = cl.mesh
        if len(req.clusters) > 1 and req.dp_axis not in ("auto", None) and not set(
                (req.dp_axis,) if isinstance(req.dp_axis, str) else req.dp_axis) <= set(mesh.names):
            continue
        if len(req.clusters) > 1 and req.pp_axis not in ("auto", None) and req.pp_axis not in mesh.names:
            continue
        ep = [req.ep_axis] if isinstance(req.ep_axis, str) and req.ep_axis != "auto" else req.ep_axis
        if len(req.clusters) > 1 and isinstance(ep, (list, tuple)) and not set(ep) <= set(mesh.names):
            continue  # a stated expert group: only the meshes that have its axes
        roles = enumerate_roles(mesh, batch=search.batch, dp_axis=req.dp_axis, zero=req.zero,
                                forbid_axes=tuple(a for a in req.forbid_axes if a in mesh.names),
                                reshard_after_forward=req.reshard_after_forward, replicate=req.replicate,
                                facts=search.graph.facts, pp_axis=req.pp_axis, pp_cuts=req.pp_cuts,
                                pp_schedule=req.pp_schedule, pp_microbatches=req.pp_microbatches,
                                float8=req.float8, expert_load=req.expert_load, ep_axis=req.ep_axis)
        tried += len(roles)
        out += [(cl, r) for r in roles if req.pp_axis != "auto" or pipeline_on_slowest_link(cl, r)]
    if distinct:  # the first of each group that solves alike, in search order
        first: dict = {}
        for cl, r in out:
            first.setdefault(alike_key(cl, r), (cl, r))
        out = list(first.values())
    if not tried:
        raise PlanError(f"no axis role assignment of {[str(c.mesh) for c in req.clusters]} fits batch "
                        f"{search.batch}: a data-parallel axis must divide the batch; use a divisible batch or "
                        f"dp_axis=None")
    return out


def cost_graph_for(search: _Search, cluster: ClusterSpec, roles: Roles, pins: dict,
                   budget_bytes: float | None = None) -> CostGraph:
    """The cost graph of one role assignment with its pins (what `solve_roles` and the pin-conflict probe build).
    Raises PlanError where an op has no strategy; `OverMemoryFloor` where `budget_bytes` is given and no plan
    can fit it (NOTE [a memory floor before the costs])."""
    g = search.graph
    return build_cost_graph(g, cluster, roles, train=search.req.train, pins=pins,
                            shardable=shardable_fn(g, search.is_leaf_param, len(roles.tp), search.holders),
                            attr_resolver=search.resolver, budget_bytes=budget_bytes, memo=search.memo)


def solve_for(search: _Search, cg: CostGraph, budget: float | None, cutoff_s: float | None = None) -> Solution:
    """The best plan of one role assignment under `budget` (the planning mode, pins and checkpoint policy);
    `cutoff_s`: NOTE [a cutoff from the best plan found]."""
    req = search.req
    min_ck = min_ckpt(cg, list(req.ckpt_paths)) if req.ckpt_paths else {}
    if req.checkpoint == "all":
        min_ck = {t: info.count for t, info in cg.templates.items()}
    if req.mode == "joint":
        return solve(cg, budget_bytes=budget, time_limit_s=req.time_limit_s, min_ckpt=min_ck,
                     checkpoint=req.checkpoint != "none", cutoff_s=cutoff_s)
    return two_stage(cg, budget, req.time_limit_s)


def solve_roles(search: _Search) -> tuple[list[tuple[Solution, CostGraph]], list]:
    """The cost graph and the best plan of every candidate; also the role assignments whose cost graph has an
    op without a strategy (`pin_check.Attempt`s, for the error a pin that cannot hold raises)."""
    req, graph = search.req, search.graph
    results: list[tuple[Solution, CostGraph]] = []
    unbuilt: list = []
    steps: dict[bool, list[float]] = {False: [], True: []}  # the feasible steps found, by kind (pipelined or not)
    # NOTE [a cutoff from the best plan found]: the role assignments without a pipeline first (cheap to solve)
    for cl, roles in sorted(candidates(search), key=lambda x: x[1].pp is not None):
        rpins = pins_for(graph, req.pins, roles)
        if rpins is None:
            continue
        where = f"{cl.mesh} {roles}" if len(req.clusters) > 1 else str(roles)
        req.say(f"{where}: cost graph")
        tb = time.perf_counter()
        try:
            cg = cost_graph_for(search, cl, roles, rpins, req.memory_budget_bytes)
        except OverMemoryFloor as exc:  # no plan of it fits: infeasible, unbuilt (built only for the error)
            logger.info("%s: infeasible (%s)", where, exc)
            search.over_floor.append((cl, roles, rpins, exc.floor_bytes))
            search.timing["cost_graph_s"] += time.perf_counter() - tb
            continue
        except PlanError as exc:
            logger.info("%s skipped: %s", where, exc)
            unbuilt.append((cl, roles, None, getattr(exc, "node_index", None), str(exc)))
            continue
        search.timing["cost_graph_s"] += time.perf_counter() - tb
        req.say(f"{where}: solve ({len(cg.units)} units)")
        ts = time.perf_counter()
        kind = roles.pp is not None
        sol = solve_for(search, cg, req.memory_budget_bytes, cutoff_s=cutoff_for(steps, kind, req.price_top))
        search.timing["solve_s"] += time.perf_counter() - ts
        if sol.status == "pruned":
            search.pruned.append({"mesh": str(cl.mesh), "roles": str(roles)})
            logger.info("%s: pruned (no plan faster than the cutoff)", where)
            continue
        if sol.status != "infeasible":
            steps[kind].append(sol.step_s)
        logger.info("%s: %s step %.4g s peak %.4g GiB", where, sol.status, sol.step_s, sol.peak_bytes / GiB)
        results.append((sol, cg))
    return results, unbuilt


def choose(search: _Search, results: list, unbuilt: list, inputs: dict | None):
    """The fastest feasible plan: by the solver's step, or — with `price_top` and keyword `inputs` — by its price
    as built (NOTE [final choice by price]). Returns (solution, cost graph, its price dict or None, the priced
    rows). Raises PlanError when none fits, naming the smallest budget or the pin that cannot hold."""
    req, budget = search.req, search.req.memory_budget_bytes
    feasible = [(s, c) for s, c in results if s.status != "infeasible"]
    if not feasible:
        for cl, roles, rpins, _ in search.over_floor:  # the error's smallest budget reads every solve
            cg_ = cost_graph_for(search, cl, roles, rpins)
            results.append((solve_for(search, cg_, budget), cg_))
        _raise_infeasible(search, results, unbuilt)
    feasible.sort(key=lambda sc: (sc[0].step_s, sc[0].peak_bytes))
    sol, cg = feasible[0]
    priced: list[dict] = []
    chosen_price = None
    top = priced_candidates(feasible, req.price_top)
    if top and inputs:
        req.say("price the best role assignments")

        def choose_among(cands):  # each candidate's ways priced on its own (NOTE [each schedule priced on its own])
            own, others, home = price_variants(cands)
            s_, c_, p_, rows_ = choose_by_price(search.model, inputs, own, search.is_leaf_param, budget, req.loss_fn,
                                                lambda cg_, b_: solve_for(search, cg_, b_), execution=req.execution,
                                                variants=others, variant_band=VARIANT_BAND,
                                                solve_variant=lambda cg_, c: solve_for(search, cg_, budget, cutoff_s=c))
            return s_, home.get(id(c_), c_), p_, rows_

        sol, cg, chosen_price, priced = choose_among(top)
        # none of the K fits as built: the next role assignments, one at a time, until one does
        for extra in [x for x in feasible if x not in top] if budget is not None and chosen_price is None else []:
            s2, c2, p2, rows2 = choose_among([extra])
            priced += rows2
            if p2 is not None:
                sol, cg, chosen_price = s2, c2, p2
                break
        if budget is not None and chosen_price is None and priced:
            low = min(priced, key=lambda r: r["peak_bytes"])
            err = PlanError(f"plan_model: no plan fits {_fmt_bytes(budget)} per device as built: every role "
                            f"assignment's plan, priced (`treadle.price`) and re-solved, needs more; the smallest is "
                            f"{_fmt_bytes(low['peak_bytes'])} ({low['roles']} on {low['mesh']}) — raise the budget "
                            f"to at least that, or add devices")
            err.smallest_budget_bytes = float(low["peak_bytes"])
            raise err
    # NOTE [exact budget] in ilp.py: the plan's memory as built (its price) when priced, else the solver's
    if budget is not None and chosen_price is None and sol.peak_bytes > budget:
        raise PlanError(f"plan_model: the solver's plan needs {_fmt_bytes(sol.peak_bytes)} per device, over the "
                        f"budget {_fmt_bytes(budget)} by {sol.peak_bytes - budget:.0f} B; this is a solver "
                        f"tolerance problem, please report it")
    return sol, cg, chosen_price, priced


def emit(search: _Search, sol: Solution, cg: CostGraph, chosen_price: dict | None, priced: list, results: list,
         *, planning_s: float) -> Plan:
    """The `Plan` of the chosen solution: its decisions, the solver's estimate, rows, binding constraint and
    statistics."""
    req, graph = search.req, search.graph
    cluster = cg.cluster
    decisions = decisions_from_solution(cg, sol.choice, sol.ckpt, leaf_param=search.is_leaf_param, stages=sol.stages,
                                        variants=sol.variants, policies=sol.policies)
    hw = cluster.rank_hardware()
    dtype = next((m.dtype for m in graph.params.values()), torch.float32)
    est = Estimate(sol.step_s, sol.peak_bytes,
                   mfu_of(int(cg.model_flops / cluster.world_size), sol.step_s, hw, dtype) if sol.step_s else 0.0,
                   sol.terms["compute_s"], sol.terms["comm_s"], sol.terms["recompute_s"], sol.terms["static_bytes"],
                   sol.terms["activation_bytes"], sol.terms["transient_bytes"])
    binding = binding_constraint(cg, sol, req.memory_budget_bytes, req.time_limit_s, req.checkpoint,
                                 priced_peak_bytes=chosen_price["peak_bytes"] if chosen_price else None)
    alternatives = sorted(({"mesh": str(c.cluster.mesh), "roles": str(c.roles), "status": s.status,
                            "step_s": s.step_s, "peak_bytes": s.peak_bytes} for s, c in results),
                          key=lambda a: a["step_s"])
    alternatives += [{"mesh": str(cl.mesh), "roles": str(r), "status": "infeasible", "step_s": math.inf,
                      "peak_bytes": math.inf, "memory_floor_bytes": floor} for cl, r, _, floor in search.over_floor]
    solver = {"status": sol.status, "gap": sol.gap, "n_vars": sol.n_vars, "n_constraints": sol.n_cons,
              **search.timing, "planning_s": planning_s, "alternatives": alternatives, "pruned": search.pruned,
              "checkpoints": {cg.templates[t].path: c for t, c in sol.ckpt.items()},
              "stages": asdict(sol.stages) if sol.stages is not None else None,
              "unknown_flops": cg.unknown_flops, "device": asdict(cluster.rank_device()), "priced": priced,
              "param_dtype": str(dtype).removeprefix("torch.")}
    if any(sol.policies.values()):  # blocks per selective checkpoint policy (NOTE [checkpoint policies in the plan])
        solver["policies"] = {f"{cg.templates[t].path}: {p}": n for (t, p), n in sol.policies.items() if n}
    if any(sol.variants.values()):  # blocks per variant (NOTE [block variants])
        solver["variants"] = {f"{cg.templates[t].path}: {name}": w for (t, name), w in sol.variants.items() if w}
    if not cg.roles.dp and not any(d.op in ("shard", "shard_attr") for d in decisions):
        solver["replicated"] = why_replicated(
            cluster.mesh, cg.roles, batch=search.batch, tensor_shardable=_tensor_shardable(cg), dp_axis=req.dp_axis,
            zero=req.zero, forbid_axes=tuple(a for a in req.forbid_axes if a in cluster.mesh.names),
            reshard_after_forward=req.reshard_after_forward, replicate=req.replicate, facts=search.graph.facts)
    plan = Plan(req.model_spec, cluster, str(cg.roles), req.mode, req.memory_budget_bytes, decisions, est,
                plan_rows(cg, sol), binding, solver, unknown_ops(graph.nodes), price=chosen_price,
                execution=req.execution, _model=search.model)
    logger.info("plan %s: %s; %s", graph.model_class, cg.roles, est)
    return plan


# ----------------------------------------------------------------------------- helpers of the steps
def _split_inputs(example_inputs: dict | tuple) -> tuple[tuple, dict]:
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (), dict(example_inputs)


def _raise_infeasible(search: _Search, results: list, unbuilt: list) -> None:
    """No role assignment has a plan: a pin that cannot hold (naming the op that blocks it), else the memory."""
    req, graph = search.req, search.graph
    smallest = _smallest_budget(results, req.time_limit_s)
    if req.pins and smallest == math.inf:  # no plan even without the memory row: a pin cannot hold
        _raise_pin_conflict(search, unbuilt + [(c.cluster, c.roles, c, None, "") for _, c in results])
    where = req.clusters[0] if len(req.clusters) == 1 else f"{len(req.clusters)} meshes"
    if not results and not search.over_floor and unbuilt:  # nothing was costed: memory is not why
        why = list(dict.fromkeys(u[4] for u in unbuilt if u[4]))
        raise PlanError(f"no plan of {graph.model_class} on {where}: each of the {len(unbuilt)} role assignments "
                        f"was refused before its costs: {'; '.join(why[:3])}"
                        f"{f' (and {len(why) - 3} other reasons)' if len(why) > 3 else ''}")
    err = PlanError(f"no plan of {graph.model_class} on {where} fits {_fmt_bytes(req.memory_budget_bytes)} per "
                    f"device (constraint 'memory' binds for every role assignment tried: "
                    f"{[str(c.roles) for _, c in results]}); the smallest budget any plan meets is "
                    f"{_fmt_bytes(smallest)} — raise the budget to at least that, or add devices")
    err.smallest_budget_bytes = float(smallest)
    raise err


def _raise_pin_conflict(search: _Search, attempts: list) -> None:
    """Raise PlanError naming the pin that cannot hold and the op that blocks it (`pin_check`)."""
    from .pin_check import pin_conflict

    model, graph, req = search.model, search.graph, search.req

    def probe(sub: dict, cl: ClusterSpec, roles: Roles):
        try:
            cg = cost_graph_for(search, cl, roles, pins_for(graph, sub, roles) or {})
        except PlanError as exc:
            return (cl, roles, None, getattr(exc, "node_index", None), str(exc))
        free = solve(cg, budget_bytes=None, time_limit_s=req.time_limit_s, minimise="memory")
        return None if free.status != "infeasible" else (cl, roles, cg, None, "")

    def module_type(path: str) -> str:
        try:
            return type(model.get_submodule(path) if path else model).__name__
        except AttributeError:
            return "?"

    raise PlanError(pin_conflict(graph, req.pins, attempts, pins_for=lambda sub, roles: pins_for(graph, sub, roles),
                                 probe=probe, is_leaf_param=search.is_leaf_param, module_type=module_type))


def _tensor_shardable(cg: CostGraph) -> dict[str, bool]:
    """{tensor axis: whether any strategy of any unit shards an op on it} (`why_replicated`)."""
    return {a: any(combo[j].letter is not None for unit in cg.units for members in unit.strategies
                   for combo, _ in members.values())
            for j, a in enumerate(cg.roles.tp)}


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
