"""`treadle verify` and `treadle train`: check or try a saved schedule (or plan) on CPU gloo processes."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import TreadleError
from .output import add_quiet_flag, is_quiet, progress

if TYPE_CHECKING:
    from rich.table import Table

    from ..verify.verify import VerifyReport


def _schedule_mesh(schedule_text: str, source: str) -> dict[str, int]:
    """{axis: size} of a schedule file's mesh, read as data (nothing built). Raises TreadleError naming `source`
    when the schedule holds no readable mesh."""
    from ..schedule.gate import parse_json

    saved = parse_json(schedule_text, source=source, error=TreadleError)
    mesh = saved.get("mesh") if isinstance(saved, dict) else None
    shape, names = (mesh.get("shape"), mesh.get("names")) if isinstance(mesh, dict) else (None, None)
    if not (isinstance(shape, list) and isinstance(names, list) and len(shape) == len(names) and shape
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)):
        raise TreadleError(f"{source}: no mesh in the schedule; is it a treadle schedule or plan?")
    return dict(zip(map(str, names), shape))


def _check_world(axes: dict[str, int], args: argparse.Namespace) -> None:
    """The schedule's world against --world and this host's process limit, before any model is built: verify
    and train run one gloo process per device of the mesh."""
    from ..testing import check_process_count

    world = math.prod(axes.values())
    if args.world and args.world != world:
        raise TreadleError(f"{args.file}: the schedule's mesh {axes} needs world size {world}, not --world "
                           f"{args.world}; {args.command} runs one CPU process per device: give --world {world}, "
                           f"or plan for {args.world} devices (e.g. treadle plan MODEL --cluster {args.world}:cpu)")
    check_process_count(world, where=f"{args.command} {args.file} (mesh {axes})")


def _load(args: argparse.Namespace):
    """(schedule, example inputs) from a schedule JSON or a plan JSON (whose "schedule" and "model" keys
    say what to rebuild). --model/--batch/--seq override the plan's model. The file is data (NOTE [files are
    data]): a plan's decisions are checked as `Plan.from_dict` checks them, its schedule as any schedule file,
    and its model must be a zoo name (never imported). Everything the file and the flags say is checked before
    the model is built: the mesh against --world and the host, the model's name, batch and seq."""
    from ..models.zoo import check_model_name, zoo_name_from_file
    from ..schedule.gate import parse_json

    text = Path(args.file).read_text()
    doc = parse_json(text, source=args.file, error=TreadleError, unparsable=": not a JSON file")
    if not isinstance(doc, dict):
        raise TreadleError(f"{args.file}: expected a JSON object (a schedule or a plan), got {type(doc).__name__}")
    schedule_text = json.dumps(doc["schedule"]) if "schedule" in doc else text
    if isinstance(doc.get("schedule"), str):
        schedule_text = doc["schedule"]
    _check_world(_schedule_mesh(schedule_text, args.file), args)
    model_info = doc.get("model") or {} if "schedule" in doc else {}
    if not isinstance(model_info, dict):
        raise TreadleError(f"{args.file}: 'model' must be an object with name, batch, seq; got {model_info!r:.80}")
    name = args.model or (model_info.get("name") and zoo_name_from_file(model_info["name"], source=args.file))
    if not name:
        raise TreadleError(f"{args.file}: name the model with --model (e.g. tiny-gpt2); the file does not say")
    check_model_name(name)
    batch = args.batch or model_info.get("batch", 4)
    seq = args.seq or model_info.get("seq", 16)
    if not (isinstance(name, str) and isinstance(batch, int) and isinstance(seq, int)) or min(batch, seq) < 1:
        raise TreadleError(f"{args.file}: the plan's model needs a zoo name and positive integer batch and seq; "
                           f"got {name!r:.80}, {batch!r:.40}, {seq!r:.40}")
    if doc.get("format") == "treadle.plan/1":
        from ..planner.plan import Plan

        Plan.from_dict(doc, source=args.file)
    from ..models.zoo import named_model
    from ..schedule.replay import load_schedule

    model, inputs = named_model(name, batch=batch, seq=seq, dropout=False)  # zoo names only: nothing imported
    return load_schedule(model, schedule_text, None, source=args.file), inputs


def report_table(report: VerifyReport, *, limit: int = 25) -> Table:
    """Failed checks one per row; when all passed, one row per kind of check with its worst error."""
    from rich.table import Table

    title = report.summary().splitlines()[0]
    if report.failures():
        t = Table("check", "name", "max abs", "max rel", "layout", title=title)
        for c in report.failures()[:limit]:
            t.add_row(c.kind, c.name, f"{c.diff.max_abs:.2e}", f"{c.diff.max_rel:.2e}", c.diff.layout)
        return t
    t = Table("check", "count", "worst max abs", "worst max rel", title=title)
    kinds: dict[str, list] = {}
    for c in report.checks:
        kinds.setdefault(c.kind, []).append(c)
    for kind, cs in kinds.items():
        finite = [c for c in cs if c.diff.max_abs == c.diff.max_abs]
        t.add_row(kind, str(len(cs)), f"{max((c.diff.max_abs for c in finite), default=0):.2e}",
                  f"{max((c.diff.max_rel for c in finite), default=0):.2e}")
    return t


def _verify(args: argparse.Namespace) -> int:
    sch, inputs = _load(args)
    from ..verify.verify import verify
    from .output import console as table_console

    console = table_console()
    with progress(f"verifying on {sch.mesh.world_size} gloo processes ({sch.mesh})", quiet=is_quiet(args)):
        report = verify(sch, inputs, steps=args.steps, raise_on_mismatch=False)
    if args.json:
        Path(args.json).write_text(json.dumps({"ok": report.ok, "losses": report.losses,
                                               "ref_losses": report.ref_losses,
                                               "first_divergence": report.first_divergence, "error": report.error,
                                               "checks": [{"kind": c.kind, "name": c.name, "ok": c.diff.ok,
                                                           "max_abs": c.diff.max_abs, "max_rel": c.diff.max_rel}
                                                          for c in report.checks]}, indent=1))
    console.print(report_table(report))
    if report.first_divergence:
        console.print(f"first divergence: {report.first_divergence}")
    if report.error:
        console.print(f"error: {report.error}")
    return 0 if report.ok else 1


def _train(args: argparse.Namespace) -> int:
    sch, inputs = _load(args)
    from rich.table import Table

    from ..runtime.train import train
    from .output import console as table_console

    console = table_console()
    with progress(f"training {args.steps} steps on {sch.mesh.world_size} gloo processes ({sch.mesh})",
                  quiet=is_quiet(args)):
        res = train(sch, inputs, steps=args.steps, lr=args.lr)
    t = Table("step", "loss", "step s")
    for i, (loss, s) in enumerate(zip(res.losses, res.step_s)):
        t.add_row(str(i), f"{loss:.4f}", f"{s:.3f}")
    console.print(t)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    for name, func, help_ in (("verify", _verify, "compare a schedule or plan with the original model on CPU gloo"),
                              ("train", _train, "train a schedule or plan a few steps on CPU gloo")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("file", help="schedule JSON (Schedule.to_json) or plan JSON (treadle plan -o)")
        p.add_argument("--model", help="named model (treadle.models.zoo), e.g. tiny-gpt2; default: the plan's")
        p.add_argument("--batch", type=int, help="global batch size (default: the plan's, else 4)")
        p.add_argument("--seq", type=int, help="sequence length (default: the plan's, else 16)")
        p.add_argument("--world", type=int, help="number of processes; must equal the schedule's mesh size")
        p.add_argument("--steps", type=int, default=2 if name == "verify" else 5)
        if name == "train":
            p.add_argument("--lr", type=float, default=1e-3)
        else:
            p.add_argument("--json", help="write the report's rows to this file")
        add_quiet_flag(p)
        p.set_defaults(func=func)

