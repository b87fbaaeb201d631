"""`treadle price`: predicted step time, memory and MFU of a saved schedule (or plan) on a cluster.

    treadle price schedule.json --model tiny-gpt2 --cluster 2x2:cpu [--batch 8 --seq 64] [--json out.json]
        [--trace step.json --html price.html --png fig]   # the step as treadle.viz.timeline_from_price draws it
        [--measured run-pipeline.json]   # a pipeline: its measured timeline (treadle.run --trace) beside it
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import TreadleError

if TYPE_CHECKING:
    from rich.table import Table


def price_table(p, *, top: int | None = 20, mesh: str = "") -> Table:
    """Per module and phase: compute, communication by axis and kind (total, before overlap), its exposed part
    (ms). `mesh`: every mesh axis with its role (`treadle.viz.price_timeline.mesh_roles_text`) for the title."""
    from rich.table import Table

    t = Table("module", "phase", "compute ms", "comm ms (axis kind; total, before overlap)", "exposed comm ms",
              "saved MiB", title=f"price on {mesh or p.data_parallel}; {p.device.name}")
    rows = sorted(p.rows, key=lambda r: -(r.compute_s + sum(sum(k.values()) for k in r.comm_s.values())))
    for r in rows[:top]:
        comm = ", ".join(f"{axis} {kind} {s * 1e3:.3f}" for axis, kinds in r.comm_s.items()
                         for kind, s in kinds.items())
        t.add_row(r.module or "<root>", r.phase, f"{r.compute_s * 1e3:.3f}", comm, f"{r.exposed_comm_s * 1e3:.3f}",
                  f"{r.saved_bytes / 2**20:.3f}")
    return t


def with_placement(cluster, args: argparse.Namespace):
    """`cluster` with the rank placement the flags give; what they do not give stays as the cluster (its file)
    says: threads per rank, ranks and cores per host."""
    given = {k: v for k in ("threads_per_rank", "cores_per_host") if (v := getattr(args, k, None)) is not None}
    if not given:
        return cluster
    placement = {"threads_per_rank": cluster.threads_per_rank, "ranks_per_host": cluster.ranks_per_host,
                 "cores_per_host": cluster.cores_per_host}
    return cluster.with_ranks(**(placement | given))


def _price_cmd(args: argparse.Namespace) -> int:
    from ..models.zoo import check_model_name, zoo_name_from_file
    from ..schedule.gate import parse_json
    from .output import console as table_console

    try:  # the file, the model and the sizes first: before the cost model, the planner or the model load
        doc = parse_json(Path(args.file).read_text(), source=args.file, error=TreadleError)
        if not isinstance(doc, dict):
            raise TreadleError(f"{args.file}: expected a JSON object (a schedule or a plan)")
        model_info = doc.get("model") or {} if "decisions" in doc else {}
        sch_doc = doc["schedule"] if "decisions" in doc else doc
        if sch_doc is None:
            raise TreadleError(f"{args.file}: this plan holds no schedule")
        text = sch_doc if isinstance(sch_doc, str) else json.dumps(sch_doc)
        if not isinstance(model_info, dict):
            raise TreadleError(f"{args.file}: 'model' must be an object with name, batch, seq")
        name = args.model or (model_info.get("name") and zoo_name_from_file(model_info["name"], source=args.file))
        if not name:
            raise TreadleError(f"{args.file}: name the model with --model (e.g. tiny-gpt2); the file does not say")
        batch, seq = args.batch or model_info.get("batch", 8), args.seq or model_info.get("seq", 64)
        if not (isinstance(name, str) and isinstance(batch, int) and isinstance(seq, int)) or min(batch, seq) < 1:
            raise TreadleError(f"{args.file}: the plan's model needs a zoo name and positive integer batch and "
                               f"seq; got {name!r:.80}, {batch!r:.40}, {seq!r:.40}")
        check_model_name(name)
        for flag in ("threads_per_rank", "cores_per_host"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                raise TreadleError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
        from ..cost.cluster import parse_cluster
        from ..models.zoo import named_model
        from ..pricing import price
        from ..schedule.replay import load_schedule

        cluster = with_placement(parse_cluster(args.cluster), args)
        if "decisions" in doc:  # a plan: its decisions are data, checked as Plan.load checks them
            from ..planner.plan import Plan

            Plan.from_dict(doc, source=args.file)
        model, inputs = named_model(name, batch=batch, seq=seq, dropout=False)  # zoo names only: nothing imported
        sch = load_schedule(model, text, source=args.file)
        p = price(sch, inputs, cluster, execution="compiled" if args.compile else "eager")
    except (ValueError, KeyError) as exc:  # the file's values (TreadleError and OSError: said by treadle.cli)
        raise TreadleError(f"{args.file}: {exc}") from exc
    console = table_console()
    if args.json:
        Path(args.json).write_text(json.dumps(p.to_dict(), indent=1))
    axes = _mesh_roles(sch)
    console.print(price_table(p, mesh=axes))
    from ..planner.explain import price_lines

    for line in price_lines(p.to_dict()):
        console.print(line)
    console.print(f"{cluster.assumptions()}; overlap of communication with compute "
                  f"{'on' if p.device.overlap else 'off'}")
    from ..schedule.expert_primitive import load_assumption

    if (load := load_assumption(sch.view().extras)) is not None:
        console.print(load)
    measured = _measured_pipeline(args.measured, p.to_dict()) if args.measured else None
    if measured is not None:
        from rich.table import Table

        from ..viz.pipeline_timeline import COMPARE_HEAD, pipeline_compare_rows

        t = Table(*COMPARE_HEAD, title=f"pipeline: predicted beside measured ({args.measured})")
        for row in pipeline_compare_rows(p.to_dict(), measured):
            t.add_row(*row)
        console.print(t)
    if args.trace or args.html or args.png:
        from ..viz.files import write_price_pictures

        try:
            paths = write_price_pictures(p, trace=args.trace, html=args.html, png=args.png,
                                         title=f"{name} on {axes} ({p.data_parallel})",
                                         world_size=cluster.world_size, measured_pipeline=measured)
        except ImportError as exc:  # matplotlib for --png (OSError: said by treadle.cli)
            raise TreadleError(str(exc)) from exc
        for path in paths:
            console.print(f"wrote {path}")
    return 0


def _measured_pipeline(path: str, price: dict) -> dict:
    """The measured pipeline of a ``treadle.run --trace`` ``-pipeline`` file (JSON, data only), checked to be the
    priced pipeline's (TreadleError naming the file otherwise)."""
    from ..schedule.gate import parse_json
    from ..viz.pipeline_timeline import pipeline_compare_rows

    doc = parse_json(Path(path).read_text(), source=path, error=TreadleError)
    measured = doc.get("otherData", {}).get("measured_pipeline") if isinstance(doc, dict) else None
    if not isinstance(measured, dict) or not isinstance(measured.get("ranks"), list):
        raise TreadleError(f"--measured {path}: no otherData.measured_pipeline; give the '-pipeline' file "
                           f"treadle.run --trace writes for a pipeline schedule")
    try:
        pipeline_compare_rows(price, measured)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise TreadleError(f"--measured {path}: {exc}") from exc
    return measured


def _mesh_roles(sch) -> str:
    """Every mesh axis of `sch` and its role ('dp=2 data-parallel x tp=2 tensor'), from what it recorded."""
    from ..viz.price_timeline import mesh_roles_text

    v = sch.view()
    tensor = {sh.axis for shards in v.param_shards.values() for sh in shards}
    tensor |= {sy.axis for sy in v.syncs if sy.axis} | {a for _, _, a in v.shard_attrs}
    tensor |= {a for _, a, _ in v.reduce_grads}
    data = set(v.data_parallel.axes) if v.data_parallel is not None else set()
    pipe = {v.extras["pipeline"]["axis"]} if v.extras.get("pipeline") else set()
    return mesh_roles_text(v.mesh.names, v.mesh.shape, data_axes=data, tensor_axes=tensor, pipeline_axes=pipe)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("price", help="predicted step time, memory and MFU of a saved schedule or plan")
    p.add_argument("file", help="schedule JSON (Schedule.to_json) or plan JSON (treadle plan -o)")
    p.add_argument("--model", help="named model (treadle.models.zoo), e.g. tiny-gpt2; default: the plan's")
    p.add_argument("--cluster", required=True, help="e.g. 2x2:cpu, 8x8:h100, or a ClusterSpec JSON file")
    p.add_argument("--batch", type=int, help="global batch size (default: the plan's, else 8)")
    p.add_argument("--seq", type=int, help="sequence length (default: the plan's, else 64)")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="threads each rank computes on (default: the cluster file's, else 1)")
    p.add_argument("--cores-per-host", type=int, default=None,
                   help="cores the ranks of one host share (default: the cluster file's, else not shared)")
    p.add_argument("--compile", action="store_true",
                   help="price the blocks under torch.compile, as treadle.run --compile runs them (NOTE [compiled step])")
    p.add_argument("--json", help="write the price (with its per-module breakdown and timeline) here")
    p.add_argument("--trace", metavar="FILE", help="write the priced step as a Chrome trace (Perfetto)")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML page of the price")
    p.add_argument("--png", metavar="PREFIX", help="write PREFIX-memory/-breakdown/-timeline.png (needs matplotlib)")
    p.add_argument("--measured", metavar="FILE", help="a pipeline's measured timeline (treadle.run --trace's "
                   "-pipeline file): a table beside the price, and drawn beside it in --trace / --html")
    p.set_defaults(func=_price_cmd)
