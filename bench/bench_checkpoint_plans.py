"""The planner with and without a selective checkpoint policy to choose from (NOTE [checkpoint policies in the
plan]), measured on gloo beside the hand plans it chooses among.

Budgets at 30% and 70% of the way from the priced peak of DDP with every block fully checkpointed to DDP's without
checkpoints: checkpointing must save memory, and the question is which blocks, and how. Rows, all under DDP over
every rank: no checkpoints, every block full, every block under torchtitan's op-level SAC ("alternate-matmuls"),
every other block full (`checkpoint_every(2)`); the planner without policies (full checkpoint counts only) and with
"alternate-matmuls" allowed (`TrainSpec(checkpoint_policies=...)`), each at both budgets (`zero=False`,
`pp_axis=None`: the choice is the checkpoints'). Measured in one process group, interleaved, with the machinery
of `bench_price_vs_measured.py` (calibrated cluster, same measuring, its predicted-vs-measured table).

The summary per budget: the planner with the policy over the planner without (measured), and over the fastest
hand plan whose priced peak fits (target <= 1.05), and what each planner chose.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/bench_checkpoint_plans.py [--models llama gpt2] [--configs 2]

Writes bench/results/bench_checkpoint_plans.json. 2 cores: expect 5-15% noise between repeats. The measured
memory column counts what autograd saves (pack hooks); op-level SAC keeps its outputs in a cache of its own (NOTE
[what SAC keeps]), so its rows measure low there (LLaMA: 17.15 MiB measured, the same as full checkpoints, against
20.30 predicted), not the price high.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_price_vs_measured as pvm  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SAC = "alternate-matmuls"
FRACTIONS = (0.3, 0.7)
CHOSEN: dict = {}  # (model, config) -> {budget fraction: {label: what the plan chose, budget}}


def _schedules(model_name, shape, names, batch, seq, cluster, quick, pipeline=False):
    import treadle
    from treadle import Mesh
    from treadle.planner import plan_model
    from treadle.planner.roles import TrainSpec

    mesh = Mesh(shape, names)
    axes = list(names)
    stack = pvm._blocks(model_name)
    out, peaks = [], {}

    def add(label, fn):
        model, inputs = pvm.make_model(model_name, batch, seq)
        sch = treadle.create_schedule(model, mesh=mesh)
        sch.data_parallel(axis=axes)
        fn(sch)
        peaks[label] = treadle.price(sch, inputs, cluster).peak_bytes
        out.append((label, sch.to_json()))

    add("DDP", lambda s: None)
    add("DDP + full ckpt", lambda s: s[stack].checkpoint_every(1))
    add(f"DDP + {SAC}", lambda s: s[stack].checkpoint_every(1, policy=SAC))
    add("DDP + every other full", lambda s: s[stack].checkpoint_every(2))
    chosen = CHOSEN.setdefault((model_name, "x".join(map(str, shape))), {})
    for frac in FRACTIONS:
        budget = peaks["DDP + full ckpt"] + frac * (peaks["DDP"] - peaks["DDP + full ckpt"])
        chosen[frac] = {"budget_bytes": budget}
        for label, pols in ((f"planner {frac:.0%}", ()), (f"planner {frac:.0%} + {SAC}", (SAC,))):
            model, inputs = pvm.make_model(model_name, batch, seq)
            plan = plan_model(model, inputs, cluster=cluster, memory_budget_bytes=budget, zero=False, pp_axis=None,
                              price_top=pvm.PRICE_TOP, train=TrainSpec(checkpoint_policies=pols))
            chosen[frac][label] = {"checkpoints": plan.solver.get("checkpoints"),
                                   "policies": plan.solver.get("policies")}
            out.append((label, plan.schedule.to_json()))
    return out


def main() -> None:
    args = pvm.parse_args(__doc__.splitlines()[0])
    if args.configs == ["2x2", "4", "2"]:  # pvm's default: one configuration here
        args.configs = ["2"]
    pvm.schedules = _schedules  # the configuration's schedules are this bench's
    table = []
    for m in args.models:
        for c in args.configs:
            res = pvm.run_config(m, c, args)
            rows = {r["schedule"]: r for r in res["rows"]}
            for frac, chosen in CHOSEN.get((m, c), {}).items():
                plain, pol = rows.get(f"planner {frac:.0%}"), rows.get(f"planner {frac:.0%} + {SAC}")
                fits = [r for label, r in rows.items() if not label.startswith("planner")
                        and r["predicted_peak_bytes"] <= chosen["budget_bytes"]]
                best = min(fits, key=lambda r: r["measured_s"]) if fits else None
                table.append({
                    "model": m, "config": c, "fraction": frac, "budget_bytes": chosen["budget_bytes"],
                    "planner_ms": plain["measured_s"] * 1e3 if plain else None,
                    "planner_sac_ms": pol["measured_s"] * 1e3 if pol else None,
                    "sac_over_plain": pol["measured_s"] / plain["measured_s"] if pol and plain else None,
                    "best_hand": best["schedule"] if best else None,
                    "best_hand_ms": best["measured_s"] * 1e3 if best else None,
                    "sac_over_best_hand": pol["measured_s"] / best["measured_s"] if pol and best else None,
                    "chosen": {k: v for k, v in chosen.items() if k != "budget_bytes"}, "rows": res["rows"]})
    print(f"\n{'model':6} {'config':6} {'budget':>6} {'MiB':>7} {'planner':>8} {'+ SAC':>8} {'ratio':>6} "
          f"{'best hand that fits':24} {'ms':>7} {'SAC/hand':>8}  choices (full counts; policy counts)")
    for t in table:
        ch = "; ".join(f"{label.split(' ', 2)[-1] if '+' in label else 'plain'}: {v['checkpoints']} {v['policies'] or ''}"
                       for label, v in t["chosen"].items())
        print(f"{t['model']:6} {t['config']:6} {t['fraction']:6.0%} {t['budget_bytes'] / 2**20:7.2f} "
              f"{t['planner_ms'] or float('nan'):8.1f} {t['planner_sac_ms'] or float('nan'):8.1f} "
              f"{t['sac_over_plain'] or float('nan'):6.3f} {str(t['best_hand']):24} {t['best_hand_ms'] or float('nan'):7.1f} "
              f"{t['sac_over_best_hand'] or float('nan'):8.3f}  {ch}")
    ok = all(t["sac_over_best_hand"] is not None and t["sac_over_best_hand"] <= 1.05 for t in table)
    print(f"target planner (with the policy) <= 1.05x the fastest hand plan that fits: {'PASS' if ok else 'FAIL'}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "bench_checkpoint_plans.json"
    path.write_text(json.dumps(table, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
