"""Planner benchmarks: the planner against published-style recipes, planning time, hand plans, joint vs two-stage.

1. ``recipes`` (default): predicted (GPU presets, bf16 mixed precision, 80 GiB per device), each case in one
   run: Llama-3-8B on 8x8 H100 (batch 32, seq 4096), Llama-2-70B on 8x8 H100 (batch 16, seq 4096), GPT-2-XL
   on 1x8 H100 (batch 32, seq 1024). The planner (the CLI's search: every mesh whose inner axis stays inside
   a node, `treadle.cli.plan.search_clusters`) against the recipes experts publish, written as treadle
   schedules: Megatron-LM TP8 x DP + sequence parallelism (+ selective checkpointing: matmul and attention
   outputs saved, the rest of each block recomputed), torchtitan FSDP2 (x TP8 + SP) with op-level selective
   activation checkpointing. Every schedule — the plan's too — is priced by the same function,
   `treadle.price` (rehearsed on fake tensors). Columns: predicted step, MFU (bf16 peak), peak memory, the
   planner/recipe step ratio (< 1: the planner is faster), planning seconds, and whether attention is
   head-parallel (q projection sharded over its heads). A recipe the model cannot take (GPT-2-XL's 25 heads
   over tp 8) is listed with the reason.
2. ``time``: capture + cost graph + solve on this machine on the physical mesh only: Llama-3-8B on 8x8 H100
   (batch 32, seq 4096) and GPT-2-XL on 2x4 A100-80GB (batch 32, seq 1024), bf16, 80 GiB. Target <= 10 s.
3. ``quality``: {GPT-2-XL, LLaMA-2-7B, LLaMA-2-70B} x {1x8 A100-80GB, 8x8 H100} x {80, 40, 24 GiB}:
   the automatic plan (every 1-D and 2-D mesh) next to hand plans written as pins (data parallel, ZeRO-3,
   Megatron TP=8 (x DP), TP=4 x DP; no and full checkpointing), all priced by the planner's cost graph
   (not `price`). Ratio = auto / best feasible hand plan. Slow (minutes); not run by default.
4. ``joint``: on the same grid, joint ILP vs two-stage (sharding first, then the exact checkpoint DP).

Prints tables and writes bench/results/bench_planner.json. ``--tiny`` runs the recipes part on tiny configs
(seconds; a smoke test of the script, not a result).

    .venv/bin/python bench/bench_planner.py [recipes] [time] [quality] [joint] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch

from treadle.cost.cluster import ClusterSpec, enumerate_meshes
from treadle.errors import PlanError
from treadle.mesh import Mesh
from treadle.models.zoo import named_model
from treadle.planner.capture import capture
from treadle.planner import plan_model

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
    return "gpt2" if "gpt2" in name else "llama"


def _build(name: str, batch: int, seq: int):
    return named_model(name, batch=batch, seq=seq, fake=True, dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- 1. planner vs recipes
RECIPE_CASES = (  # model, cluster, batch, seq
    ("llama-3-8b", "8x8:h100", 32, 4096),
    ("llama-2-70b", "8x8:h100", 16, 4096),
    ("gpt2-xl", "1x8:h100", 32, 1024),
)
TINY_CASES = (("tiny-llama", "2x2:h100", 8, 64), ("tiny-gpt2", "1x4:h100", 8, 64))
# op-level selective activation checkpointing (torchtitan's "op" SAC; Megatron's selective recompute when the
# attention core is a fused kernel): keep matmul and attention outputs, recompute the elementwise rest
SAC_SAVE = ["aten.mm", "aten.addmm", "aten.bmm", "aten._scaled_dot_product_flash_attention",
            "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_flash_attention_for_cpu"]


def _sac(sch, blocks: str) -> None:
    for i in range(len(sch[blocks].mod)):
        sch[f"{blocks}.{i}"].checkpoint(save=SAC_SAVE)


def _recipes(name: str, world: int, dpn: int):
    """(label, mesh shape, axis names, function applying the recipe to a Schedule) per published-style recipe."""
    from treadle.models import schedule_gpt2, schedule_llama
    from treadle.models.common import blocks_path

    meg = schedule_llama if _family(name) == "llama" else schedule_gpt2
    tp = min(8, dpn)
    dp = world // tp
    two = (dp, tp) if dp > 1 else (tp,)
    names2 = ("dp", "tp") if dp > 1 else ("tp",)
    dpa = "dp" if dp > 1 else None

    def vocab(sch, n: int) -> dict:
        # Megatron pads the vocabulary to a multiple of the tp size; treadle cannot, so a vocabulary the tp size
        # does not divide (GPT-2's 50257) keeps the embedding and head replicated
        return {} if sch.model.config.vocab_size % n == 0 else {"vocab_parallel_head": False}

    def megatron(sac: bool):
        def apply(sch):
            meg(sch, tp="tp", dp=dpa, sequence_parallel=True, **vocab(sch, tp))
            if sac:
                _sac(sch, blocks_path(sch))
        return apply

    # torchtitan's 2-D recipe: FSDP2 across, TP inside a node (on one node: FSDP2 x2 x TP of half the node)
    t_tp = tp if dp > 1 else max(1, tp // 2)
    t_dp = world // t_tp

    def titan_tp(sch):
        meg(sch, tp="tp", dp="dp", zero3=True, sequence_parallel=True, **vocab(sch, t_tp))
        _sac(sch, blocks_path(sch))

    def titan_fsdp(sch):
        sch.data_parallel(axis="dp", shard=True)
        _sac(sch, blocks_path(sch))

    def ddp(sch):
        sch.data_parallel(axis="dp")

    tag = f"TP{tp} x DP{dp}" if dp > 1 else f"TP{tp}"
    return [(f"Megatron {tag} + SP", two, names2, megatron(False)),
            (f"Megatron {tag} + SP + selective ckpt", two, names2, megatron(True)),
            (f"torchtitan FSDP2 x{t_dp} x TP{t_tp} + SP + SAC", (t_dp, t_tp), ("dp", "tp"), titan_tp),
            (f"torchtitan FSDP2 x{world} + SAC", (world,), ("dp",), titan_fsdp),
            (f"DDP x{world} (Megatron TP=1)", (world,), ("dp",), ddp)]


def _recipe_cluster(meshes: list[ClusterSpec], shape, names) -> ClusterSpec:
    """The cluster the planner searched for this mesh shape (same links and copy rate), with the recipe's names."""
    c = next(c for c in meshes if tuple(c.mesh.shape) == tuple(shape))
    return ClusterSpec(Mesh(tuple(shape), tuple(names)), c.links, c.device, c.copy_bytes_per_s)


def _head_parallel(sch) -> bool:
    """Attention is head-parallel: the query projection is sharded over its output features (its heads) and
    its output enters attention sharded — a Linear q_proj on dim 0, or GPT-2's fused Conv1D c_attn on dim 1,
    with no sync gathering that output back to Replicate at the projection."""
    sharded, gathered = set(), set()
    for r in sch.records:
        a = dict(r.args)
        if r.op == "shard" and ((r.path.endswith("q_proj") and a.get("dim") == 0)
                                or (r.path.endswith("attn.c_attn") and a.get("dim") == 1)):
            sharded.add(r.path)
        elif r.op == "sync" and (r.path.endswith("q_proj") or r.path.endswith("attn.c_attn")):
            gathered.add(r.path)
    return bool(sharded - gathered)


def bench_recipes(tiny: bool = False) -> list[dict]:
    from treadle.cost.cluster import parse_cluster
    from treadle.planner.meshes import search_clusters
    from treadle.pricing import price
    from treadle.schedule.core import create_schedule

    budget = 80 * GiB
    rows = []
    for name, ctext, batch, seq in (TINY_CASES if tiny else RECIPE_CASES):
        physical = parse_cluster(ctext)
        nodes, dpn = physical.mesh.shape
        meshes = enumerate_meshes(nodes, dpn, intra=physical.links[1], inter=physical.links[0],
                                  device=physical.device, max_ndim=2)
        t0 = time.perf_counter()
        model, inputs = _build(name, batch, seq)
        t_model = time.perf_counter() - t0
        case = []
        # the planner, as `treadle plan` runs it
        try:
            # price_top=0, then `estimate()`: the solver's planning time and the price's apart (plan_model's default
            # with a budget prices the winner inside plan_model; the same plan here, it fits with room to spare)
            plan = plan_model(model, inputs, cluster=search_clusters(physical), memory_budget_bytes=budget,
                              price_top=0)
            solver_s = plan.estimated.step_s
            t1 = time.perf_counter()
            est = plan.estimate()
            print(f"  {name}: planner {plan.cluster.mesh} {plan.roles}: {est.step_s * 1e3:.1f} ms, planned in "
                  f"{plan.solver['planning_s']:.0f} s, priced in {time.perf_counter() - t1:.0f} s", file=sys.stderr,
                  flush=True)
            case.append({"plan": "planner", "mesh": str(plan.cluster.mesh), "roles": plan.roles,
                         "step_s": est.step_s, "mfu": est.mfu, "peak_bytes": est.peak_bytes,
                         "solver_step_s": solver_s, "planning_s": plan.solver["planning_s"],
                         "price_s": time.perf_counter() - t1, "head_parallel": _head_parallel(plan.schedule),
                         "checkpoints": sum(plan.solver["checkpoints"].values())})
        except PlanError as exc:
            case.append({"plan": "planner", "error": str(exc)})
        for label, shape, names, apply in _recipes(name, nodes * dpn, dpn):
            fresh, _ = _build(name, batch, seq)
            sch = create_schedule(fresh, mesh=Mesh(shape, names))
            try:
                apply(sch)
            except Exception as exc:  # a recipe the model cannot take (heads that do not divide): listed with why
                case.append({"plan": label, "mesh": str(sch.mesh), "error": f"{type(exc).__name__}: {exc}"})
                continue
            t1 = time.perf_counter()
            try:
                p = price(sch, inputs, _recipe_cluster(meshes, shape, names))
            except PlanError as exc:  # e.g. a batch the data-parallel axis does not divide
                case.append({"plan": label, "mesh": str(sch.mesh), "error": str(exc)})
                continue
            print(f"  {name}: {label}: {p.step_s * 1e3:.1f} ms, priced in {time.perf_counter() - t1:.0f} s",
                  file=sys.stderr, flush=True)
            case.append({"plan": label, "mesh": str(sch.mesh), "step_s": p.step_s, "mfu": p.mfu,
                         "peak_bytes": p.peak_bytes, "price_s": time.perf_counter() - t1,
                         "head_parallel": _head_parallel(sch)})
        planner = case[0]
        for r in case:
            r.update(model=name, cluster=ctext, batch=batch, seq=seq, build_fake_model_s=t_model)
            r["fits"] = r.get("peak_bytes", math.inf) <= budget
            if r is not planner and "step_s" in r and "step_s" in planner:
                r["planner_over_recipe"] = planner["step_s"] / r["step_s"]
        rows += case
    print("\n1. planner vs published-style recipes (predicted by treadle.price; bf16 mixed, 80 GiB per device)")
    print(f"{'model':11} {'plan':42} {'mesh':18} {'step ms':>9} {'MFU':>6} {'peak GiB':>8} {'fits':>4} "
          f"{'planner/it':>10} {'plan s':>6} {'heads':>5}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:11} {r['plan']:42} {r.get('mesh', ''):18} n/a: {r['error'][:110]}")
            continue
        ratio = f"{r['planner_over_recipe']:.3f}" if "planner_over_recipe" in r else ""
        plan_s = f"{r['planning_s']:.1f}" if "planning_s" in r else ""
        label = r["plan"] + (f" ({r['roles']})" if r["plan"] == "planner" else "")
        print(f"{r['model']:11} {label[:42]:42} {r['mesh'][5:-1]:18} {r['step_s'] * 1e3:9.4g} {r['mfu'] * 100:5.1f}% "
              f"{r['peak_bytes'] / GiB:8.1f} {'yes' if r['fits'] else 'NO':>4} {ratio:>10} {plan_s:>6} "
              f"{'yes' if r['head_parallel'] else 'no':>5}")
    return rows


# ----------------------------------------------------------------------------- 2. planning time
def bench_time() -> list[dict]:
    rows = []
    for name, cluster_text, batch, seq in (("llama-3-8b", "8x8 H100", 32, 4096), ("gpt2-xl", "2x4 A100", 32, 1024)):
        nodes, dpn = (8, 8) if cluster_text.startswith("8x8") else (2, 4)
        dev = ("nvlink4", "ib-ndr", "h100-sxm") if "H100" in cluster_text else ("nvlink3", "ib-hdr", "a100-80gb")
        cl = ClusterSpec.from_physical(nodes, dpn, intra=dev[0], inter=dev[1], device=dev[2])
        t0 = time.perf_counter()
        model, inputs = _build(name, batch, seq)
        t_model = time.perf_counter() - t0
        # the solver's own time (price_top=0): a budget is otherwise checked by pricing the plan as built, which
        # the recipes table times separately
        plan = plan_model(model, inputs, cluster=cl, memory_budget_bytes=80 * GiB, price_top=0)
        s = plan.solver
        rows.append({"model": name, "cluster": cluster_text, "batch": batch, "seq": seq,
                     "build_fake_model_s": t_model, "capture_s": s["capture_s"], "cost_graph_s": s["cost_graph_s"],
                     "solve_s": s["solve_s"], "planning_s": s["planning_s"], "target_s": 10.0,
                     "roles": plan.roles, "step_ms": plan.estimated.step_s * 1e3,
                     "peak_gib": plan.estimated.peak_bytes / GiB, "ilp_vars": s["n_vars"]})
    print("\n2. planning time (this machine; capture + cost graph + solve, all role assignments)")
    print(f"{'model':12} {'cluster':10} {'fake build s':>12} {'capture s':>9} {'cost s':>7} {'solve s':>8} "
          f"{'total s':>8} {'target':>7}  plan")
    for r in rows:
        print(f"{r['model']:12} {r['cluster']:10} {r['build_fake_model_s']:12.2f} {r['capture_s']:9.2f} "
              f"{r['cost_graph_s']:7.2f} {r['solve_s']:8.2f} {r['planning_s']:8.2f} {r['target_s']:7.1f}  "
              f"{r['roles']}, {r['step_ms']:.0f} ms, {r['peak_gib']:.1f} GiB")
    return rows


# ----------------------------------------------------------------------------- 3./4. quality and joint
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
                                           checkpoint=ck, price_top=0, **kw)  # solver against solver
                            hand.append((f"{label}{' + ckpt' if ck == 'all' else ''}", p.estimated.step_s,
                                         p.estimated.peak_bytes))
                        except PlanError:
                            hand.append((f"{label}{' + ckpt' if ck == 'all' else ''}", math.inf, math.inf))
                t0 = time.perf_counter()
                try:
                    auto = plan_model(model, inputs, cluster=meshes, memory_budget_bytes=budget, graph=graph,
                                      price_top=0)
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
                                         mode="two_stage", price_top=0)
                    except PlanError:
                        pass
                    jrows.append({"model": mname, "cluster": cname, "budget_gib": budget_gib, "mesh": str(cl.mesh),
                                  "joint_step_s": auto_s,
                                  "two_stage_step_s": two.estimated.step_s if two else math.inf,
                                  "ratio_two_stage_over_joint": (two.estimated.step_s / auto_s) if two else None})
    print("\n3. plan quality: predicted step time, automatic plan vs best hand plan (same cost model)")
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
        print("\n4. joint vs two-stage (same mesh): predicted step time")
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
    ap.add_argument("parts", nargs="*", help="recipes, time, quality, joint (default: recipes time)")
    ap.add_argument("--tiny", action="store_true", help="recipes on tiny configs (a smoke test of the script)")
    ap.add_argument("-v", action="store_true", help="INFO logs")
    args = ap.parse_args()
    args.parts = args.parts or ["recipes", "time"]
    bad = set(args.parts) - {"recipes", "time", "quality", "joint"}
    if bad:
        ap.error(f"unknown parts {sorted(bad)}; choose from recipes, time, quality, joint")
    if args.v:
        logging.basicConfig(level=logging.INFO)
    out: dict = {}
    if "recipes" in args.parts:
        out["recipes"] = bench_recipes(tiny=args.tiny)
    if "time" in args.parts:
        out["time"] = bench_time()
    if "quality" in args.parts or "joint" in args.parts:
        out["quality"], out["joint"] = bench_quality("joint" in args.parts)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("bench_planner_tiny.json" if args.tiny else "bench_planner.json")
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
