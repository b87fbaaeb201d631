"""Mixture-of-experts on GPU presets, predicted: the planner against the recipes Megatron-LM and torchtitan publish.

Issue 29's second benchmark. bf16 mixed precision (fp32 master weights and AdamW states), 80 GiB per device, 8
nodes x 8 H100 (NVLink 4 inside a node, InfiniBand NDR between). Every schedule, the plan's too, is priced by
the same function, `treadle.price` (rehearsed on fake tensors; the experts' exchanges at the stated load,
balanced by default: NOTE [expert load in a rehearsal]). Cases, each at its recipe's global batch:

- Mixtral-8x7B (zoo `mixtral-8x7b`), Megatron-LM `examples/mixtral/train_mixtral_8x7b_distributed.sh`
  (NVIDIA/Megatron-LM @ d98e8a64): TP1, PP4, EP8, micro-batch 1, global batch 256, seq 4096, no recompute,
  distributed optimizer. As a treadle schedule: mesh (pp 4, dp 2, ep 8), 4 stages of 8 blocks, 1F1B over 16
  micro-batches, DDP over (dp, ep), the experts over ep. (Megatron's distributed optimizer shards the AdamW
  states over DP; treadle's DDP keeps them whole, so the recipe's memory here is an upper bound.)
- Qwen3-30B-A3B (zoo `qwen3-30b-a3b`), torchtitan `torchtitan/models/qwen3/config_registry.py:qwen3_30b_a3b`
  (pytorch/torchtitan @ b5bcd76c): FSDP over every rank, TP1, PP1, no expert parallelism, 2 x 4096 tokens per
  rank, full activation checkpointing: FSDP2 x64 with every block checkpointed, global batch 128, seq 4096.
  Beside it a hand plan (not a published recipe): the experts over the group of both axes, EP 64 across the
  nodes as DeepSeek-V3 trains its experts (2 of the 128 a rank), FSDP2 x64 for the rest, no checkpointing.

The planner searches what `treadle plan --cluster 8x8:h100` searches (every mesh whose inner axis stays inside a
node), with its expert role (NOTE [experts in the plan]); it has no pipeline role. Columns: predicted step,
tokens/s per GPU, MFU (bf16 peak), peak memory, planner/recipe step ratio (< 1: the planner is faster).
``--load-imbalance 1 1.5`` prices every expert-parallel schedule (the recipe's, the plan's) for a busiest rank of
the expert axis at that many times the mean routed rows, and asks the planner the same (NOTE [expert load in a
rehearsal]): one recipe and one plan per value.
Target (issue 29): the planner at least as fast as each recipe. Writes bench/results/bench_expert_gpu.json.

    .venv/bin/python bench/bench_expert_gpu.py [--models mixtral-8x7b qwen3-30b-a3b] [--tiny] [--load-imbalance F ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
GiB = 2**30
CASES = {  # model: (global batch, seq, recipe label, source)
    "mixtral-8x7b": (256, 4096, "Megatron-LM TP1 PP4 EP8 (DP16)",
                     "NVIDIA/Megatron-LM@d98e8a64 examples/mixtral/train_mixtral_8x7b_distributed.sh"),
    "qwen3-30b-a3b": (128, 4096, "torchtitan FSDP2 x64 + full AC",
                      "pytorch/torchtitan@b5bcd76c torchtitan/models/qwen3/config_registry.py:qwen3_30b_a3b"),
    "tiny-mixtral": (128, 64, "Megatron-LM-style PP2 EP8 (DP32)", "(smoke test of the script)"),
}


def _build(name: str, batch: int, seq: int):
    from treadle.models.zoo import named_model

    model, inputs = named_model(name, batch=batch, seq=seq, fake=True, dtype=torch.bfloat16)
    model.config.use_cache = False
    return model, inputs


def _cluster(physical, shape, names, across: int):
    """`physical`'s links on a mesh of `shape`: the last axis inside a node, the first `across` axes between."""
    from treadle.cost.cluster import ClusterSpec
    from treadle.mesh import Mesh

    inter, intra = physical.links
    links = tuple(inter if i < across else intra for i in range(len(shape)))
    return ClusterSpec(Mesh(tuple(shape), tuple(names)), links, physical.device)


def _recipe(name: str, inputs: dict, physical, load: float = 1.0):
    """(schedule, cluster) of the published recipe of `name`, on a fresh fake model."""
    from treadle.forms.expert import expert_parallel_moe
    from treadle.mesh import Mesh
    from treadle.models.common import blocks_path
    from treadle.schedule.core import create_schedule

    model, _ = _build(name, *inputs["input_ids"].shape)
    if "mixtral" in name:
        n = len(model.model.layers)
        pp = 4 if n >= 4 else 2  # (the tiny smoke test's 2 blocks: 2 stages)
        shape, names = (pp, 64 // pp // 8, 8), ("pp", "dp", "ep")
        sch = create_schedule(model, mesh=Mesh(shape, names))
        blocks = blocks_path(sch)
        for s in range(1, pp):
            sch[f"{blocks}.{s * n // pp - 1}"].cut_pipeline_stage()
        expert_parallel_moe(sch, axis="ep", load_imbalance=load)
        sch.data_parallel(axis=("dp", "ep"))
        # Megatron: micro-batch 1 on each of the 64 / pp data-parallel ranks
        sch.pipeline(axis="pp", schedule="1f1b", n_microbatches=inputs["input_ids"].shape[0] // (64 // pp),
                     example_inputs=inputs)
        return sch, _cluster(physical, shape, names, across=2)
    shape, names = (64,), ("dp",)
    sch = create_schedule(model, mesh=Mesh(shape, names))
    sch.data_parallel(axis="dp", shard=True)
    blocks = blocks_path(sch)
    for i in range(len(sch[blocks].mod)):
        sch[f"{blocks}.{i}"].checkpoint()
    return sch, _cluster(physical, shape, names, across=1)


def _hand_plans(name: str, inputs: dict, physical, load: float = 1.0) -> list[tuple[str, object, object]]:
    """(label, schedule, cluster) of the hand plans priced beside `name`'s recipe (not published recipes)."""
    from treadle.forms.expert import expert_parallel_moe
    from treadle.mesh import Mesh
    from treadle.schedule.core import create_schedule

    if name != "qwen3-30b-a3b":
        return []
    model, _ = _build(name, *inputs["input_ids"].shape)
    shape, names = (8, 8), ("dp", "tp")
    sch = create_schedule(model, mesh=Mesh(shape, names))
    expert_parallel_moe(sch, axis=("dp", "tp"), load_imbalance=load)
    sch.data_parallel(axis=("dp", "tp"), shard=True)
    return [("hand: EP64 over dp,tp + FSDP2 x64", sch, _cluster(physical, shape, names, across=1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["mixtral-8x7b", "qwen3-30b-a3b"])
    ap.add_argument("--tiny", action="store_true", help="tiny-mixtral only (a smoke test of the script)")
    ap.add_argument("--load-imbalance", nargs="*", type=float, default=[1.0], metavar="F",
                    help="the busiest expert rank's routed rows over the mean, stated for every expert-parallel "
                         "schedule (the recipe's and the planner's; NOTE [expert load in a rehearsal]); one row "
                         "pair per value (default 1: balanced)")
    args = ap.parse_args()
    from treadle.cost.cluster import parse_cluster
    from treadle.errors import TreadleError
    from treadle.planner import plan_model
    from treadle.planner.meshes import search_clusters
    from treadle.pricing import price

    physical = parse_cluster("8x8:h100")
    rows = []
    for name, load in [(m, f) for m in (["tiny-mixtral"] if args.tiny else args.models)
                       for f in args.load_imbalance]:
        batch, seq, label, source = CASES[name]
        tokens = batch * seq
        model, inputs = _build(name, batch, seq)
        t0 = time.perf_counter()
        try:
            sch, cl = _recipe(name, inputs, physical, load)
            p = price(sch, inputs, cl)
            rows.append({"model": name, "plan": label, "source": source, "mesh": str(cl.mesh), "step_s": p.step_s,
                         "mfu": p.mfu, "peak_bytes": p.peak_bytes, "price_s": time.perf_counter() - t0})
        except TreadleError as exc:
            rows.append({"model": name, "plan": label, "source": source, "error": f"{type(exc).__name__}: {exc}"})
        print(f"  {name}: {label}: {rows[-1].get('step_s', float('nan')) * 1e3:.1f} ms "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        hands = []
        for hand, hsch, hcl in _hand_plans(name, inputs, physical, load):
            try:
                hp = price(hsch, inputs, hcl)
                hands.append({"model": name, "plan": hand, "mesh": str(hcl.mesh), "step_s": hp.step_s,
                              "mfu": hp.mfu, "peak_bytes": hp.peak_bytes})
            except TreadleError as exc:
                hands.append({"model": name, "plan": hand, "error": f"{type(exc).__name__}: {exc}"})
        t0 = time.perf_counter()
        try:
            plan = plan_model(model, inputs, cluster=search_clusters(physical), memory_budget_bytes=80 * GiB,
                              price_top=0, expert_load_imbalance=load)
            est = plan.estimate()
            rows.append({"model": name, "plan": "planner", "roles": plan.roles, "mesh": str(plan.cluster.mesh),
                         "step_s": est.step_s, "mfu": est.mfu, "peak_bytes": est.peak_bytes,
                         "solver_step_s": plan.estimated.step_s, "planning_s": plan.solver["planning_s"],
                         "checkpoints": sum(plan.solver["checkpoints"].values())})
        except TreadleError as exc:
            rows.append({"model": name, "plan": "planner", "error": f"{type(exc).__name__}: {exc}"})
        print(f"  {name}: planner: {rows[-1].get('step_s', float('nan')) * 1e3:.1f} ms "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        recipe, planner = rows[-2], rows[-1]
        for r in (recipe, *hands, planner):
            r.update(batch=batch, seq=seq, load_imbalance=load, fits=r.get("peak_bytes", float("inf")) <= 80 * GiB)
            if "step_s" in r:
                r["tokens_per_s_per_gpu"] = tokens / r["step_s"] / 64
        if "step_s" in recipe and "step_s" in planner:
            planner["planner_over_recipe"] = planner["step_s"] / recipe["step_s"]
        for h in hands:
            if "step_s" in h and "step_s" in planner:
                planner.setdefault("planner_over_hand", {})[h["plan"]] = planner["step_s"] / h["step_s"]
        rows[-1:-1] = hands  # printed between the recipe and the planner
    print(f"\n{'model':14} {'load':>4} {'plan':46} {'mesh':22} {'step s':>8} {'tok/s/GPU':>9} {'MFU':>6} "
          f"{'peak GiB':>8} "
          f"{'fits':>4} {'planner/recipe':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:14} {r.get('load_imbalance', 1.0):4.2g} {r['plan']:46} n/a: {r['error'][:150]}")
            continue
        label = r["plan"] + (f" ({r['roles']})" if r["plan"] == "planner" else "")
        ratio = f"{r['planner_over_recipe']:.3f}" if "planner_over_recipe" in r else ""
        print(f"{r['model']:14} {r['load_imbalance']:4.2g} {label[:46]:46} {r['mesh'][5:-1]:22} {r['step_s']:8.3f} "
              f"{r['tokens_per_s_per_gpu']:9.0f} {r['mfu'] * 100:5.1f}% {r['peak_bytes'] / GiB:8.1f} "
              f"{'yes' if r['fits'] else 'NO':>4} {ratio:>14}")
    for r in rows:
        for hand, ratio in r.get("planner_over_hand", {}).items():
            print(f"{r['model']} load {r['load_imbalance']:g}: planner / {hand}: {ratio:.3f}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("bench_expert_gpu_tiny.json" if args.tiny else "bench_expert_gpu.json")
    path.write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
