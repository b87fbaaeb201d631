"""Planner benchmarks: planning time, plan quality against hand plans, joint vs two-stage.

1. ``time``: capture + cost graph + solve on this machine, models built on fake tensors:
   Llama-3-8B on 8x8 H100 (batch 32, seq 4096, bf16, 80 GiB) and GPT-2-XL on 2x4 A100-80GB (batch 32,
   seq 1024, bf16, 80 GiB). Target <= 10 s each. The mesh is the physical (nodes, devices) one.
2. ``quality``: {GPT-2-XL, LLaMA-2-7B, LLaMA-2-70B} x {1x8 A100-80GB, 8x8 H100} x {80, 40, 24 GiB}:
   predicted step time of the automatic plan (searching every 1-D and 2-D mesh of the cluster) next to the
   best hand plan — data parallel, ZeRO-3, Megatron TP=8 (x DP), TP=4 x DP — each with no and with full
   checkpointing, all priced by the same cost model; budgets 80, 40 and 24 GiB. Ratio = auto / best feasible
   hand plan (target <= 1.00; "auto only" where every hand plan exceeds memory).
3. ``joint``: the same grid, joint ILP vs two-stage (sharding first, then the exact checkpoint DP): ratio of
   predicted step times (two-stage / joint; >= 1 means the joint plan is faster), on the mesh the joint plan
   picked.

Prints tables and writes bench/results/bench_planner.json.

    .venv/bin/python bench/bench_planner.py [time] [quality] [joint]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import torch

from treadle.cost.cluster import ClusterSpec, enumerate_meshes
from treadle.errors import PlanError
from treadle.mesh import Mesh
from treadle.models.zoo import named_model
from treadle.planner.capture import capture
from treadle.planner.plan import plan_model

RESULTS = Path(__file__).resolve().parent / "results"
GiB = 2**30

CLUSTERS = {  # name: (nodes, devices per node, intra, inter, device)
    "1x8 A100-80GB": (1, 8, "nvlink3", "ib-hdr", "a100-80gb"),
    "8x8 H100": (8, 8, "nvlink4", "ib-ndr", "h100-sxm"),
}
MODELS = {  # name: (per-device micro-batch, seq)
    "gpt2-xl": (4, 1024),
    "llama-2-7b": (1, 4096),
    "llama-2-70b": (1, 4096),
}
# Megatron column/row weights by family (bench code may know model structure; src/ may not)
MEGATRON = {
    "gpt2": ({"*.mlp.c_fc.weight": 1, "*.mlp.c_fc.bias": 0}, {"*.mlp.c_proj.weight": 0}),
    "llama": ({"*.q_proj.weight": 0, "*.k_proj.weight": 0, "*.v_proj.weight": 0, "*.gate_proj.weight": 0,
               "*.up_proj.weight": 0}, {"*.o_proj.weight": 1, "*.down_proj.weight": 1}),
}


def _family(name: str) -> str:
    return "gpt2" if name.startswith("gpt2") else "llama"


def _build(name: str, batch: int, seq: int):
    return named_model(name, batch=batch, seq=seq, fake=True, dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- 1. planning time
def bench_time() -> list[dict]:
    rows = []
    for name, cluster_text, batch, seq in (("llama-3-8b", "8x8 H100", 32, 4096), ("gpt2-xl", "2x4 A100", 32, 1024)):
        nodes, dpn = (8, 8) if cluster_text.startswith("8x8") else (2, 4)
        dev = ("nvlink4", "ib-ndr", "h100-sxm") if "H100" in cluster_text else ("nvlink3", "ib-hdr", "a100-80gb")
        cl = ClusterSpec.from_physical(nodes, dpn, intra=dev[0], inter=dev[1], device=dev[2])
        t0 = time.perf_counter()
        model, inputs = _build(name, batch, seq)
        t_model = time.perf_counter() - t0
        plan = plan_model(model, inputs, cluster=cl, memory_budget_bytes=80 * GiB)
        s = plan.solver
        rows.append({"model": name, "cluster": cluster_text, "batch": batch, "seq": seq,
                     "build_fake_model_s": t_model, "capture_s": s["capture_s"], "cost_graph_s": s["cost_graph_s"],
                     "solve_s": s["solve_s"], "planning_s": s["planning_s"], "target_s": 10.0,
                     "roles": plan.roles, "step_ms": plan.estimated.step_s * 1e3,
                     "peak_gib": plan.estimated.peak_bytes / GiB, "ilp_vars": s["n_vars"]})
    print("\n1. planning time (this machine; capture + cost graph + solve, all role assignments)")
    print(f"{'model':12} {'cluster':10} {'fake build s':>12} {'capture s':>9} {'cost s':>7} {'solve s':>8} "
          f"{'total s':>8} {'target':>7}  plan")
    for r in rows:
        print(f"{r['model']:12} {r['cluster']:10} {r['build_fake_model_s']:12.2f} {r['capture_s']:9.2f} "
              f"{r['cost_graph_s']:7.2f} {r['solve_s']:8.2f} {r['planning_s']:8.2f} {r['target_s']:7.1f}  "
              f"{r['roles']}, {r['step_ms']:.0f} ms, {r['peak_gib']:.1f} GiB")
    return rows


# ----------------------------------------------------------------------------- 2./3. quality and joint
def _hand_plans(name: str, world: int, dpn: int):
    """(label, mesh shape, names, plan_model kwargs) of each hand plan."""
    col, row = MEGATRON[_family(name)]
    pins_tp = {"*": {"tp": "R"}}
    pins_tp.update({k: {"tp": v} for k, v in col.items()})
    pins_tp.update({k: {"tp": v} for k, v in row.items()})
    out = [("data parallel", (world,), ("dp",), dict(dp_axis="dp", zero=False, pins={})),
           ("ZeRO-3", (world,), ("dp",), dict(dp_axis="dp", zero=True, pins={}))]
    tp8 = min(8, dpn)
    if world // tp8 > 1:
        out.append((f"Megatron TP={tp8} x DP={world // tp8}", (world // tp8, tp8), ("dp", "tp"),
                    dict(dp_axis="dp", zero=False, pins=pins_tp)))
    else:
        out.append((f"Megatron TP={tp8}", (tp8,), ("tp",), dict(dp_axis=None, pins=pins_tp)))
    out.append((f"TP=4 x DP={world // 4}", (world // 4, 4), ("dp", "tp"), dict(dp_axis="dp", zero=False, pins=pins_tp)))
    return out


def _cluster_of(shape, names, nodes, dpn, intra, inter, device) -> ClusterSpec:
    from treadle.cost.cluster import axis_crosses_nodes
    from treadle.cost.links import link_preset

    links = tuple(link_preset(inter if axis_crosses_nodes(shape, i, dpn) else intra) for i in range(len(shape)))
    return ClusterSpec(Mesh(shape, names), links, device)


def bench_quality(do_joint: bool) -> tuple[list[dict], list[dict]]:
    rows, jrows = [], []
    for cname, (nodes, dpn, intra, inter, device) in CLUSTERS.items():
        world = nodes * dpn
        meshes = [c for c in enumerate_meshes(nodes, dpn, intra=intra, inter=inter, device=device, max_ndim=2)]
        for mname, (micro, seq) in MODELS.items():
            batch = micro * world
            model, inputs = _build(mname, batch, seq)
            graph = capture(model, (), inputs)
            for budget_gib in (80, 40, 24):
                budget = budget_gib * GiB
                hand = []
                for label, shape, names, kw in _hand_plans(mname, world, dpn):
                    cl = _cluster_of(shape, names, nodes, dpn, intra, inter, device)
                    for ck in ("none", "all"):
                        try:
                            p = plan_model(model, inputs, cluster=cl, memory_budget_bytes=budget, graph=graph,
                                           checkpoint=ck, **kw)
                            hand.append((f"{label}{' + ckpt' if ck == 'all' else ''}", p.estimated.step_s,
                                         p.estimated.peak_bytes))
                        except PlanError:
                            hand.append((f"{label}{' + ckpt' if ck == 'all' else ''}", math.inf, math.inf))
                t0 = time.perf_counter()
                try:
                    auto = plan_model(model, inputs, cluster=meshes, memory_budget_bytes=budget, graph=graph)
                    auto_s, auto_desc = auto.estimated.step_s, f"{auto.cluster.mesh} {auto.roles}"
                    ck = sum(auto.solver["checkpoints"].values())
                    auto_desc += f", ckpt {ck}" if ck else ""
                except PlanError:
                    auto, auto_s, auto_desc = None, math.inf, "infeasible"
                t_auto = time.perf_counter() - t0
                best = min(hand, key=lambda h: h[1])
                ratio = auto_s / best[1] if math.isfinite(best[1]) else None
                rows.append({"model": mname, "cluster": cname, "budget_gib": budget_gib, "batch": batch, "seq": seq,
                             "auto_step_s": auto_s, "auto_plan": auto_desc, "auto_planning_s": t_auto,
                             "best_hand": best[0], "best_hand_step_s": best[1], "ratio": ratio,
                             "hand": [{"plan": h[0], "step_s": h[1], "peak_bytes": h[2]} for h in hand]})
                if do_joint and auto is not None:
                    cl = auto.cluster
                    two = None
                    try:
                        two = plan_model(model, inputs, cluster=cl, memory_budget_bytes=budget, graph=graph,
                                         mode="two_stage")
                    except PlanError:
                        pass
                    jrows.append({"model": mname, "cluster": cname, "budget_gib": budget_gib, "mesh": str(cl.mesh),
                                  "joint_step_s": auto_s,
                                  "two_stage_step_s": two.estimated.step_s if two else math.inf,
                                  "ratio_two_stage_over_joint": (two.estimated.step_s / auto_s) if two else None})
    print("\n2. plan quality: predicted step time, automatic plan vs best hand plan (same cost model)")
    print(f"{'model':12} {'cluster':14} {'budget':>6} {'auto ms':>10} {'best hand ms':>12} {'ratio':>6}  "
          f"best hand plan / automatic plan")
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else ("auto only" if math.isfinite(r["auto_step_s"])
                                                                    else "none")
        hand_ms = f"{r['best_hand_step_s'] * 1e3:.0f}" if math.isfinite(r["best_hand_step_s"]) else "OOM"
        auto_ms = f"{r['auto_step_s'] * 1e3:.0f}" if math.isfinite(r["auto_step_s"]) else "OOM"
        print(f"{r['model']:12} {r['cluster']:14} {r['budget_gib']:4d}Gi {auto_ms:>10} {hand_ms:>12} {ratio:>6}  "
              f"{r['best_hand']} / {r['auto_plan']}")
    if do_joint:
        print("\n3. joint vs two-stage (same mesh): predicted step time")
        print(f"{'model':12} {'cluster':14} {'budget':>6} {'mesh':14} {'joint ms':>9} {'2-stage ms':>10} "
              f"{'2-stage/joint':>13}")
        for r in jrows:
            two = f"{r['two_stage_step_s'] * 1e3:.0f}" if math.isfinite(r["two_stage_step_s"]) else "OOM"
            ratio = f"{r['ratio_two_stage_over_joint']:.3f}" if r["ratio_two_stage_over_joint"] else "infeasible"
            print(f"{r['model']:12} {r['cluster']:14} {r['budget_gib']:4d}Gi {r['mesh']:14} "
                  f"{r['joint_step_s'] * 1e3:9.0f} {two:>10} {ratio:>13}")
    return rows, jrows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="*", help="time, quality, joint (default: all)")
    ap.add_argument("-v", action="store_true", help="INFO logs")
    args = ap.parse_args()
    args.parts = args.parts or ["time", "quality", "joint"]
    bad = set(args.parts) - {"time", "quality", "joint"}
    if bad:
        ap.error(f"unknown parts {sorted(bad)}; choose from time, quality, joint")
    if args.v:
        logging.basicConfig(level=logging.INFO)
    out: dict = {}
    if "time" in args.parts:
        out["time"] = bench_time()
    if "quality" in args.parts or "joint" in args.parts:
        out["quality"], out["joint"] = bench_quality("joint" in args.parts)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "bench_planner.json"
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
