"""The planner's pipelines with and without a selective checkpoint policy to choose from in each stage (NOTE
[checkpoint policies in a pipeline's stages] in `treadle.forms.pipeline.stage_policies`), predicted on a GPU preset.

Per model and memory budget, two plans with the pipeline over the node axis of 2 x 8 H100 (`pp_axis` pinned, the
rest planned, bf16, `price_top=1`: each priced as built by `treadle.price`): without policies (full checkpoint
counts only) and with torchtitan's op-level SAC ("alternate-matmuls") allowed (`TrainSpec(checkpoint_policies=...)`).
The budgets are fractions of the way from the smaller of the two plans' priced peaks with every block of every
stage fully checkpointed to the peak of the plan without a budget, so that checkpointing must save memory. Prints,
per row, each plan's priced step and peak, what each stage checkpoints (full / under the policy), and the ratio
without / with (> 1: the policy helps). Beside them, the hand recipes a user would write on the policy plan's own
layout (its mesh roles, cuts, schedule and micro-batches, its checkpoints replaced): every block fully checkpointed
(torchtitan's full AC) and every block under op-level SAC (torchtitan's selective op AC), each priced as built; the
planner's policy plan over the fastest of them that fits the budget (<= 1: the planner is at least as fast). A CPU preset is not benched: selective checkpointing's dispatch modes cost
~10 us an op on a CPU core, and the planner rightly keeps full checkpoints there (tests/test_checkpoint_policy_plan.py).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/bench_pipeline_policies.py [--models llama-3-8b llama-2-7b]

Writes bench/results/bench_pipeline_policies.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SAC = "alternate-matmuls"
MODELS = {"llama-3-8b": (16, 4096), "llama-2-7b": (16, 4096)}  # global batch, seq
FRACTIONS = (0.1, 0.15, 0.2, 0.25, 0.3, 0.35)
GiB = 2**30


def _plan(name: str, cluster, pp: str, budget: float | None, policies: tuple[str, ...]):
    from treadle.models.zoo import named_model
    from treadle.planner import plan_model
    from treadle.planner.roles import TrainSpec

    batch, seq = MODELS[name]
    model, inputs = named_model(name, batch=batch, seq=seq, fake=True, dtype=torch.bfloat16)
    return plan_model(model, inputs, cluster=cluster, pp_axis=pp, memory_budget_bytes=budget, price_top=1,
                      train=TrainSpec(checkpoint_policies=policies))


def _hand(name: str, plan, cluster, policy: str):
    """The price of `plan`'s schedule with its checkpoints replaced by every block under `policy` ("full": full AC)."""
    from treadle.models.zoo import named_model
    from treadle.pricing import price
    from treadle.schedule.replay import load_schedule

    batch, seq = MODELS[name]
    doc = json.loads(plan.schedule.to_json())
    doc["records"] = [r for r in doc["records"] if r.get("op") not in ("checkpoint", "checkpoint_selective")]
    model, inputs = named_model(name, batch=batch, seq=seq, fake=True, dtype=torch.bfloat16)
    sch = load_schedule(model, json.dumps(doc))
    sch["model.layers"].checkpoint_every(1, policy=policy)
    return price(sch, inputs, cluster)


def _stages(plan) -> str:
    sp = plan.solver.get("stages") or {}
    pol = sp.get("policies") or [()] * len(sp.get("checkpointed", ()))
    return " ".join(f"{len(c)}/{len(p)}" for c, p in zip(sp.get("checkpointed", ()), pol))


def main() -> None:
    from treadle.cost.cluster import parse_cluster
    from treadle.errors import PlanError

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args()
    cluster = parse_cluster("2x8:h100")
    pp = cluster.mesh.names[0]
    rows = []
    print(f"{cluster.mesh} H100 preset, bf16; pipeline over {pp!r}; stages: full/policy checkpointed blocks")
    print(f"  {'model':11} {'budget':>8} {'plain s':>8} {'peak':>6} {'stages':>16} {'policy s':>8} {'peak':>6} "
          f"{'stages':>16} {'plain/policy':>12} {'full AC s':>9} {'op SAC s':>9} {'policy/hand':>11}")
    for name in args.models:
        top = _plan(name, cluster, pp, None, ())
        # the least memory: the plan at a budget just above every block checkpointed (the planner's smallest)
        try:
            _plan(name, cluster, pp, 1.0, ())
        except PlanError as exc:
            least = exc.smallest_budget_bytes
        for frac in FRACTIONS:
            budget = least + frac * (top.price["peak_bytes"] - least)
            got, plans = {}, {}
            for label, pol in (("plain", ()), ("policy", (SAC,))):
                t0 = time.perf_counter()
                try:
                    plan = plans[label] = _plan(name, cluster, pp, budget, pol)
                    got[label] = (plan.price["step_s"], plan.price["peak_bytes"], _stages(plan), plan.roles,
                                  time.perf_counter() - t0)
                except PlanError as exc:
                    got[label] = (float("inf"), float("inf"), f"none fits: {exc}"[:60], "", 0.0)
            (ps, pm, pst, proles, pt), (qs, qm, qst, qroles, qt) = got["plain"], got["policy"]
            hand = {}  # the hand recipes on the policy plan's layout
            for label, policy in (("full AC", "full"), ("op SAC", SAC)):
                if "policy" in plans:
                    h = _hand(name, plans["policy"], cluster, policy)
                    hand[label] = {"step_s": h.step_s, "peak_bytes": h.peak_bytes, "fits": h.peak_bytes <= budget}
            fits = [h["step_s"] for h in hand.values() if h["fits"]]
            over_hand = qs / min(fits) if fits else float("nan")
            rows.append({"model": name, "budget_bytes": budget, "fraction": frac,
                         "plain": {"step_s": ps, "peak_bytes": pm, "stages": pst, "roles": proles, "plan_s": pt},
                         "policy": {"step_s": qs, "peak_bytes": qm, "stages": qst, "roles": qroles, "plan_s": qt},
                         "hand": hand, "ratio": ps / qs, "policy_over_best_hand": over_hand})
            cell = lambda k: (f"{hand[k]['step_s']:8.4f}{'' if hand[k]['fits'] else '*'}"  # noqa: E731
                              if k in hand else f"{'-':>9}")
            print(f"  {name:11} {budget / GiB:7.1f}G {ps:8.4f} {pm / GiB:5.1f}G {pst:>16} {qs:8.4f} {qm / GiB:5.1f}G "
                  f"{qst:>16} {ps / qs:12.3f} {cell('full AC'):>9} {cell('op SAC'):>9} {over_hand:11.3f}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_pipeline_policies.json").write_text(json.dumps(rows, indent=1))
    print("(*: the hand recipe does not fit the budget as priced)\nwrote bench/results/bench_pipeline_policies.json")


if __name__ == "__main__":
    main()
