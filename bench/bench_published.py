"""Predicted against published: torchtitan's Llama 3 runs on H100, written as treadle schedules and priced.

Issue 28's bench. Each row is one published configuration, with its file and table, written as a treadle schedule
of the same model (`treadle.models.zoo` "llama-3-8b" / "llama-3-70b": Llama 3.1's shapes; bf16 parameters with
fp32 master weights and AdamW states, as FSDP2's mixed precision keeps them), the same mesh, local batch and
sequence, and the same activation checkpointing (torchtitan's default for these runs, op-level selective AC:
``checkpoint_every(1, policy="alternate-matmuls")``, NOTE [checkpoint policies as peers define them]), eager or
compiled as published (``execution="compiled"``: NOTE [compiled step]). The device is the one torchtitan measured
on (preset ``h100-hbm2e-500w``: 96 GB HBM2e at 2.4 TB/s, 500 W; NVLink inside a host, 400 Gb/s RDMA across). One
set of hardware constants for every row; nothing is fitted to a row.

Columns: predicted and published tokens/s per GPU and their ratio (target: within [0.9, 1.1]); predicted peak and
published memory (torchtitan logs the allocator's peak *reserved* memory, treadle predicts allocated bytes: the
caching allocator's fragmentation is not in the prediction) and their ratio (target: within 10%). The float8 rows
(Tables 1 and 3, row 3) state ``float8(recipe="tensorwise", all_gather=True)`` on the blocks, as torchtitan ran
float8 then (tensorwise scales, FSDP2's float8 all-gather; the output projection stays bf16); the rows that need
context parallelism or async TP (Tables 2, 4-6) are listed as not priced. Row group "ao" is torchao's own float8
table (torchtitan, 8 H100, local batch 1, compiled, op SAC: bf16, tensorwise with float8 all-gather, rowwise with
bf16 all-gather); its H100 is taken to be the same part as torchtitan's tables. Row group "tp" is torchtitan's
async-TP table of June 2025, its vanilla-TP column (8B on 64 GPUs, FSDP 8 x TP 8, op SAC; 70B on 256, FSDP 32 x
TP 8, full AC; compiled; no memory published): TP written as Megatron's split with sequence parallelism
(`treadle.models.megatron.schedule_llama`), tokens counted once per TP group as torchtitan counts them, float8
tensorwise under TP with FSDP2's float8 all-gather (NOTE [float8 under tensor parallelism]; the table does not say;
torchtitan's Llama 3 configuration files turn it on), its rowwise rows not priced (build refuses rowwise under
TP).

With ``--plan``, each row's configuration is also planned (`plan_model` with the same model, cluster, batch,
sequence and the device's memory, eager or compiled as the row runs, float8 allowed where the row uses it) and the
plan's price is set beside the recipe's (target: the plan predicted at least as fast). Writes bench/results/bench_published.json.

    .venv/bin/python bench/bench_published.py [--rows 8gpu 128gpu ao tp]
        [--plan [--checkpoint-policy alternate-matmuls]]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import NamedTuple

import torch

RESULTS = Path(__file__).resolve().parent / "results"
GiB = 2**30
TT = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
ATP = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, vanilla TP column"
AO = "pytorch/ao torchao/float8/README.md, Training benchmarks, NVIDIA H100"
F8 = ("tensorwise", True)  # torchtitan's float8 of Dec 2024: tensorwise scales, FSDP2's float8 all-gather


class Row(NamedTuple):
    """One published run: its group, label and source; the cluster and the mesh (`world` ranks, `tp` of them a
    tensor-parallel group inside a host: Megatron's column/row split with sequence parallelism, as torchtitan's TP
    is); local batch per data-parallel rank, sequence, execution; float8 (recipe, all_gather) or None; the published
    tokens/s/GPU and memory (GiB, None where not published); activation checkpointing ("op": torchtitan's op-level
    SAC; "full": every block)."""

    key: str
    label: str
    source: str
    cluster: str
    world: int
    local: int
    seq: int
    execution: str
    float8: tuple[str, bool] | None
    tps: float
    mem: float | None
    tp: int = 1
    ac: str = "op"
    model: str = "llama-3-8b"


ROWS = [
    Row("8gpu", "Llama 3.1 8B, FSDP 8, op SAC, eager", f"{TT} Table 1 row 1", "1x8:h100-96gb", 8, 2, 8192, "eager",
        None, 5762, 82.4),
    Row("8gpu", "Llama 3.1 8B, FSDP 8, op SAC, torch.compile", f"{TT} Table 1 row 2", "1x8:h100-96gb", 8, 2, 8192,
        "compiled", None, 6667, 77.0),
    Row("8gpu", "Llama 3.1 8B, FSDP 8, op SAC, compile, float8", f"{TT} Table 1 row 3", "1x8:h100-96gb", 8, 2, 8192,
        "compiled", F8, 8532, 76.8),
    Row("128gpu", "Llama 3.1 8B, FSDP 128, op SAC, eager", f"{TT} Table 3 row 1", "16x8:h100-96gb", 128, 2, 8192,
        "eager", None, 5605, 67.0),
    Row("128gpu", "Llama 3.1 8B, FSDP 128, op SAC, torch.compile", f"{TT} Table 3 row 2", "16x8:h100-96gb", 128, 2,
        8192, "compiled", None, 6514, 62.0),
    Row("128gpu", "Llama 3.1 8B, FSDP 128, op SAC, compile, float8", f"{TT} Table 3 row 3", "16x8:h100-96gb", 128, 2,
        8192, "compiled", F8, 8380, 61.8),
    # torchao's float8 table: 8 H100 (taken as torchtitan's part), local batch 1, compile, FSDP2, per-op SAC
    Row("ao", "Llama 3 8B, FSDP 8, op SAC, compile, batch 1", f"{AO} row 1", "1x8:h100-96gb", 8, 1, 8192, "compiled",
        None, 6150, 47.65),
    Row("ao", "same, float8 tensorwise + float8 all-gather", f"{AO} row 2", "1x8:h100-96gb", 8, 1, 8192, "compiled",
        ("tensorwise", True), 7689.5, 47.77),
    Row("ao", "same, float8 rowwise, bf16 all-gather", f"{AO} row 3", "1x8:h100-96gb", 8, 1, 8192, "compiled",
        ("rowwise", False), 6768, 47.79),
    # torchtitan's async-TP table, its vanilla-TP column (no memory published); the float8 rows' FSDP2 gather is not
    # stated there: taken in float8, as torchtitan's Llama 3 configuration files state it
    Row("tp", "Llama 3.1 8B, FSDP 8 x TP 8, op SAC, compile, batch 12", f"{ATP}, 8B row 1", "8x8:h100-96gb", 64, 12,
        8192, "compiled", None, 4378, None, tp=8),
    Row("tp", "same, float8 tensorwise", f"{ATP}, 8B row 2", "8x8:h100-96gb", 64, 12, 8192,
        "compiled", F8, 5078.1, None, tp=8),
    Row("tp", "Llama 3 70B, FSDP 32 x TP 8, full AC, compile, batch 16", f"{ATP}, 70B row 1", "32x8:h100-96gb", 256,
        16, 8192, "compiled", None, 597.3, None, tp=8, ac="full", model="llama-3-70b"),
    Row("tp", "same, float8 tensorwise", f"{ATP}, 70B row 2", "32x8:h100-96gb", 256, 16, 8192,
        "compiled", F8, 809.8, None, tp=8, ac="full", model="llama-3-70b"),
]
NOT_PRICED = [
    (f"{TT} Table 2, Table 6", "context parallelism + Float8", "context parallelism"),
    (f"{TT} Tables 4, 5", "70B / 405B with Float8 and AsyncTP", "async TP"),
    (f"{ATP}, rows 3", "float8 rowwise under TP (8B: 3,708.5, 70B: 599.6)",
     "rowwise float8 under tensor parallelism (refused by build: NOTE [float8 under tensor parallelism])"),
    (f"{ATP}, async TP column", "async TP", "async TP"),
]


def _schedule(row: Row):
    """The row's model (fake, bf16) and inputs, and its schedule as published."""
    from treadle.mesh import Mesh
    from treadle.models.megatron import schedule_llama
    from treadle.models.zoo import named_model
    from treadle.schedule.core import create_schedule

    dp = row.world // row.tp
    model, inputs = named_model(row.model, batch=row.local * dp, seq=row.seq, fake=True, dtype=torch.bfloat16)
    model.config.use_cache = False
    if row.tp == 1:
        sch = create_schedule(model, mesh=Mesh((dp,), ("dp",)))
    else:
        sch = create_schedule(model, mesh=Mesh((dp, row.tp), ("dp", "tp")))
        schedule_llama(sch, tp="tp", sequence_parallel=True)
    if row.ac == "op":
        sch["model.layers"].checkpoint_every(1, policy="alternate-matmuls")
    else:
        sch["model.layers"].checkpoint_every(1)
    sch.data_parallel(axis="dp", shard=True)
    if row.float8:  # every linear of the blocks (torchtitan leaves the output projection in bf16)
        sch["model.layers"].float8(recipe=row.float8[0], all_gather=row.float8[1])
    return model, inputs, sch


def price_row(row: Row) -> dict:
    from treadle.cost.cluster import parse_cluster
    from treadle.pricing import price

    model, inputs, sch = _schedule(row)
    t0 = time.perf_counter()
    p = price(sch, inputs, parse_cluster(row.cluster), execution=row.execution)
    tokens = row.local * row.seq / row.tp / p.step_s  # torchtitan: a TP group's tokens counted once per GPU
    mem = p.peak_bytes / GiB
    return {"row": row.label, "source": row.source, "cluster": row.cluster, "execution": row.execution,
            "float8": list(row.float8) if row.float8 else None, "tp": row.tp, "ac": row.ac, "model": row.model,
            "local_batch": row.local, "seq": row.seq, "predicted_tokens_per_s_per_gpu": tokens,
            "published_tokens_per_s_per_gpu": row.tps, "tokens_ratio": tokens / row.tps, "predicted_peak_gib": mem,
            "published_memory_gib": row.mem, "memory_ratio": mem / row.mem if row.mem else None,
            "step_s": p.step_s, "mfu_bf16_peak": p.mfu, "exposed_comm_s": p.exposed_comm_s,
            "recompute_s": p.recompute_s, "price_s": time.perf_counter() - t0}


def plan_row(row: Row, policies: tuple[str, ...] = ()) -> dict:
    """Part 6: the planner's own choice for the same model, cluster, batch, sequence and memory (the device's), run
    as the row runs (eager or compiled), allowed float8 where the row uses it (NOTE [execution and float8 in the
    plan]), allowed the selective checkpoint `policies` (NOTE [checkpoint policies in the plan]; the rows run op
    SAC), priced by the same function (`plan.estimate()`: the price of `plan.schedule` as it runs)."""
    from treadle.cost.cluster import parse_cluster
    from treadle.models.zoo import named_model
    from treadle.planner import TrainSpec, plan_model

    dp = row.world // row.tp
    model, inputs = named_model(row.model, batch=row.local * dp, seq=row.seq, fake=True, dtype=torch.bfloat16)
    model.config.use_cache = False
    cluster = parse_cluster(row.cluster)
    t0 = time.perf_counter()
    plan = plan_model(model, inputs, cluster=cluster, memory_budget_bytes=cluster.rank_hardware().memory_bytes,
                      price_top=1, execution=row.execution, float8=row.float8[0] if row.float8 else None,
                      pp_axis="auto" if row.execution == "eager" else None,
                      train=TrainSpec(checkpoint_policies=policies))
    est = plan.estimate()
    tokens = row.local * dp * row.seq / row.world / est.step_s  # the same global batch over the same GPUs
    return {"against": row.label, "roles": str(plan.roles), "mesh": str(plan.cluster.mesh), "step_s": est.step_s,
            "checkpoints": plan.solver.get("checkpoints"), "policies": plan.solver.get("policies"),
            "predicted_tokens_per_s_per_gpu": tokens, "predicted_peak_gib": est.peak_bytes / GiB,
            "planning_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=["8gpu", "128gpu", "ao", "tp"],
                    help="which row groups (8gpu, 128gpu, ao, tp)")
    ap.add_argument("--plan", action="store_true", help="also plan each row's configuration and compare")
    ap.add_argument("--checkpoint-policy", action="append", default=[], metavar="NAME",
                    help="with --plan: let the plans use this selective checkpoint policy (e.g. alternate-matmuls)")
    args = ap.parse_args()
    out, plans = [], []
    print(f"{'configuration':48} {'pred tok/s':>10} {'published':>9} {'ratio':>6} {'pred GiB':>8} {'pub GiB':>7} "
          f"{'ratio':>6}")
    for row in ROWS:
        if row.key not in args.rows:
            continue
        r = price_row(row)
        out.append(r)
        pub, ratio = r["published_memory_gib"], r["memory_ratio"]
        print(f"{r['row']:48} {r['predicted_tokens_per_s_per_gpu']:10,.0f} {r['published_tokens_per_s_per_gpu']:9,} "
              f"{r['tokens_ratio']:6.2f} {r['predicted_peak_gib']:8.1f} {f'{pub:.1f}' if pub else '-':>7} "
              f"{f'{ratio:.2f}' if ratio else '-':>6}", flush=True)
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
                     and b["model"] == r["model"] and b["tp"] == r["tp"]
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
    mems = [r["memory_ratio"] for r in out if r["memory_ratio"] is not None]
    print(f"tokens/s within [0.9, 1.1]: {sum(inside)} of {len(out)}; memory within 10%: "
          f"{sum(abs(m - 1) <= 0.1 for m in mems)} of {len(mems)} published")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_published.json").write_text(json.dumps(
        {"device": "h100-hbm2e-500w", "rows": out, "plans": plans, "not_priced": [list(x) for x in NOT_PRICED]},
        indent=2))


if __name__ == "__main__":
    main()
