"""Real ranking on this machine: predicted vs measured step time of the automatic plan and hand plans.

GPT-2 small (124M parameters, fp32, batch 4 x seq 64 by default) on gloo, world 2 (mesh (2,)) and world 4
(mesh (2, 2)). The links are calibrated on the running process groups (`treadle.cost.calibrate`) and the
device is the calibrated "cpu" HardwareSpec. Plans: the planner's (unlimited memory), and the hand plans
data parallel, ZeRO-3, Megatron MLP tensor parallel (GPT-2's fused q|k|v projection stays whole: the
planner does not split fused projections), and on world 4 TP x DP — each without and with checkpointing
of every block — all priced by the same cost model. Each plan is built (`treadle.build`) and trained with
AdamW; a step's time is the slowest rank's, the median of `--steps` steps after one warm-up, and a plan's
time the best of `--repeats` runs made in alternating order. Each rank uses one thread (2 cores, up to 4
ranks); the machine may be shared, so expect noise of tens of percent.

Reports per world: predicted and measured ms per plan, the Spearman rank correlation of predicted vs
measured, and the automatic plan's measured time over the fastest measured plan (target <= 1.10).
Writes bench/results/bench_planner_gloo.json.

    .venv/bin/python bench/bench_planner_gloo.py [--batch 4] [--seq 64] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from treadle.mesh import Mesh
from treadle.testing import spawn

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "gpt2"
MEGATRON_PINS = {"*": {"tp": "R"}, "*.mlp.c_fc.weight": {"tp": 1}, "*.mlp.c_fc.bias": {"tp": 0},
                 "*.mlp.c_proj.weight": {"tp": 0}}


def _model(batch: int, seq: int):
    from treadle.models.zoo import named_model

    model, inputs = named_model(MODEL, batch=batch, seq=seq, dropout=False)
    model._forward_hooks.clear()  # the zoo's fake-tensor hooks are closures (not picklable, not needed here)
    model._forward_pre_hooks.clear()
    return model, inputs


def _calibrate_rank(rank: int, world: int, shape: tuple, names: tuple):
    from treadle.cost.calibrate import calibrate_cluster

    torch.set_num_threads(1)
    return calibrate_cluster(Mesh(shape, names), rounds=5).cluster


def _time_rank(rank: int, world: int, decisions: list[dict], shape: tuple, names: tuple, batch: int, seq: int,
               steps: int) -> list[float]:
    import torch.distributed as dist

    from treadle.planner.plan import runtime_capabilities
    from treadle.planner.to_schedule import Decision, apply_decisions
    from treadle.runtime.build import build
    from treadle.schedule.core import create_schedule

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, inputs = _model(batch, seq)
    mesh = Mesh(shape, names)
    _, is_leaf = runtime_capabilities(model)
    sch = apply_decisions(create_schedule(model, mesh=mesh), [Decision.from_dict(d) for d in decisions],
                          leaf_module=is_leaf)
    built = build(sch)
    dp = sch._state.data_parallel  # the batch splits over every data-parallel axis
    if dp is not None:
        n, i = dp.size(mesh), dp.index(mesh.coordinate(rank), mesh)
        inputs = {k: v.chunk(n)[i] for k, v in inputs.items()}
    opt = torch.optim.AdamW(built.parameters(), lr=1e-5)
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        built(**inputs).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times[1:]


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1)) if n > 1 else 1.0


def run_world(shape: tuple, names: tuple, args) -> dict:
    from treadle.errors import PlanError
    from treadle.planner.plan import plan_model

    world = 1
    for s in shape:
        world *= s
    cluster = spawn(_calibrate_rank, world, shape, names, timeout_s=600)[0]
    model, inputs = _model(args.batch, args.seq)
    plans = [("automatic", dict())]
    dp_axis = names[0]
    plans += [("data parallel", dict(dp_axis=dp_axis, zero=False, pins={"*": {a: "R" for a in names if a != dp_axis}}
                                     if len(names) > 1 else {})),
              ("ZeRO-3", dict(dp_axis=dp_axis, zero=True, pins={"*": {a: "R" for a in names if a != dp_axis}}
                              if len(names) > 1 else {}))]
    if len(names) == 1:
        plans.append(("Megatron MLP TP=2", dict(dp_axis=None, pins={k: {names[0]: v["tp"]} for k, v in
                                                                     MEGATRON_PINS.items()})))
    else:
        plans.append(("Megatron MLP TP=2 x DP=2", dict(dp_axis=names[0], zero=False, pins=MEGATRON_PINS)))
    rows = []
    graph = None
    runs = []  # (row, decisions)
    for label, kw in plans:
        for ck in (["auto"] if label == "automatic" else ["none", "all"]):
            try:
                p = plan_model(model, inputs, cluster=cluster, checkpoint=ck, graph=graph, **kw)
            except PlanError as exc:
                rows.append({"plan": label, "checkpoint": ck, "error": str(exc)})
                print(f"  {label} (checkpoint {ck}): no plan: {exc}", flush=True)
                continue
            graph = p._context["kwargs"]["graph"]
            row = {"plan": label + (" + ckpt" if ck == "all" else ""), "roles": p.roles,
                   "predicted_s": p.estimated.step_s, "measured_runs_s": []}
            rows.append(row)
            runs.append((row, [d.to_dict() for d in p.decisions]))
    # repeats in alternating order, so slow drifts of a shared machine hit every plan alike
    for rep in range(args.repeats):
        for row, decisions in (runs if rep % 2 == 0 else list(reversed(runs))):
            per_rank = spawn(_time_rank, world, decisions, shape, names, args.batch, args.seq, args.steps,
                             timeout_s=900)
            row["measured_runs_s"].append(statistics.median(max(ts[i] for ts in per_rank)
                                                            for i in range(args.steps)))
    for row, _ in runs:
        row["measured_s"] = min(row["measured_runs_s"])
        print(f"  {row['plan']:32} predicted {row['predicted_s'] * 1e3:9.1f} ms   measured "
              f"{row['measured_s'] * 1e3:9.1f} ms   ({row['roles']})", flush=True)
    ok = [r for r in rows if "measured_s" in r]
    rho = _spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok])
    fastest = min(r["measured_s"] for r in ok)
    auto = next(r for r in ok if r["plan"] == "automatic")
    return {"mesh": list(shape), "names": list(names), "rows": rows, "spearman": rho,
            "auto_over_fastest_measured": auto["measured_s"] / fastest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="runs of every plan (alternating order); min is kept")
    ap.add_argument("--worlds", nargs="*", default=["2", "2x2"])
    args = ap.parse_args()
    out = {}
    for w in args.worlds:
        shape = tuple(int(x) for x in w.split("x"))
        names = ("dp",) if len(shape) == 1 else ("dp", "tp")
        print(f"\nGPT-2 small, batch {args.batch} x seq {args.seq}, gloo mesh {w}", flush=True)
        res = run_world(shape, names, args)
        print(f"  Spearman(predicted, measured) = {res['spearman']:.2f}; automatic / fastest measured = "
              f"{res['auto_over_fastest_measured']:.2f} (target <= 1.10)")
        out[w] = res
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "bench_planner_gloo.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
