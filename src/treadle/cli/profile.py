"""`treadle profile`: profile a named model config or a `module:function` and print per-module and total figures."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import ProfileError
from .output import add_quiet_flag, is_quiet, progress

DTYPES = ("bfloat16", "float16", "float32")  # torch dtype names (torch is imported by the command, not the parser)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("profile", help="FLOPs, memory, time and MFU of one training step (fake tensors)",
                              description="Profile one training step (forward + backward) of a model on fake "
                                          "tensors: per-module FLOPs, saved activations, memory peak, roofline "
                                          "step time and MFU on a hardware spec.")
    p.add_argument("model", nargs="?", help="a named config (e.g. llama-2-70b, gpt2; see --list) or "
                                            "package.module:function returning (model, example_inputs)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--seq", type=int, default=512, help="sequence length (default 512)")
    p.add_argument("--hardware", default="h100-sxm",
                   help="v100-32gb, a100-40gb, a100-80gb, h100-sxm, h100-hbm2e-500w, h200, cpu (one nominal core), or a spec .json")
    p.add_argument("--recalibrate", action="store_true", help="measure this machine per core now (cpu only; not cached)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="parameter dtype (default bfloat16)")
    p.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="attention implementation")
    p.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw")
    p.add_argument("--depth", type=int, default=2, help="module depth shown in the table (0: model only)")
    p.add_argument("--forward-only", action="store_true", help="profile inference (no backward)")
    p.add_argument("--expand-blocks", action="store_true", help="one table row per block, not one per run")
    p.add_argument("--no-reuse", action="store_true", help="profile every repeated block (slower, same result)")
    p.add_argument("--json", metavar="FILE", help="write the whole profile (totals, modules, ops) as JSON")
    p.add_argument("--list", action="store_true", help="list the named configs and exit")
    p.add_argument("--trace", metavar="FILE", help="write the step as a Chrome trace, one slice per op (Perfetto)")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report (modules, memory over the step)")
    p.add_argument("--png", metavar="PREFIX", help="write PREFIX-memory.png (needs matplotlib: treadle[viz])")
    add_quiet_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..models.zoo import check_model_name, load_model, model_names

    if args.list:
        print("\n".join(model_names()))
        return 0
    if not args.model:
        raise ProfileError("give a model name (see --list) or package.module:function")
    check_model_name(args.model)  # before anything is imported or built
    import torch
    from rich.console import Console

    from ..profile.profiler import profile
    from ..profile.table import module_table, summary_table
    from .output import console

    out = console()
    err = Console(stderr=True)
    hardware = args.hardware
    if args.recalibrate or hardware == "cpu":
        from ..profile.hardware import cpu_spec

        hardware = cpu_spec(recalibrate=args.recalibrate) if hardware == "cpu" else hardware
    with progress(f"profiling {args.model}", quiet=is_quiet(args), console=err) as report:
        report("building the model (fake tensors)")
        kwargs = {"dtype": getattr(torch, args.dtype), "attn": args.attn} if ":" not in args.model else {}
        model, inputs = load_model(args.model, batch=args.batch, seq=args.seq, fake=True, **kwargs)
        prof = profile(model, inputs, hardware=hardware, train=not args.forward_only,
                       optimizer=args.optimizer, reuse_blocks=not args.no_reuse, name=args.model,
                       progress=report)
    out.print(module_table(prof, depth=args.depth, collapse_blocks=not args.expand_blocks))
    out.print(summary_table(prof))
    if args.json:
        doc = prof.to_dict()
        doc["args"] = {k: v for k, v in vars(args).items() if k != "func"}
        Path(args.json).write_text(json.dumps(doc))
        out.print(f"wrote {args.json}")
    if args.trace or args.html or args.png:
        from ..viz.files import write_profile_pictures

        for path in write_profile_pictures(prof, trace=args.trace, html=args.html, png=args.png, depth=args.depth):
            out.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from ..cli import main

    sys.exit(main(["profile", *sys.argv[1:]]))
