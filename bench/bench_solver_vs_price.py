"""The planner's own estimate against the price of the plans it returns: one analysis, one fact.

The planner chooses with its MILP's step and peak; `treadle.price` rehearses the built schedule op by op. Where the
two disagree, the planner ranks plans by figures the plan will not have. Each case plans with `price_top`
candidates priced (`Plan.solver["priced"]`), and each row is one priced candidate: the solver's step and peak, the
price's, and their ratios. The summary is the median and largest |solver / price - 1| over the rows, for each.

Cases: Llama-3-8B on 1x8 H100 (batch 2 x 4096, no budget), Llama-3-8B on 2x8 H100 pipelined over the node axis
(batch 16 x 4096, 27.4 GiB: `bench_pipeline_policies`' middle budget), GPT-2-XL on 1x8 H100 (batch 32 x 1024),
the demo's GPT-2 and tiny LLaMA on the fixed 2x2 CPU cluster of the golden cases (`tests/golden`), tiny LLaMA
pipelined over its first axis. GPU cases bf16 on fake tensors; CPU cases fp32.

    .venv/bin/python bench/bench_solver_vs_price.py [--out FILE] [--compare FILE]

`--compare` prints a previous run's ratio beside each row (the same case and roles); the default output is
bench/results/bench_solver_vs_price.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
CPU_CLUSTER = ROOT / "tests" / "golden" / "cpu_2x2_cluster.json"


def _cases():
    from treadle.cost.cluster import ClusterSpec, parse_cluster
    from treadle.models.zoo import named_model

    cpu = ClusterSpec.from_json(CPU_CLUSTER.read_text())

    def gpu(name, batch, seq):
        return lambda: named_model(name, batch=batch, seq=seq, fake=True, dtype=torch.bfloat16)

    def tiny(name, batch, seq):
        def build():
            torch.manual_seed(0)
            return named_model(name, batch=batch, seq=seq, dropout=False)
        return build

    return [
        ("llama-3-8b 1x8:h100 b2x4096", gpu("llama-3-8b", 2, 4096), parse_cluster("1x8:h100"), {}),
        ("llama-3-8b 2x8:h100 b16x4096 pp 27.4 GiB", gpu("llama-3-8b", 16, 4096), parse_cluster("2x8:h100"),
         dict(pp_axis="node", memory_budget_bytes=27.4 * GiB)),
        ("gpt2-xl 1x8:h100 b32x1024", gpu("gpt2-xl", 32, 1024), parse_cluster("1x8:h100"), {}),
        ("tiny-gpt2 2x2:cpu b8x64", tiny("tiny-gpt2", 8, 64), cpu, dict(pp_axis=None)),
        ("tiny-llama 2x2:cpu b8x32", tiny("tiny-llama", 8, 32), cpu, dict(pp_axis=None)),
        ("tiny-llama 2x2:cpu b8x32 pp", tiny("tiny-llama", 8, 32), cpu, dict(pp_axis=cpu.mesh.names[0])),
    ]


def run(price_top: int = 4) -> list[dict]:
    from treadle.planner import plan_model

    rows = []
    for label, build, cluster, kw in _cases():
        if "pp_axis" in kw and kw["pp_axis"] == "node":
            kw = {**kw, "pp_axis": cluster.mesh.names[0]}
        model, inputs = build()
        t0 = time.perf_counter()
        plan = plan_model(model, inputs, cluster=cluster, price_top=price_top, **kw)
        secs = time.perf_counter() - t0
        print(f"  {label}: {plan.roles} in {secs:.0f} s", file=sys.stderr, flush=True)
        for p in plan.solver.get("priced", []):
            rows.append({"case": label, "roles": p["roles"],
                         "solver_step_s": p["solver_step_s"], "price_step_s": p["step_s"],
                         "ratio": p["solver_step_s"] / p["step_s"], "price_peak_gib": p["peak_bytes"] / GiB,
                         "solver_peak_gib": p["solver_peak_bytes"] / GiB,
                         "peak_ratio": p["solver_peak_bytes"] / p["peak_bytes"], "planning_s": secs})
    return rows


def table(rows: list[dict], before: dict[tuple[str, str], tuple[float, float | None]]) -> str:
    head = "| case | roles (priced candidates) | solver s | price s | solver / price | solver peak GiB | price peak GiB |"
    head += " peak solver / price |" + (" before (step, peak) |" if before else "")
    lines = [head, "|" + "---|" * (8 + bool(before))]
    for r in rows:
        line = (f"| {r['case']} | {r['roles']} | {r['solver_step_s']:.5g} | {r['price_step_s']:.5g} | "
                f"{r['ratio']:.3f} | {r['solver_peak_gib']:.3f} | {r['price_peak_gib']:.3f} | {r['peak_ratio']:.3f} |")
        if before:
            b = before.get((r["case"], r["roles"]))
            line += (f" {b[0]:.3f}, " + ("-" if b[1] is None else f"{b[1]:.3f}") + " |") if b is not None else " - |"
        lines.append(line)
    for what, key in (("step", "ratio"), ("peak", "peak_ratio")):
        err = [abs(r[key] - 1) for r in rows]
        lines.append(f"\n{len(rows)} priced candidates, {what}: |solver / price - 1| median "
                     f"{statistics.median(err):.3f}, largest {max(err):.3f}")
        old = [abs(v[what == "peak"] - 1) for v in before.values() if v[what == "peak"] is not None]
        if old:
            lines.append(f"before ({len(old)}): median {statistics.median(old):.3f}, largest {max(old):.3f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bench_solver_vs_price.json"))
    ap.add_argument("--compare", help="a previous run's JSON: its ratios beside these")
    args = ap.parse_args()
    rows = run()
    before = {}
    if args.compare:
        before = {(r["case"], r["roles"]): (r["ratio"], r.get("peak_ratio"))
                  for r in json.loads(Path(args.compare).read_text())["rows"]}
    print(table(rows, before))
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
