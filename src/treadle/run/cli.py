"""`treadle run` (spawn `python -m treadle.run` on this host through torchrun) and `treadle export-hf`
(a Hugging Face directory from any sharded checkpoint)."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

from .config import RunConfig, add_arguments


def forwarded_args(args: argparse.Namespace) -> list[str]:
    """The `python -m treadle.run` options that `args` sets (given on the command line)."""
    out: list[str] = []
    if getattr(args, "config", None):
        out += ["--config", args.config]
    for f in dataclasses.fields(RunConfig):
        v = getattr(args, f.name, None)
        if v is None:
            continue
        flag = "--memory-budget" if f.name == "memory_budget_bytes" else "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + flag[2:])
        elif isinstance(v, (list, tuple)):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out


def _run(args: argparse.Namespace) -> int:
    from ..testing import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "treadle.run",
           *forwarded_args(args)]
    return subprocess.call(cmd)


def _export(args: argparse.Namespace) -> int:
    from .checkpoint import export_hf
    from .setup import load_run_model

    model = load_run_model(args.model, seq=1, seed=0)
    export_hf(args.checkpoint, model, args.output)
    print(f"wrote {args.output}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train on this host: torchrun --nproc-per-node N -m treadle.run ...")
    p.add_argument("--nproc", type=int, default=1, help="processes (ranks) on this host")
    add_arguments(p)
    p.set_defaults(func=_run)
    e = sub.add_parser("export-hf", help="write a Hugging Face save_pretrained directory from a checkpoint")
    e.add_argument("checkpoint", help="a checkpoint directory written by treadle.run (<ckpt-dir>/step_N)")
    e.add_argument("--model", required=True, help="the model the run trained (zoo name, HF config, pkg.mod:fn)")
    e.add_argument("-o", "--output", required=True, help="output directory")
    e.set_defaults(func=_export)
