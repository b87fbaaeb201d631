"""Step time of a 2-stage GPT-2 pipeline on CPU gloo (world 2): GPipe vs 1F1B with 4 and 8 micro-batches, next to
the ideal bubble fraction (p - 1) / (m + p - 1), all in one run; the single-process step is the baseline.

    python bench/bench_pipeline.py                       # 8 layers, hidden 256, seq 128, batch 16
    python bench/bench_pipeline.py --layers 4 --steps 3  # quick
Each rank runs 1 thread (world 2 on 2 cores); the single-process baseline runs 1 thread too, so the ideal
pipelined step is about baseline / 2 / (1 - bubble) before communication. Prints a table and writes
bench/results/bench_pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch


def make_model(layers: int, hidden: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), vocab_size=1024, n_positions=1024,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def inputs(batch: int, seq: int) -> dict:
    ids = torch.randint(1, 1024, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def _rank(rank: int, world: int, cfg: dict, cases: list[tuple[str, int]]) -> list[float]:
    import torch.distributed as dist

    import treadle

    out = []
    for schedule, mb in cases:
        model = make_model(cfg["layers"], cfg["hidden"])
        sch = treadle.create_schedule(model, mesh=treadle.Mesh((2,), ("pp",)))
        sch[f"transformer.h.{cfg['layers'] // 2 - 1}"].cut_pipeline_stage()
        sch.pipeline(axis="pp", schedule=schedule, n_microbatches=mb, example_inputs=inputs(cfg["batch"], cfg["seq"]))
        pipe = treadle.build(sch)
        opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        times = []
        for i in range(cfg["warmup"] + cfg["steps"]):
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(**inputs(cfg["batch"], cfg["seq"]))
            opt.step()
            opt.zero_grad()
            if i >= cfg["warmup"]:
                times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out


def single_process(cfg: dict) -> float:
    torch.set_num_threads(1)
    model = make_model(cfg["layers"], cfg["hidden"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for i in range(cfg["warmup"] + cfg["steps"]):
        t0 = time.perf_counter()
        model(**inputs(cfg["batch"], cfg["seq"])).loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from treadle.testing import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    cfg = vars(ap.parse_args())
    cases = [("gpipe", 4), ("1f1b", 4), ("gpipe", 8), ("1f1b", 8)]
    base_s = single_process(cfg)
    per_rank = spawn(_rank, 2, cfg, cases, timeout_s=1800)
    rows = []
    for i, (schedule, mb) in enumerate(cases):
        step_s = max(r[i] for r in per_rank)
        bubble = (2 - 1) / (mb + 2 - 1)
        rows.append({"schedule": schedule, "microbatches": mb, "step_s": step_s, "ideal_bubble": bubble,
                     "speedup_vs_1proc": base_s / step_s, "ideal_speedup": 2 * (1 - bubble)})
    print(f"GPT-2 {cfg['layers']} layers, hidden {cfg['hidden']}, seq {cfg['seq']}, batch {cfg['batch']}; 2 stages on "
          f"world 2 (gloo, 1 thread per rank); median of {cfg['steps']} steps")
    print(f"single process (1 thread): {base_s * 1e3:.0f} ms/step")
    print(f"{'schedule':<9}{'m':>3}{'step ms':>10}{'vs 1 proc':>11}{'ideal bubble':>14}{'ideal vs 1 proc':>17}")
    for r in rows:
        print(f"{r['schedule']:<9}{r['microbatches']:>3}{r['step_s'] * 1e3:>10.0f}{r['speedup_vs_1proc']:>10.2f}x"
              f"{r['ideal_bubble']:>14.3f}{r['ideal_speedup']:>16.2f}x")
    out = Path(__file__).parent / "results" / "bench_pipeline.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"config": cfg, "single_process_s": base_s, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
