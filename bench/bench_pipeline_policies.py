"""The planner's pipelines with and without a selective checkpoint policy to choose from in each stage (NOTE
[checkpoint policies in a pipeline's stages] in `treadle.forms.pipeline.stage_policies`), predicted on a GPU preset.

Per model and memory budget, two plans with the pipeline over the node axis of 2 x 8 H100 (`pp_axis` pinned, the
rest planned, bf16, `price_top=1`: each priced as built by `treadle.price`): without policies (full checkpoint
counts only) and with torchtitan's op-level SAC ("alternate-matmuls") allowed (`TrainSpec(checkpoint_policies=...)`).
The budgets are fractions of the way from the smaller of the two plans' priced peaks with every block of every
stage fully checkpointed to the peak of the plan without a budget, so that checkpointing must save memory. Prints,
per row, each plan's priced step and peak, what each stage checkpoints (full / under the policy), and the ratio
without / with (> 1: the policy helps). A CPU preset is not benched: selective checkpointing's dispatch modes cost
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
          f"{'stages':>16} {'plain/policy':>12}")
    for name in args.models:
        top = _plan(name, cluster, pp, None, ())
        # the least memory: the plan at a budget just above every block checkpointed (the planner's smallest)
        try:
            _plan(name, cluster, pp, 1.0, ())
        except PlanError as exc:
            least = exc.smallest_budget_bytes
        for frac in FRACTIONS:
            budget = least + frac * (top.price["peak_bytes"] - least)
            got = {}
            for label, pol in (("plain", ()), ("policy", (SAC,))):
                t0 = time.perf_counter()
                try:
                    plan = _plan(name, cluster, pp, budget, pol)
                    got[label] = (plan.price["step_s"], plan.price["peak_bytes"], _stages(plan), plan.roles,
                                  time.perf_counter() - t0)
                except PlanError as exc:
                    got[label] = (float("inf"), float("inf"), f"none fits: {exc}"[:60], "", 0.0)
            (ps, pm, pst, proles, pt), (qs, qm, qst, qroles, qt) = got["plain"], got["policy"]
            rows.append({"model": name, "budget_bytes": budget, "fraction": frac,
                         "plain": {"step_s": ps, "peak_bytes": pm, "stages": pst, "roles": proles, "plan_s": pt},
                         "policy": {"step_s": qs, "peak_bytes": qm, "stages": qst, "roles": qroles, "plan_s": qt},
                         "ratio": ps / qs})
            print(f"  {name:11} {budget / GiB:7.1f}G {ps:8.4f} {pm / GiB:5.1f}G {pst:>16} {qs:8.4f} {qm / GiB:5.1f}G "
                  f"{qst:>16} {ps / qs:12.3f}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_pipeline_policies.json").write_text(json.dumps(rows, indent=1))
    print("wrote bench/results/bench_pipeline_policies.json")


if __name__ == "__main__":
    main()
