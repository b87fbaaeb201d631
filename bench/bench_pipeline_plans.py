"""The planner's pipeline schedules, measured side by side on gloo: the plan it makes with every schedule it weighs
(1F1B, interleaved 1F1B, the zero-bubble interleaved_zb and zbv, and DualPipeV: `cuts.SCHEDULES`) against
its best plan with each schedule pinned, in one run.

Each model (the GPT-2 demo config and a tiny LLaMA with grouped-query attention, batch 8 x seq 64) on 4 gloo ranks,
a 2 x 2 mesh (dp, tp) calibrated as `treadle plan --cluster 2x2:cpu` calibrates it; every plan pipelines over the
first axis (`pp_axis="dp"`), the planner chooses the rest (data parallelism over the other axis, or tensor
parallelism, the cuts, the micro-batch count, the checkpoints), with and without a memory budget (0.6x the free
plan's priced peak). DDP over all ranks is the baseline. Measured as `bench_price_vs_measured.py` measures (one
process group, schedules interleaved, 2 steps x 8 rounds each, a step the slowest rank's, a schedule its median).
Prints each configuration's table (predicted and measured) and writes bench/results/bench_pipeline_plans.json.
Target: the planner's own choice measures within 5% of the fastest pinned schedule (ratio <= 1.05).

    .venv/bin/python bench/bench_pipeline_plans.py [--models gpt2 llama] [--budget]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_price_vs_measured as pvm  # noqa: E402

from treadle.forms.pipeline.cuts import SCHEDULES  # noqa: E402

KINDS = tuple(SCHEDULES)
FREE = "planner, every schedule"


def main() -> None:
    args = pvm.parse_args(__doc__.splitlines()[0],
                          extra=lambda ap: ap.add_argument("--budget", action="store_true",
                                                           help="also plan under 0.6x the free plan's priced peak"))
    args.configs = ["2x2"]
    hand = pvm.schedules
    pvm.schedules = lambda *a, **k: [x for x in hand(*a, **k) if x[0] == "DDP (all ranks)"]
    out = []
    for model_name in args.models:
        for budget in ((None, 0.6) if args.budget else (None,)):
            def extra(mesh, nodes, budget=budget, model_name=model_name):
                from treadle.cost.cluster import ClusterSpec
                from treadle.planner import plan_model

                cluster = ClusterSpec.from_json((pvm.RESULTS / "cluster_2x2.json").read_text())
                kw = {"pp_axis": "dp"}
                if budget is not None:
                    model, inputs = pvm.make_model(model_name, args.batch, args.seq)
                    free = plan_model(model, inputs, cluster=cluster, price_top=pvm.PRICE_TOP, pp_axis="dp")
                    kw["memory_budget_bytes"] = budget * free.price["peak_bytes"]
                return [(FREE, cluster, kw)] + [(f"planner, {k} pinned", cluster, {**kw, "pp_schedule": k})
                                                for k in KINDS]
            res = pvm.run_config(model_name, "2x2", args, extra=extra)
            res["budget_fraction"] = budget
            rows = {r["schedule"]: r for r in res["rows"]}
            pinned = [r for label, r in rows.items() if label.endswith("pinned")]
            if FREE in rows and pinned:
                best = min(pinned, key=lambda r: r["measured_s"])
                res["planner_over_best_pinned"] = rows[FREE]["measured_s"] / best["measured_s"]
                print(f"  {model_name}{' budget %.1f' % budget if budget else ''}: the planner's choice measures "
                      f"{res['planner_over_best_pinned']:.2f}x the fastest pinned plan ({best['schedule']}); "
                      f"target <= 1.05: {'PASS' if res['planner_over_best_pinned'] <= 1.05 else 'FAIL'}", flush=True)
            out.append(res)
    pvm.write_results("bench_pipeline_plans.json", out)


if __name__ == "__main__":
    main()
