"""Throughput of `python -m treadle.run` against a plain DDP training loop: the same model (tiny LLaMA or any
zoo name), the same packed data, the same AdamW + warmup/cosine + clipping, 4 gloo ranks under torchrun.

The plain loop is what a user writes by hand: `DistributedDataParallel`, a random permutation per epoch split
over the ranks, `clip_grad_norm_`, `loss.item()`. treadle.run adds its sampler, the global-norm clip over
placements, a loss all-reduce and the metrics line; the overhead column is that cost. Each mode runs in its
own torchrun job, `--rounds` times, interleaved (the order alternating); a loop's step time is the median over
rounds of its median step after `--warmup` (first steps excluded).

    python bench/bench_run.py                       # tiny-llama, seq 128, batch 16, 30 steps, 4 ranks
    python bench/bench_run.py --model tiny-gpt2 --steps 20
    python bench/bench_run.py --pipeline            # PP2 x DP2 (1F1B, 4 micro-batches) vs a hand pipelining loop
    python bench/bench_run.py --pipeline --in-process --steps 60   # the two steps alone, in one job

`--pipeline` compares treadle.run on a PP2 x DP2 schedule (cut after the middle block, `pipeline(schedule="1f1b")`,
`data_parallel(shard=False)`) with the loop a user writes on `torch.distributed.pipelining` over the same stages
(a LLaMA-family model split by hand: embedding + first half of the blocks, second half + norm + head; the same
1F1B schedule and micro-batches; the replicas' gradients averaged in one flat all-reduce; the global norm clip
over both stages; the loss broadcast from the last stage).
`--in-process` builds both in the same torchrun job and alternates their steps after a barrier: the step alone
(treadle's `run_step` against the hand step), without the job-to-job spread of this shared host.
Prints a table and writes bench/results/bench_run.json (bench_run_pipeline.json, bench_run_pipeline_in_process.json). Timings on a shared CPU are
noisy: run it twice.
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


def _hand_stages(model, cut: int):
    """The two stages of a LLaMA-family causal LM, written by hand as a user would for pipelining."""
    import torch
    from torch import nn

    inner = model.model

    class First(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens, self.rotary_emb = inner.embed_tokens, inner.rotary_emb
            self.layers = nn.ModuleList(inner.layers[:cut])

        def forward(self, ids):
            h = self.embed_tokens(ids)
            pos = torch.arange(ids.shape[1], device=ids.device)[None]
            pe = self.rotary_emb(h, position_ids=pos)
            for layer in self.layers:  # no mask: SDPA's causal path, as the model's own forward takes
                h = layer(h, position_embeddings=pe, position_ids=pos)
            return h

    class Last(nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary_emb, self.norm, self.lm_head = inner.rotary_emb, inner.norm, model.lm_head
            self.layers = nn.ModuleList(inner.layers[cut:])

        def forward(self, h):
            pos = torch.arange(h.shape[1], device=h.device)[None]
            pe = self.rotary_emb(h, position_ids=pos)
            for layer in self.layers:
                h = layer(h, position_embeddings=pe, position_ids=pos)
            return self.lm_head(self.norm(h))

    return First(), Last()


def _hand_pipeline(cfg, args: argparse.Namespace, rank: int):
    """The hand PP2 x DP2 loop's model and step on this rank (mesh (pp, dp), rank = pp * 2 + dp): returns
    (dp_rank, step(ids, lr) -> the replica's loss, float, on every rank)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from treadle.run.setup import load_run_model

    pp_rank, dp_rank = divmod(rank, 2)
    pp_groups = [dist.new_group([d, 2 + d]) for d in range(2)]
    dp_groups = [dist.new_group([2 * p, 2 * p + 1]) for p in range(2)]
    pp_group, dp_group = pp_groups[dp_rank], dp_groups[pp_rank]
    model = load_run_model(cfg.model, seq=cfg.seq, seed=0)
    cut = len(model.model.layers) // 2
    mod = _hand_stages(model, cut)[pp_rank]
    stage = PipelineStage(mod, pp_rank, 2, torch.device("cpu"), group=pp_group)
    vocab = model.config.vocab_size

    def loss_fn(logits, ids):  # the model's causal-LM loss: predict the next token
        return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))

    sched = Schedule1F1B(stage, args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(mod.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    params = list(mod.parameters())

    def step(ids, lr: float) -> float:
        for g in opt.param_groups:
            g["lr"] = lr
        losses: list = []
        if pp_rank == 0:
            sched.step(ids)
        else:
            sched.step(target=ids, losses=losses)
        flat = torch._utils._flatten_dense_tensors([p.grad for p in params])
        dist.all_reduce(flat, group=dp_group)
        flat.div_(2)
        for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, [p.grad for p in params])):
            p.grad.copy_(g)
        sq = torch.stack([p.grad.detach().double().square().sum() for p in params]).sum()
        dist.all_reduce(sq, group=pp_group)  # both stages: the global norm
        coef = cfg.clip_norm / (float(sq.sqrt()) + 1e-6)
        if coef < 1:
            for p in params:
                p.grad.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = torch.stack(losses).mean().double() if losses else torch.zeros((), dtype=torch.float64)
        dist.broadcast(loss, 2 + dp_rank, group=pp_group)
        return float(loss)

    return dp_rank, step


def plain_pipeline_main(args: argparse.Namespace) -> None:
    """One rank of the hand-written PP2 x DP2 pipelining loop (mesh (pp, dp), rank = pp * 2 + dp)."""
    import torch
    import torch.distributed as dist

    from treadle.run.config import RunConfig
    from treadle.run.data import ByteTokenizer, pack
    from treadle.run.optim import lr_at

    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    rank = dist.get_rank()
    if dist.get_world_size() != 4:
        raise SystemExit("the hand pipelining loop runs PP2 x DP2: 4 ranks")
    cfg = RunConfig(model=args.model, data=[str(CORPUS)], seq=args.seq, batch=args.batch, steps=args.steps,
                    lr=3e-3, warmup_steps=5)
    dp_rank, step_fn = _hand_pipeline(cfg, args, rank)
    samples = pack(cfg.data, seq=cfg.seq, tokenizer=ByteTokenizer(), vocab_size=256)
    per = cfg.batch // 2
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0))
    times, tokens = [], cfg.batch * cfg.seq
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        start = (step * cfg.batch + dp_rank * per) % (len(samples) - per)
        loss = step_fn(samples[order[start : start + per]], lr_at(step, cfg))
        times.append(time.perf_counter() - t0)
        if rank == 0:
            print(json.dumps({"step": step + 1, "loss": loss, "step_s": times[-1],
                              "tokens_per_s": tokens / times[-1]}), flush=True)
    dist.destroy_process_group()


def in_process_main(args: argparse.Namespace) -> None:
    """One rank of `--in-process`: treadle's step (`treadle.run.step.run_step` on the built PP2 x DP2 schedule:
    the pipeline, the replicas' average, the agreement, the global-norm clip, AdamW) and the hand loop's step, both
    built in this process, run alternately on the same batches, each after a barrier; rank 0 prints the medians."""
    import torch
    import torch.distributed as dist

    from treadle import build
    from treadle.run.config import RunConfig
    from treadle.run.layout import layouts as param_layouts
    from treadle.run.layout import shards_by_name
    from treadle.run.optim import init_optimizer_state, lr_at, make_optimizer
    from treadle.run.step import run_step

    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    rank = dist.get_rank()
    cfg = RunConfig(model=args.model, data=[str(CORPUS)], seq=args.seq, batch=args.batch, steps=args.steps,
                    lr=3e-3, warmup_steps=5)
    sch = _pipeline_schedule(args)
    before = shards_by_name(sch)
    pipe = build(sch)
    layouts = param_layouts(pipe, before, sch.mesh, None)
    opt = make_optimizer(pipe, layouts, cfg)
    init_optimizer_state(opt)
    _, hand = _hand_pipeline(cfg, args, rank)
    per = args.batch // 2
    micro = per // args.microbatches
    gen = torch.Generator().manual_seed(rank // 2)  # one stream per replica: both stages see its batch
    times: dict[str, list[float]] = {"treadle": [], "hand": []}
    for step in range(args.steps):
        ids = torch.randint(0, 256, (per, args.seq), generator=gen)
        lr = lr_at(step, cfg)
        for name in (("treadle", "hand") if step % 2 == 0 else ("hand", "treadle")):
            dist.barrier()
            t0 = time.perf_counter()
            if name == "hand":
                hand(ids, lr)
            else:
                for g in opt.param_groups:
                    g["lr"] = lr
                run_step(pipe, opt, layouts, sch.mesh, list(ids.split(micro)), clip_norm=cfg.clip_norm)
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({k: v[args.warmup :] for k, v in times.items()}), flush=True)
    dist.destroy_process_group()


def _pipeline_schedule(args: argparse.Namespace, path: Path | None = None):
    """The PP2 x DP2 schedule treadle.run trains here (written to `path` when given); returns it."""
    import torch

    from treadle import Mesh, create_schedule
    from treadle.run.setup import load_run_model

    model = load_run_model(args.model, seq=args.seq, seed=0)
    sch = create_schedule(model, mesh=Mesh((2, 2), ("pp", "dp")))
    sch[f"model.layers.{len(model.model.layers) // 2 - 1}"].cut_pipeline_stage()
    sch.data_parallel(axis="dp", shard=False)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.int64)
    sch.pipeline(axis="pp", schedule="1f1b", n_microbatches=args.microbatches,
                 example_inputs={"input_ids": ids, "labels": ids})
    if path is not None:
        path.write_text(sch.to_json())
    return sch


def _torchrun(nproc: int, *cmd: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    from treadle.testing import free_port

    full = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), *cmd]
    res = subprocess.run(full, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(full)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return res.stdout


def in_process(args: argparse.Namespace) -> None:
    """`--pipeline --in-process`: the step alone, treadle's and the hand loop's in the same processes (no job-to-job
    spread, no loop around the step: sampler, metrics and health are not in it); prints and writes the medians."""
    if args.nproc != 4:
        raise SystemExit("--in-process runs PP2 x DP2: 4 ranks")
    out = _torchrun(4, str(Path(__file__).resolve()), "--in-process-rank", "--model", args.model, "--seq",
                    str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps), "--microbatches",
                    str(args.microbatches), "--warmup", str(args.warmup))
    times = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.model}, seq {args.seq}, batch {args.batch}, PP2 x DP2 1F1B x {args.microbatches}, 4 gloo ranks; "
          f"rank 0, median of {len(times['hand'])} steps each, alternating after a barrier")
    for k, v in med.items():
        print(f"  {k:8} step {v * 1e3:7.1f} ms  tokens/s {args.batch * args.seq / v:9,.0f}")
    print(f"  treadle / hand tokens/s: {med['hand'] / med['treadle']:.3f}")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_run_pipeline_in_process.json").write_text(json.dumps({"args": vars(args), "median_s": med,
                                                                            "step_s": times}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--pipeline", action="store_true", help="PP2 x DP2 against a hand pipelining loop (4 ranks)")
    p.add_argument("--microbatches", type=int, default=4, help="--pipeline: micro-batches per step")
    p.add_argument("--rounds", type=int, default=3, help="interleaved runs of each loop (median of their medians)")
    p.add_argument("--plain-rank", action="store_true", help=argparse.SUPPRESS)  # one rank of the plain loop
    p.add_argument("--plain-pipeline-rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--in-process", action="store_true",
                   help="--pipeline: both steps in one torchrun job, alternating step by step after a barrier")
    p.add_argument("--in-process-rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plain_rank:
        return plain_ddp_main(args)
    if args.plain_pipeline_rank:
        return plain_pipeline_main(args)
    if args.in_process_rank:
        return in_process_main(args)
    if args.in_process:
        return in_process(args)
    if args.pipeline and args.nproc != 4:
        raise SystemExit("--pipeline runs PP2 x DP2: 4 ranks")
    ours, theirs = (("treadle.run (PP2 x DP2 schedule)", "hand pipelining loop") if args.pipeline
                    else ("treadle.run (ddp recipe)", "plain DDP loop"))
    def run_ours(tmp: Path, k: int) -> list[dict]:
        metrics = tmp / f"m{k}.jsonl"
        how = ["--recipe", "ddp"]
        if args.pipeline:
            how = ["--schedule", str(tmp / "pp.json")]
        _torchrun(args.nproc, "-m", "treadle.run", "--model", args.model, "--data", str(CORPUS), "--seq",
                  str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps), "--lr", "3e-3",
                  "--warmup-steps", "5", *how, "--hardware", "none", "--metrics", str(metrics))
        return [json.loads(line) for line in metrics.read_text().splitlines()]

    def run_theirs() -> list[dict]:
        out = _torchrun(args.nproc, str(Path(__file__).resolve()),
                        "--plain-pipeline-rank" if args.pipeline else "--plain-rank", "--model", args.model,
                        "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
                        "--microbatches", str(args.microbatches))
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    runs: dict[str, list[list[dict]]] = {ours: [], theirs: []}
    with tempfile.TemporaryDirectory() as tmp:
        if args.pipeline:
            _pipeline_schedule(args, Path(tmp) / "pp.json")
        for k in range(args.rounds):  # interleaved, the order alternating: a drift of the host hits both
            for name in ((ours, theirs) if k % 2 == 0 else (theirs, ours)):
                runs[name].append(run_ours(Path(tmp), k) if name == ours else run_theirs())
    rows = {}
    for name, rounds in runs.items():
        per_round = [statistics.median(r["step_s"] for r in rs[args.warmup :]) for rs in rounds]
        step_s = statistics.median(per_round)
        rows[name] = {"step_s": step_s, "tokens_per_s": args.batch * args.seq / step_s, "round_step_s": per_round,
                      "first_loss": rounds[0][0]["loss"], "last_loss": rounds[0][-1]["loss"]}
    ratios = [b / a for a, b in zip(rows[ours]["round_step_s"], rows[theirs]["round_step_s"])]
    rows[ours]["round_ratio"] = ratios  # tokens/s ours / theirs, per round
    base = rows[theirs]["tokens_per_s"]
    from rich.console import Console
    from rich.table import Table

    t = Table("loop", "median step ms", "tokens/s", "vs plain", "loss first -> last",
              title=f"{args.model}, seq {args.seq}, batch {args.batch}, {args.nproc} gloo ranks, {args.steps} steps"
              + (f", 1F1B x {args.microbatches} micro-batches" if args.pipeline else "")
              + f"; median of {args.rounds} interleaved rounds")
    for name, r in rows.items():
        t.add_row(name, f"{r['step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
                  f"{(r['tokens_per_s'] / base - 1) * 100:+.1f}%", f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}")
    Console().print(t)
    print("per round, tokens/s of treadle.run / the hand loop: " + ", ".join(f"{r:.3f}" for r in ratios))
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "bench_run_pipeline.json" if args.pipeline else "bench_run.json"
    (out_dir / name).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
