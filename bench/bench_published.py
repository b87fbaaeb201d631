"""Predicted against published: torchtitan's Llama 3.1 8B runs on H100, written as treadle schedules and priced.

Issue 28's bench. Each row is one published configuration, with its file and table, written as a treadle schedule
of the same model (`treadle.models.zoo` "llama-3-8b": Llama 3.1 8B's shapes; bf16 parameters with fp32 master
weights and AdamW states, as FSDP2's mixed precision keeps them), the same mesh, local batch and sequence, and the
same activation checkpointing (torchtitan's default for these runs, op-level selective AC:
``checkpoint_every(1, policy="alternate-matmuls")``, NOTE [checkpoint policies as peers define them]), eager or
compiled as published (``execution="compiled"``: NOTE [compiled step]). The device is the one torchtitan measured
on (preset ``h100-hbm2e-500w``: 96 GB HBM2e at 2.4 TB/s, 500 W; NVLink inside a host, 400 Gb/s RDMA across). One
set of hardware constants for every row; nothing is fitted to a row.

Columns: predicted and published tokens/s per GPU and their ratio (target: within [0.9, 1.1]); predicted peak and
published memory (torchtitan logs the allocator's peak *reserved* memory, treadle predicts allocated bytes: the
caching allocator's fragmentation is not in the prediction) and their ratio (target: within 10%). The float8 rows
(Tables 1 and 3, row 3) state ``float8(recipe="tensorwise", all_gather=True)`` on the blocks, as torchtitan ran
float8 then (tensorwise scales, FSDP2's float8 all-gather; the output projection stays bf16); the rows that need
context parallelism or float8 under tensor parallelism (Tables 2, 4-6) are listed as not priced. Row group "ao" is
torchao's own float8 table (torchtitan, 8 H100, local batch 1, compiled, op SAC: bf16, tensorwise with float8
all-gather, rowwise with bf16 all-gather); its H100 is taken to be the same part as torchtitan's tables.

With ``--plan``, each row's configuration is also planned (`plan_model` with the same model, cluster, batch,
sequence and the device's memory, eager or compiled as the row runs, float8 allowed where the row uses it) and the
plan's price is set beside the recipe's (target: the plan predicted at least as fast). Writes bench/results/bench_published.json.

    .venv/bin/python bench/bench_published.py [--rows 8gpu 128gpu ao] [--plan [--checkpoint-policy alternate-matmuls]]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
GiB = 2**30
TT = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
AO = "pytorch/ao torchao/float8/README.md, Training benchmarks, NVIDIA H100"
F8 = ("tensorwise", True)  # torchtitan's float8 of Dec 2024: tensorwise scales, FSDP2's float8 all-gather
# (key, label, source, cluster, mesh size, local batch, seq, execution, float8 (recipe, all_gather) or None,
#  published tokens/s/GPU, published GiB)
ROWS = [
    ("8gpu", "Llama 3.1 8B, FSDP 8, op SAC, eager", f"{TT} Table 1 row 1", "1x8:h100-96gb", 8, 2, 8192, "eager", None,
     5762, 82.4),
    ("8gpu", "Llama 3.1 8B, FSDP 8, op SAC, torch.compile", f"{TT} Table 1 row 2", "1x8:h100-96gb", 8, 2, 8192,
     "compiled", None, 6667, 77.0),
    ("8gpu", "Llama 3.1 8B, FSDP 8, op SAC, compile, float8", f"{TT} Table 1 row 3", "1x8:h100-96gb", 8, 2, 8192,
     "compiled", F8, 8532, 76.8),
    ("128gpu", "Llama 3.1 8B, FSDP 128, op SAC, eager", f"{TT} Table 3 row 1", "16x8:h100-96gb", 128, 2, 8192,
     "eager", None, 5605, 67.0),
    ("128gpu", "Llama 3.1 8B, FSDP 128, op SAC, torch.compile", f"{TT} Table 3 row 2", "16x8:h100-96gb", 128, 2,
     8192, "compiled", None, 6514, 62.0),
    ("128gpu", "Llama 3.1 8B, FSDP 128, op SAC, compile, float8", f"{TT} Table 3 row 3", "16x8:h100-96gb", 128, 2,
     8192, "compiled", F8, 8380, 61.8),
    # torchao's float8 table: 8 H100 (taken as torchtitan's part), local batch 1, compile, FSDP2, per-op SAC
    ("ao", "Llama 3 8B, FSDP 8, op SAC, compile, batch 1", f"{AO} row 1", "1x8:h100-96gb", 8, 1, 8192, "compiled",
     None, 6150, 47.65),
    ("ao", "same, float8 tensorwise + float8 all-gather", f"{AO} row 2", "1x8:h100-96gb", 8, 1, 8192, "compiled",
     ("tensorwise", True), 7689.5, 47.77),
    ("ao", "same, float8 rowwise, bf16 all-gather", f"{AO} row 3", "1x8:h100-96gb", 8, 1, 8192, "compiled",
     ("rowwise", False), 6768, 47.79),
]
NOT_PRICED = [
    (f"{TT} Table 2, Table 6", "context parallelism + Float8", "context parallelism"),
    (f"{TT} Tables 4, 5", "70B / 405B with Float8 and AsyncTP", "float8 with tensor parallelism, async TP"),
]


def price_row(row) -> dict:
    from treadle.cost.cluster import parse_cluster
    from treadle.mesh import Mesh
    from treadle.models.zoo import named_model
    from treadle.pricing import price
    from treadle.schedule.core import create_schedule

    key, label, source, cluster_spec, world, local, seq, execution, float8, tps, mem = row
    model, inputs = named_model("llama-3-8b", batch=local * world, seq=seq, fake=True, dtype=torch.bfloat16)
    model.config.use_cache = False
    sch = create_schedule(model, mesh=Mesh((world,), ("dp",)))
    sch["model.layers"].checkpoint_every(1, policy="alternate-matmuls")
    sch.data_parallel(axis="dp", shard=True)
    if float8:  # every linear of the blocks (torchtitan leaves the output projection in bf16)
        sch["model.layers"].float8(recipe=float8[0], all_gather=float8[1])
    t0 = time.perf_counter()
    p = price(sch, inputs, parse_cluster(cluster_spec), execution=execution)
    tokens = local * seq / p.step_s
    return {"row": label, "source": source, "cluster": cluster_spec, "execution": execution,
            "float8": list(float8) if float8 else None,
            "local_batch": local,
            "seq": seq, "predicted_tokens_per_s_per_gpu": tokens, "published_tokens_per_s_per_gpu": tps,
            "tokens_ratio": tokens / tps, "predicted_peak_gib": p.peak_bytes / GiB, "published_memory_gib": mem,
            "memory_ratio": p.peak_bytes / GiB / mem, "step_s": p.step_s, "mfu_bf16_peak": p.mfu,
            "exposed_comm_s": p.exposed_comm_s, "recompute_s": p.recompute_s, "price_s": time.perf_counter() - t0}


def plan_row(row, policies: tuple[str, ...] = ()) -> dict:
    """Part 6: the planner's own choice for the same model, cluster, batch, sequence and memory (the device's), run
    as the row runs (eager or compiled), allowed float8 where the row uses it (NOTE [execution and float8 in the
    plan]), allowed the selective checkpoint `policies` (NOTE [checkpoint policies in the plan]; the rows run op
    SAC), priced by the same function (`plan.estimate()`: the price of `plan.schedule` as it runs)."""
    from treadle.cost.cluster import parse_cluster
    from treadle.models.zoo import named_model
    from treadle.planner import TrainSpec, plan_model

    key, label, source, cluster_spec, world, local, seq, execution, float8, tps, mem = row
    model, inputs = named_model("llama-3-8b", batch=local * world, seq=seq, fake=True, dtype=torch.bfloat16)
    model.config.use_cache = False
    cluster = parse_cluster(cluster_spec)
    t0 = time.perf_counter()
    plan = plan_model(model, inputs, cluster=cluster, memory_budget_bytes=cluster.rank_hardware().memory_bytes,
                      price_top=1, execution=execution, float8=float8[0] if float8 else None,
                      pp_axis="auto" if execution == "eager" else None, train=TrainSpec(checkpoint_policies=policies))
    est = plan.estimate()
    return {"against": label, "roles": str(plan.roles), "mesh": str(plan.cluster.mesh), "step_s": est.step_s,
            "checkpoints": plan.solver.get("checkpoints"), "policies": plan.solver.get("policies"),
            "predicted_tokens_per_s_per_gpu": local * seq / est.step_s, "predicted_peak_gib": est.peak_bytes / GiB,
            "planning_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=["8gpu", "128gpu", "ao"], help="which row groups (8gpu, 128gpu, ao)")
    ap.add_argument("--plan", action="store_true", help="also plan each row's configuration and compare")
    ap.add_argument("--checkpoint-policy", action="append", default=[], metavar="NAME",
                    help="with --plan: let the plans use this selective checkpoint policy (e.g. alternate-matmuls)")
    args = ap.parse_args()
    out, plans = [], []
    print(f"{'configuration':48} {'pred tok/s':>10} {'published':>9} {'ratio':>6} {'pred GiB':>8} {'pub GiB':>7} "
          f"{'ratio':>6}")
    for row in ROWS:
        if row[0] not in args.rows:
            continue
        r = price_row(row)
        out.append(r)
        print(f"{r['row']:48} {r['predicted_tokens_per_s_per_gpu']:10,.0f} {r['published_tokens_per_s_per_gpu']:9,} "
              f"{r['tokens_ratio']:6.2f} {r['predicted_peak_gib']:8.1f} {r['published_memory_gib']:7.1f} "
              f"{r['memory_ratio']:6.2f}", flush=True)
        if args.plan:
            q = plan_row(row, tuple(args.checkpoint_policy))
            q["speedup_vs_recipe"] = r["step_s"] / q["step_s"]
            plans.append(q)
            print(f"  planner: {q['roles']} on {q['mesh']}: {q['predicted_tokens_per_s_per_gpu']:,.0f} tok/s/GPU, "
                  f"{q['predicted_peak_gib']:.1f} GiB, {q['speedup_vs_recipe']:.2f}x the recipe's predicted step "
                  f"(planned in {q['planning_s']:.0f} s; checkpoints {q['checkpoints']}, policies {q['policies']})",
                  flush=True)
    # float8 against the same run in bf16 (same group, batch and execution): the speedup predicted vs published
    for r in out:
        base = next((b for b in out if r["float8"] and not b["float8"] and b["cluster"] == r["cluster"]
                     and b["local_batch"] == r["local_batch"] and b["execution"] == r["execution"]), None)
        if base is not None:
            r["float8_speedup"] = {"predicted": base["step_s"] / r["step_s"],
                                   "published": r["published_tokens_per_s_per_gpu"]
                                   / base["published_tokens_per_s_per_gpu"]}
            f = r["float8_speedup"]
            print(f"float8 speedup, {r['row']}: predicted {f['predicted']:.3f}x, published {f['published']:.3f}x "
                  f"(ratio {f['predicted'] / f['published']:.3f})")
    for source, what, why in NOT_PRICED:
        print(f"not priced: {what} ({source}): needs {why}")
    inside = [abs(r["tokens_ratio"] - 1) <= 0.1 for r in out]
    print(f"tokens/s within [0.9, 1.1]: {sum(inside)} of {len(out)}; memory within 10%: "
          f"{sum(abs(r['memory_ratio'] - 1) <= 0.1 for r in out)} of {len(out)}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_published.json").write_text(json.dumps(
        {"device": "h100-hbm2e-500w", "rows": out, "plans": plans, "not_priced": [list(x) for x in NOT_PRICED]},
        indent=2))


if __name__ == "__main__":
    main()
