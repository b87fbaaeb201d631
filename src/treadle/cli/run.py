"""`treadle run` (spawn `python -m treadle.run` on this host through torchrun) and `treadle export-hf`
(a Hugging Face directory from any sharded checkpoint)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Any

from ..run.config import LAUNCHER_ENV, RunConfig, RunError, add_arguments, config_from_args


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


def _root_cause_stack(exc: Any) -> str:
    """The call stack the first failed rank wrote to its error file (its traceback under --debug), or ""."""
    _, f = exc.get_first_failure()
    info = f.message.get("extraInfo", {}) if isinstance(f.message, dict) else {}
    return str(info.get("py_callstack", "")) if isinstance(info, dict) else ""


def _root_cause_line(exc: Any) -> tuple[str, int]:
    """(one line, exit status) for torchrun's ChildFailedError: the first failure's message (the line its rank
    wrote to its error file, `failure`), else its signal or exit code."""
    rank, f = exc.get_first_failure()
    msg = f.message.get("message", "") if isinstance(f.message, dict) else str(f.message)
    if not msg.startswith("treadle.run: "):
        msg = f"rank {rank} (pid {f.pid}) " + (f"killed by {f.signal_name()}" if f.exitcode < 0 else
                                               f"exited with code {f.exitcode}") + (f": {msg}" if msg else "")
    from ..run.failure import EXIT_USER

    return msg.strip().split("\n", 1)[0].removeprefix("treadle.run: "), EXIT_USER if f.exitcode == EXIT_USER else 1


def _run(args: argparse.Namespace) -> int:
    """Launch torchrun's agent in this process (no second interpreter, no ChildFailedError traceback): the
    settings, the files they name and the process count are checked first, against the world of --nproc
    ranks; a failed job is said in one line, the root cause's."""
    from ..run.precheck import check_before_start
    from ..testing import check_process_count, free_port

    debug = bool(getattr(args, "debug", False))

    if args.nproc < 1:
        raise RunError(f"--nproc must be >= 1 (processes on this host), got {args.nproc}")
    check_process_count(args.nproc, where="--nproc")

    try:  # every setting checked here, once, before any process starts
        cfg = config_from_args(args, say=lambda line: print(line.replace("treadle.run: ", "treadle run: ", 1),
                                                           file=sys.stderr))
        check_before_start(cfg, world=args.nproc)
    except RunError as exc:  # said by treadle's CLI as "treadle run: error: ..."
        raise RunError(str(exc).removeprefix("treadle.run: ")) from None
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_args, run as torchrun

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // args.nproc)))  # what each rank uses (loop)
    argv = ["--nproc-per-node", str(args.nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "-m", "treadle.run", *forwarded_args(args),
            *(["--debug"] if debug else [])]
    elastic = logging.getLogger("torch.distributed.elastic")
    level = elastic.level
    if not getattr(args, "verbose", 0):
        elastic.setLevel(logging.CRITICAL)  # its "closing signal" / "failed (exitcode)" lines: said below instead
    os.environ[LAUNCHER_ENV] = "1"  # the ranks leave the saying to this process (failure module)
    try:
        torchrun(torchrun_args(argv))
    except ChildFailedError as exc:
        line, status = _root_cause_line(exc)
        stack = _root_cause_stack(exc) if debug else ""
        if stack.strip() and stack.strip() != f"treadle.run: {line}":
            print(f"treadle run: the failed rank's traceback (--debug):\n{stack.rstrip()}", file=sys.stderr)
        print(f"treadle run: error: {line}", file=sys.stderr)
        return status
    except SignalException as exc:
        print(f"treadle run: {exc.sigval.name} received: the ranks save a checkpoint at the next step boundary "
              f"when they can (see above), then stop", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        os.environ.pop(LAUNCHER_ENV, None)
        elastic.setLevel(level)
    return 0


def _export(args: argparse.Namespace) -> int:
    from ..run.checkpoint import export_hf
    from ..run.setup import load_run_model

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
