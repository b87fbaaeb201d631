"""Pipeline activation memory, predicted against measured, per schedule and micro-batch count, in one run.

Each schedule of a tiny LLaMA (batch 8 x seq 64) cut into stages over 2 gloo ranks (`pp`; 1F1B: 2 stages; the
multi-stage schedules: 4, two a rank) over 2 and 8 micro-batches: rank 0's activation bytes as `treadle.price`
states them (its walk over the schedule class's order, NOTE [pipeline price]) against the most bytes autograd holds
saved at once during a measured step on rank 0 (pack hooks, storages once, parameters excluded; under a split
backward also the output gradients each I holds for its W: the measurement of `bench_price_vs_measured.py`'s memory
column). Prints a table and writes bench/results/bench_pipeline_memory.json. Target (issue 26): within 5%.

    .venv/bin/python bench/bench_pipeline_memory.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_price_vs_measured as pvm  # noqa: E402

CASES = [(kind, m) for kind in ("1f1b", "interleaved_1f1b", "interleaved_zb", "zbv") for m in (2, 8)]


def main() -> None:
    import treadle
    from treadle import Mesh
    from treadle.cost.cluster import parse_cluster
    from treadle.pricing import price
    from treadle.schedule.replay import load_schedule
    from treadle.testing import spawn

    scheds = []
    for kind, m in CASES:
        model, inputs = pvm.make_model("llama", 8, 64)
        sch = treadle.create_schedule(model, mesh=Mesh((2,), ("pp",)))
        for c in ([1] if kind == "1f1b" else [0, 1, 2]):
            sch[f"model.layers.{c}"].cut_pipeline_stage()
        sch.pipeline(axis="pp", schedule=kind, n_microbatches=m, example_inputs=inputs)
        scheds.append((f"{kind} M={m}", sch.to_json()))
    cluster = parse_cluster("2:cpu")
    cluster = pvm._by_position(cluster, Mesh((2,), ("pp",)))
    pred = {}
    for label, text in scheds:
        model, inputs = pvm.make_model("llama", 8, 64)
        pred[label] = price(load_schedule(model, text), inputs, cluster).pipeline["ranks"]["0"]["activation_bytes"]
    res = spawn(pvm._measure_rank, 2, "llama", 8, 64, scheds, 1, 1, timeout_s=900)
    rows = []
    print(f"{'schedule':24} {'price MiB':>10} {'measured MiB':>13} {'meas/price':>10}")
    for label, _ in scheds:
        meas = res[0]["mem"][label]["saved_bytes"]
        rows.append({"schedule": label, "predicted_bytes": pred[label], "measured_bytes": meas,
                     "ratio": meas / pred[label]})
        print(f"{label:24} {pred[label] / 2**20:10.2f} {meas / 2**20:13.2f} {meas / pred[label]:10.2f}")
    pvm.write_results("bench_pipeline_memory.json", rows)


if __name__ == "__main__":
    main()
