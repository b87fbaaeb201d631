"""Throughput of `python -m treadle.run` against a plain DDP training loop: the same model (tiny LLaMA or any
zoo name), the same packed data, the same AdamW + warmup/cosine + clipping, 4 gloo ranks under torchrun.

The plain loop is what a user writes by hand: `DistributedDataParallel`, a random permutation per epoch split
over the ranks, `clip_grad_norm_`, `loss.item()`. treadle.run adds its sampler, the global-norm clip over
placements, a loss all-reduce and the metrics line; the overhead column is that cost. Each mode runs in its
own torchrun job; step times are the median over the steps after `--warmup` (first steps excluded).

    python bench/bench_run.py                       # tiny-llama, seq 128, batch 16, 30 steps, 4 ranks
    python bench/bench_run.py --model tiny-gpt2 --steps 20
Prints a table and writes bench/results/bench_run.json. Timings on a shared CPU are noisy: run it twice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "examples" / "data" / "village.txt"


def plain_ddp_main(args: argparse.Namespace) -> None:
    """One rank of the hand-written loop (run under torchrun by `main`)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from treadle.run.config import RunConfig
    from treadle.run.data import ByteTokenizer, pack
    from treadle.run.optim import lr_at
    from treadle.run.setup import load_run_model

    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = RunConfig(model=args.model, data=[str(CORPUS)], seq=args.seq, batch=args.batch, steps=args.steps,
                    lr=3e-3, warmup_steps=5)
    model = nn.parallel.DistributedDataParallel(load_run_model(cfg.model, seq=cfg.seq, seed=0))
    samples = pack(cfg.data, seq=cfg.seq, tokenizer=ByteTokenizer(), vocab_size=256)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    per = cfg.batch // world
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0))
    times, tokens = [], cfg.batch * cfg.seq
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        start = (step * cfg.batch + rank * per) % (len(samples) - per)
        ids = samples[order[start : start + per]]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        times.append(time.perf_counter() - t0)
        if rank == 0:
            print(json.dumps({"step": step + 1, "loss": loss_value, "step_s": times[-1],
                              "tokens_per_s": tokens / times[-1]}), flush=True)
    dist.destroy_process_group()


def _torchrun(nproc: int, *cmd: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    from treadle.testing import free_port

    full = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), *cmd]
    res = subprocess.run(full, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(full)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return res.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--plain-rank", action="store_true", help=argparse.SUPPRESS)  # one rank of the plain loop
    args = p.parse_args()
    if args.plain_rank:
        return plain_ddp_main(args)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        _torchrun(args.nproc, "-m", "treadle.run", "--model", args.model, "--data", str(CORPUS), "--seq",
                  str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps), "--lr", "3e-3",
                  "--warmup-steps", "5", "--recipe", "ddp", "--hardware", "none", "--metrics", str(metrics))
        treadle_rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    out = _torchrun(args.nproc, str(Path(__file__).resolve()), "--plain-rank", "--model", args.model,
                    "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps))
    plain_rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    rows = {}
    for name, rs in (("treadle.run (ddp recipe)", treadle_rows), ("plain DDP loop", plain_rows)):
        step_s = statistics.median(r["step_s"] for r in rs[args.warmup :])
        rows[name] = {"step_s": step_s, "tokens_per_s": args.batch * args.seq / step_s,
                      "first_loss": rs[0]["loss"], "last_loss": rs[-1]["loss"]}
    base = rows["plain DDP loop"]["tokens_per_s"]
    from rich.console import Console
    from rich.table import Table

    t = Table("loop", "median step ms", "tokens/s", "vs plain", "loss first -> last",
              title=f"{args.model}, seq {args.seq}, batch {args.batch}, {args.nproc} gloo ranks, {args.steps} steps")
    for name, r in rows.items():
        t.add_row(name, f"{r['step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
                  f"{(r['tokens_per_s'] / base - 1) * 100:+.1f}%", f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}")
    Console().print(t)
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_run.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
