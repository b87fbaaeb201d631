"""Which kernel-rate probes price a step right: the matrix-product and attention probes run on the same operands
every call ("hot") against operands taken from a ring larger than a core's private caches ("ring", the default:
NOTE [operands as a step holds them] in `treadle.profile.kernel_rates`), side by side on the same measured steps.

One process, one thread (no communication, no shared cores: only the kernel rates differ). The CPU is calibrated
once (`calibrate_cpu(threads=1)`); the hot variant replaces only its matmul curve and attention efficiency by the
hot probes' (measured right after, on the same core), so the two prices differ by the probes alone. Models: the
GPT-2 and grouped-query LLaMA of `bench_price_vs_measured.py` at seq 64, batch 2 and 8. Measured: forward,
backward and treadle's AdamW (`treadle.runtime.optimizer.adamw`), the median of ``--rounds`` rounds that visit
the configurations in alternating order, each round a median of 1.5 s of steps. Prints measured / predicted per
variant and writes bench/results/bench_kernel_rates.json.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/bench_kernel_rates.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_price_vs_measured as pvm  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = (("llama", 2), ("llama", 8), ("gpt2", 2), ("gpt2", 8))


def _steps_s(model, inputs, opt, seconds: float) -> float:
    def step():
        model(**inputs).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    ts = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import treadle
    from treadle.cost.cluster import ClusterSpec, parse_cluster
    from treadle.mesh import Mesh
    from treadle.pricing import price
    from treadle.profile import kernel_rates as kr
    from treadle.profile.hardware import calibrate_cpu
    from treadle.runtime.optimizer import adamw

    torch.set_num_threads(1)
    ring = calibrate_cpu(threads=1)
    peak = ring.peak_flops_per_s["float32"]
    torch.set_num_threads(1)
    hot = dataclasses.replace(ring, matmul_curve=kr.matmul_curve(peak, rotate_bytes=0),
                              attention_efficiency=kr.attention_efficiency(peak, rotate_bytes=0))
    print(f"matmul curve (n = {', '.join(map(str, kr.MATMUL_SIZES))}), fraction of {peak / 1e9:.1f} GFLOP/s; "
          f"attention efficiency")
    for label, hw in (("hot", hot), ("ring", ring)):
        print(f"  {label:5} {[round(e, 2) for _, e in hw.matmul_curve]}  {hw.attention_efficiency:.2f}")
    base = parse_cluster("1:cpu")
    mesh = Mesh((1,), ("dp",))
    built, predicted = {}, {}
    for name, b in CONFIGS:
        model, inputs = pvm.make_model(name, b, 64)
        for label, hw in (("hot", hot), ("ring", ring)):
            cl = ClusterSpec(mesh, base.links[:1], hw, base.copy_bytes_per_s, 1, 1, 1)
            predicted[name, b, label] = price(treadle.create_schedule(model, mesh=mesh), inputs, cl).step_s
        model, inputs = pvm.make_model(name, b, 64)
        built[name, b] = (model, inputs, adamw(model.parameters(), lr=1e-5))
    samples: dict = {key: [] for key in built}
    for r in range(args.rounds):
        for key in (CONFIGS if r % 2 == 0 else CONFIGS[::-1]):
            samples[key].append(_steps_s(*built[key], 1.5))
    rows = []
    print(f"\n  {'model':6} {'batch':>5} {'meas ms':>8} {'+-%':>4} {'hot ms':>8} {'meas/hot':>8} {'ring ms':>8} "
          f"{'meas/ring':>9}")
    for name, b in CONFIGS:
        m = statistics.median(samples[name, b])
        ci = pvm.median_rel_ci95(samples[name, b])
        h, g = predicted[name, b, "hot"], predicted[name, b, "ring"]
        rows.append({"model": name, "batch": b, "measured_s": m, "measured_rel_ci95": ci, "hot_s": h, "ring_s": g,
                     "ratio_hot": m / h, "ratio_ring": m / g})
        print(f"  {name:6} {b:5} {m * 1e3:8.2f} {100 * ci:4.0f} {h * 1e3:8.2f} {m / h:8.3f} {g * 1e3:8.2f} "
              f"{m / g:9.3f}")
    for label in ("hot", "ring"):
        errs = [abs(math.log(r[f"ratio_{label}"])) for r in rows]
        print(f"  {label}: mean |log(measured / predicted)| = {statistics.mean(errs):.3f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_kernel_rates.json").write_text(json.dumps(
        {"device": ring.source, "hot": {"matmul_curve": hot.matmul_curve, "attention": hot.attention_efficiency},
         "ring": {"matmul_curve": ring.matmul_curve, "attention": ring.attention_efficiency}, "rows": rows},
        indent=1))
    print("\nwrote bench/results/bench_kernel_rates.json")


if __name__ == "__main__":
    main()
