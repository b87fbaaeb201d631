"""`treadle plan` and `treadle explain`: plan a named (or user) model on a cluster, explain a saved plan.

    treadle plan llama-3-8b --cluster 8x8:h100 --memory 80GiB --batch 32 --seq 4096 -o plan.json
    treadle explain plan.json [--trace step.json --html report.html --png fig]

`plan` searches every logical mesh of the cluster whose inner axis stays inside a node (`search_clusters`:
8x8 gives (64,), (32, 2), (16, 4), (8, 8)) and reports the best plan and the runner-up per mesh;
``--mesh 8x8`` plans one mesh. The parameter dtype defaults by device (`default_dtype`): bf16 mixed
precision on a GPU, fp32 on `cpu`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from ..errors import PlanError
from ..units import parse_bytes
from .output import add_quiet_flag, is_quiet, progress

# --dtype -> torch dtype name (torch is imported by the command, not by the parser)
_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp16": "float16", "float16": "float16"}


def decisions_python(decisions) -> list[str]:
    """`treadle.planner.to_schedule.decisions_python`, imported when used (the planner is not needed to parse)."""
    from ..planner.to_schedule import decisions_python as as_python

    return as_python(decisions)


def _parse_pin(text: str) -> tuple[str, str, str]:
    """'model.layers.*.mlp.down_proj.weight=tp:1' -> (glob, axis, dim or R)."""
    m = re.fullmatch(r"([^=]+)=([A-Za-z0-9_]+):(R|S?\d+)", text)
    if not m:
        raise PlanError(f"cannot read pin {text!r}; write PARAM_GLOB=AXIS:DIM (e.g. '*.down_proj.weight=tp:1') "
                        f"or PARAM_GLOB=AXIS:R")
    return m.group(1), m.group(2), m.group(3)


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="plan sharding and checkpointing of a model on a cluster")
    p.add_argument("model", help="a zoo name (treadle.models.zoo) or 'package.module:function'")
    p.add_argument("--cluster", required=True,
                   help="e.g. 8x8:h100, 2x4:a100, 2x2:cpu (a cpu preset: this host is measured first, about a "
                        "minute, unless --nominal), or a cluster JSON file (treadle calibrate -o)")
    p.add_argument("--nominal", action="store_true",
                   help="plan on a cpu preset as it is (a nominal core, loopback links, a core per rank) instead "
                        "of measuring this host: for planning another machine")
    p.add_argument("--memory", default=None, help="memory budget per device (e.g. 80GiB); default: the device's")
    p.add_argument("--batch", type=int, required=True, help="global batch size")
    p.add_argument("--seq", type=int, required=True, help="sequence length")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                   help="parameter/compute dtype; default by device: bf16 mixed precision on GPUs (fp32 master "
                        "weights and AdamW states counted in memory, MFU against the bf16 peak; fp16 where the "
                        "device has no bf16), fp32 on cpu")
    p.add_argument("--mesh", default=None, metavar="SHAPE",
                   help="plan only this logical mesh, e.g. 8x8 (the physical nodes x devices), 16x4 or 64; "
                        "default: search every mesh of up to --max-axes axes whose inner axis stays inside a node")
    p.add_argument("--max-axes", type=int, default=2, choices=[1, 2, 3],
                   help="most mesh axes in the search (default 2)")
    p.add_argument("--mode", default="joint", choices=["joint", "two_stage"])
    p.add_argument("--pin", action="append", default=[], metavar="GLOB=AXIS:DIM",
                   help="pin a parameter layout on a mesh axis (repeatable)")
    p.add_argument("--dp-axis", default="auto",
                   help="data-parallel axes: auto (search), none, an axis name, or names joined by ','")
    p.add_argument("--zero", choices=["auto", "on", "off"], default="auto", help="ZeRO-3 over the dp axis")
    p.add_argument("--forbid-axis", action="append", default=[], help="keep every op replicated on this axis")
    p.add_argument("--pp-axis", default="auto",
                   help="pipeline stages: auto (weigh a pipeline over any axis), none (no pipeline), or an axis name "
                        "(pipeline over it)")
    p.add_argument("--pp-schedule", default=None, metavar="KIND",
                   help="a pipeline's schedule, pinned: 1f1b, interleaved_1f1b, interleaved_zb, zbv or dualpipev "
                        "(default: the planner weighs each that builds)")
    p.add_argument("--time-limit", type=float, default=30.0, help="solver time limit per role assignment (s)")
    p.add_argument("--price-top", type=int, default=None, metavar="K",
                   help="price the best plans of the K best role assignments with treadle.price and keep the "
                        "fastest that fits as built (slower planning; 0: the solver's choice; default 1 with a "
                        "memory budget, else 0)")
    p.add_argument("--compile", action="store_true",
                   help="plan for the blocks under torch.compile (treadle.run --compile): the best plans are priced "
                        "so, and the plan says so (no pipeline)")
    p.add_argument("--float8", default=None, metavar="RECIPE", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"],
                   help="let the plan train the blocks' linears in float8 with this recipe (weighed by the price)")
    p.add_argument("--ep-axis", default="auto",
                   help="the experts' split (mixture-of-experts models): auto (weighed), none (experts replicated), "
                        "an axis name, or names joined by ',' (that group in every plan)")
    p.add_argument("--expert-load-imbalance", type=float, default=1.0, metavar="F",
                   help="the busiest expert rank's routed rows over the mean, charged to expert-parallel plans "
                        "(default 1: balanced; treadle.run logs the measured value as 'busiest / mean rank')")
    p.add_argument("--checkpoint-policy", action="append", default=[], metavar="NAME",
                   help="let the plan put blocks under this selective checkpoint policy besides full checkpointing, "
                        "weighed by the solver (repeatable; 'alternate-matmuls': torchtitan's op-level SAC)")
    p.add_argument("-o", "--output", default=None, help="write the plan as JSON here")
    p.add_argument("--json", action="store_true", help="print the plan JSON instead of the table")
    _picture_flags(p)
    add_quiet_flag(p)
    p.set_defaults(func=_plan_cmd)

    e = subparsers.add_parser("explain", help="explain a saved plan (per-module table, estimate, binding constraint)")
    e.add_argument("plan", help="plan.json written by `treadle plan`")
    e.add_argument("--top", type=int, default=None, help="only the N most expensive modules")
    e.add_argument("--json", action="store_true", help="print the rows as JSON")
    e.add_argument("--python", action="store_true", help="also print the schedule as Python calls")
    _picture_flags(e)
    e.add_argument("--measured", metavar="FILE", help="a treadle.viz.measured_trace file: compare its steps")
    add_quiet_flag(e)
    e.set_defaults(func=_explain_cmd)


def _picture_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", metavar="FILE", help="write the predicted step as a Chrome trace (Perfetto)")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    p.add_argument("--png", metavar="PREFIX", help="write PREFIX-memory/-breakdown/-timeline.png (needs matplotlib)")


def _write_pictures(plan, args: argparse.Namespace, out, measured: dict | None = None) -> None:
    from ..viz.files import write_plan_pictures

    for path in write_plan_pictures(plan, trace=args.trace, html=args.html, png=args.png, measured=measured):
        out.print(f"wrote {path}")


def _plan_cmd(args: argparse.Namespace) -> int:
    from ..models.zoo import check_model_name

    # the arguments first, before the planner, the model or the cluster's machine model is loaded
    check_model_name(args.model)
    for name in ("batch", "seq"):
        if getattr(args, name) < 1:
            raise PlanError(f"--{name} must be >= 1, got {getattr(args, name)}")
    budget = parse_bytes(args.memory) if args.memory else None
    pins: dict[str, dict[str, int | str]] = {}
    for text in args.pin:
        glob, axis, dim = _parse_pin(text)
        pins.setdefault(glob, {})[axis] = dim if dim == "R" else int(dim.lstrip("S"))
    dp_axis = (None if args.dp_axis == "none" else tuple(args.dp_axis.split(",")) if "," in args.dp_axis
               else args.dp_axis)
    zero = None if args.zero == "auto" else args.zero == "on"
    from ..planner.policy_facts import check_policies

    policies = check_policies(tuple(args.checkpoint_policy))

    import torch
    from rich.console import Console

    from ..cost.cluster import parse_cluster
    from ..cost.this_host import measures_this_host
    from ..models.zoo import load_model, named_model
    from ..planner.explain import mesh_table, plan_table, summary_lines
    from ..planner.meshes import default_dtype, search_clusters
    from ..planner.roles import TrainSpec
    from ..planner.search import plan_model
    from ..planner.validate import validate_axes
    from .output import console as table_console

    console = Console(stderr=True)
    from_file = args.cluster.strip().endswith(".json")
    cluster = parse_cluster(args.cluster)
    clusters = search_clusters(cluster, from_file=from_file, mesh=args.mesh, max_axes=args.max_axes)
    validate_axes(clusters, pins=pins, forbid_axes=tuple(args.forbid_axis), dp_axis=dp_axis)
    measured_note = None
    if measures_this_host(cluster, args.cluster, nominal=args.nominal):  # NOTE [plan for this host]
        cluster, clusters, measured_note = _measure_this_host(cluster, clusters, args, console)
    args.dtype = args.dtype or default_dtype(cluster)
    dtype = getattr(torch, _DTYPES[args.dtype])
    budget = budget if budget is not None else float(cluster.hardware().memory_bytes)
    with progress(f"planning {args.model}", quiet=is_quiet(args), console=console) as report:
        report("building the model (fake tensors)")
        if ":" in args.model:  # the user function gets dtype= when it takes it
            model, inputs = load_model(args.model, batch=args.batch, seq=args.seq, fake=True, dtype=dtype)
        else:
            model, inputs = named_model(args.model, batch=args.batch, seq=args.seq, fake=True, dtype=dtype)
        try:
            if len(clusters) > 1:
                report(f"searching {len(clusters)} meshes: {', '.join(str(tuple(c.mesh.shape)) for c in clusters)}")
            plan = plan_model(model, inputs, cluster=clusters if len(clusters) > 1 else clusters[0],
                              memory_budget_bytes=budget, mode=args.mode, pins=pins,
                              dp_axis=dp_axis, zero=zero, forbid_axes=tuple(args.forbid_axis),
                              pp_axis=None if args.pp_axis == "none" or args.compile else args.pp_axis,
                              pp_schedule=args.pp_schedule,
                              time_limit_s=args.time_limit, price_top=args.price_top,
                              execution="compiled" if args.compile else "eager", float8=args.float8,
                              expert_load_imbalance=args.expert_load_imbalance,
                              train=TrainSpec(checkpoint_policies=policies),
                              ep_axis=None if args.ep_axis == "none" else args.ep_axis if args.ep_axis == "auto"
                              else tuple(args.ep_axis.split(",")),
                              model_spec={"name": args.model, "batch": args.batch, "seq": args.seq,
                                          "dtype": args.dtype},
                              progress=lambda msg: report(msg))
        except PlanError as exc:
            console.print(f"[red]treadle plan: {exc}[/red]", soft_wrap=True)  # one line (treadle.cli)
            return 2
    if measured_note:
        plan.solver["cluster_measured"] = measured_note  # recorded in the plan (and its JSON), not cached
    with progress("pricing the plan's schedule", quiet=is_quiet(args), console=console):
        try:
            plan.estimate()  # the price, stored in the plan (and its JSON): explain and the pictures read it
        except PlanError as exc:
            console.print(f"[yellow]treadle plan: the schedule could not be priced ({exc}); the plan keeps the "
                          f"solver's estimate[/yellow]")
    if args.output:
        # the schedule in the plan is replayed on a freshly built model; fake parameters serialise as records only
        with open(args.output, "w") as f:
            f.write(plan.to_json())
    if args.json:
        print(plan.to_json())
    else:
        out = table_console()
        out.print(plan_table(plan))
        if len(clusters) > 1:
            out.print(mesh_table(plan))
        for line in summary_lines(plan):
            out.print(line)
        if args.output:
            out.print(f"plan written to {args.output}")
    _write_pictures(plan, args, Console(stderr=True) if args.json else out)
    return 0


# NOTE [plan for this host]: a cpu preset ("2x2:cpu") names a nominal core and loopback links; planned on it as
# it is, a tiny LLaMA on 4 gloo ranks of this 2-core host chose data x tensor parallelism that measured 1.32x
# and 1.48x the step of DDP over all ranks (issue 32): the preset knows neither that the ranks share 2 cores
# nor what gloo's collectives cost here. So `treadle plan` on a cpu preset measures the host it runs on first
# (`treadle.cost.this_host.calibrate_this_host`: a core, then the links on spawned ranks, about a minute),
# plans on what it measured, and records it in the plan; a cluster file (`treadle calibrate -o`) is taken
# as it is, and `--nominal` plans on the preset unmeasured (for another machine), its assumptions printed.
def _measure_this_host(cluster, clusters: list, args: argparse.Namespace, console) -> tuple:
    """(the measured cluster, the clusters to search, a note of what was measured): the preset's mesh search
    narrowed to what one calibration measures (the calibrated mesh and the 1-D mesh over every rank, or the
    `--mesh` asked for)."""
    from ..cost.this_host import calibrate_this_host, calibration_mesh, host_clusters
    from ..testing import check_process_count

    world = cluster.world_size
    check_process_count(world, where=f"plan --cluster {args.cluster} (it measures this host on {world} gloo "
                                     f"ranks; --nominal plans on the preset unmeasured)")
    # --mesh: that mesh; --max-axes 1: one axis over every rank (its link is all the plan uses); else 2 axes
    mesh = calibration_mesh(world, tuple(clusters[0].mesh.shape) if args.mesh else (world,) if args.max_axes == 1
                            else None)
    with progress(f"measuring this host: a core, then {mesh} on {world} gloo ranks (--nominal skips it)",
                  quiet=is_quiet(args), console=console):
        cal = calibrate_this_host(mesh, timeout_s=600)
    measured = [cal.cluster] if args.mesh else [c for c in host_clusters(cal.cluster) if c.mesh.ndim <= args.max_axes]
    note = f"links and core {cal.notes[0]}"
    console.print(f"treadle plan: {note}; plans on it (a cluster file or --nominal plans without measuring)",
                  soft_wrap=True)
    return cal.cluster, measured, note


def _explain_cmd(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from rich.console import Console

    from ..planner.explain import plan_table, summary_lines
    from ..planner.plan import Plan
    from .output import console as table_console

    try:
        plan = Plan.load(args.plan)
    except (OSError, json.JSONDecodeError, KeyError, PlanError) as exc:
        print(f"treadle explain: cannot read plan {args.plan!r}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(r) for r in plan.rows], indent=1))
        _write_pictures(plan, args, Console(stderr=True))
        return 0
    out = table_console()
    out.print(plan_table(plan, top=args.top))
    for line in summary_lines(plan):
        out.print(line)
    if args.python:
        print("\n".join(decisions_python(plan.decisions)))
    measured = None
    if args.measured:
        from ..viz.files import compare_lines
        from ..viz.measured import load_trace
        from ..viz.plan_timeline import timeline_from_plan

        measured = load_trace(args.measured)
        for line in compare_lines(timeline_from_plan(plan), measured):
            out.print(line)
    _write_pictures(plan, args, out, measured)  # the HTML report shows the measured steps beside the predicted
    return 0
