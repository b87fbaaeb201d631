"""The generality table: every step of treadle (profile, plan, plan under a budget, verify, price, train, the
Megatron recipe, the kernel schedule) on every architecture of the generality suite (`tests/arch_suite.py`: tiny
random configs of 19 Hugging Face architectures, two plain-PyTorch language-model codes, two CNNs), on 2 gloo ranks.

    python bench/bench_generality.py                 # every architecture, every step (about 10 min on 2 cores)
    python bench/bench_generality.py llama qwen3     # some architectures

Prints a Markdown table (ok / refused / FAIL per step, with the seconds each architecture took) and writes
bench/results/bench_generality.json with every step's detail (a refusal's message, a failure's error). A refusal
is a treadle error raised at schedule or plan time, before anything is built; FAIL is anything else.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import arch_suite  # noqa: E402


def main(names: list[str]) -> None:
    rows = []
    print("| architecture | what it exercises | " + " | ".join(arch_suite.STEPS) + " | s |")
    print("|---" * (len(arch_suite.STEPS) + 3) + "|")
    for name in names or list(arch_suite.ARCHS):
        t0 = time.perf_counter()
        res = arch_suite.run_steps(name)
        dt = time.perf_counter() - t0
        rows.append({"arch": name, "what": arch_suite.ARCHS[name][1], "seconds": round(dt, 1),
                     "steps": {k: {"outcome": v[0], "detail": v[1]} for k, v in res.items()}})
        cells = [res[s][0] if s in res else "-" for s in arch_suite.STEPS]
        print(f"| {name} | {arch_suite.ARCHS[name][1]} | " + " | ".join(cells) + f" | {dt:.0f} |", flush=True)
    print()
    print(readme_table(rows))
    out = Path(__file__).parent / "results" / "bench_generality.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


def readme_table(rows: list[dict]) -> str:
    """The README's table: the five general steps in one column, the budget plan's roles, the two recipes."""
    out = ["| architecture (tiny config): what it exercises | profile, plan, verify, price, train | plan under a budget "
           "(x the unconstrained peak) | `megatron`, tp=2 | `kernel_schedule` |", "|---|---|---|---|---|"]
    for r in rows:
        st = r["steps"]
        five = all(st[k]["outcome"] == "ok" for k in ("profile", "plan", "verify_plan", "price", "train"))
        b = st["plan_budget"]
        budget = b["outcome"]
        if budget == "ok":
            roles, _, frac = b["detail"].partition(" under ")
            budget = f"{frac.split()[0]}: {roles}"
        m, k = st["megatron"], st["kernels"]
        meg = f"verifies ({m['detail']})" if m["outcome"] == "ok" else m["outcome"]
        n = k["detail"].split(" replaced")[0]
        ker = k["outcome"] if k["outcome"] != "ok" else (f"verifies ({n} replaced or fused)" if n != "0"
                                                         else "verifies (nothing matched)")
        out.append(f"| {r['arch']}: {r['what']} | {'ok' if five else 'FAIL'} | {budget} | {meg} | {ker} |")
    return "\n".join(out)


if __name__ == "__main__":
    main(sys.argv[1:])
