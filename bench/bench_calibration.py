"""Which calibration prices a step right: two calibrations of the same links, side by side on the same measured
steps. ``--compare statistic``: each collective's samples summarised by their median against their mean (NOTE
[a step pays the mean] in `treadle.cost.calibrate`); ``--compare chain`` (default): every sample started from a
world barrier against chains of (compute, collective) pairs timed end to end (NOTE [collectives in a chain]);
``--compare skew``: one chain calibration priced with and without its drift term (NOTE [lead-dependent skew]);
``--compare rounds``: the 15 sweeps every earlier calibration took (held-out sizes too) against the 5 that
`treadle plan` takes on this host before it plans (`treadle.cost.this_host`, NOTE [calibration rounds]); the
seconds each calibration took are printed and kept.

Per configuration (models and schedules of `bench_price_vs_measured.py`: GPT-2 and a tiny LLaMA with grouped-query
attention, batch 8 x seq 64, hand plans and the planner's two plans): the CPU is calibrated once
(`calibrate_cpu`), the cluster twice in one process group, once per variant (two calibrations minutes apart:
their difference includes the host's noise), every schedule is measured once (`bench_price_vs_measured`'s
protocol: interleaved rounds, slowest rank, median step, with its 95% bootstrap half-width) and priced under
both clusters. Prints measured vs predicted per variant and issue 9's targets for each; writes
bench/results/bench_calibration_<compare>.json.

    .venv/bin/python bench/bench_calibration.py [--compare chain|skew|statistic] [--models gpt2 llama] [--configs 2x2 4 2]
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_price_vs_measured as pvm  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# variant name -> (calibrate_cluster keyword arguments, whether the links keep their measured drift), per
# comparison; variants with the same arguments share one calibration (``--compare skew``: the same links with
# and without NOTE [lead-dependent skew], so the comparison carries no calibration noise)
VARIANTS = {
    "statistic": {"median": ({"statistic": "median", "chain": 1}, True),
                  "mean": ({"statistic": "mean", "chain": 1}, True)},
    "chain": {"barrier": ({"chain": 1}, True), "chain": ({"chain": 8}, True)},
    "skew": {"no skew": ({"chain": 8}, False), "skew": ({"chain": 8}, True)},
    "rounds": {"15 rounds": ({"rounds": 15}, True), "5 rounds": ({"rounds": 5, "held_out_bytes": ()}, True)},
}


def _calibrate_rank(rank: int, world: int, shape: tuple, names: tuple, device, variants: dict) -> dict:
    from treadle.cost.calibrate import calibrate_cluster
    from treadle.cost.cluster import ClusterSpec
    from treadle.mesh import Mesh

    import time

    torch.set_num_threads(1)
    mesh = Mesh(shape, names)
    base = ClusterSpec.uniform(mesh, "loopback", device=device)
    done: dict[str, tuple[str, float]] = {}
    for kw, _ in variants.values():
        key = json.dumps(kw, sort_keys=True)
        if key not in done:
            t0 = time.perf_counter()
            text = calibrate_cluster(mesh, base=base, **{"rounds": 15, **kw}).cluster.to_json()
            done[key] = (text, time.perf_counter() - t0)
    return {name: done[json.dumps(kw, sort_keys=True)] for name, (kw, _) in variants.items()}


def _without_skew(cluster):
    """The same cluster with every link's drift removed (skew_s = 0)."""
    import dataclasses

    plain = [dataclasses.replace(cluster.link(a), skew_s=0.0, skew_lead_s=0.0) for a in cluster.mesh.names]
    groups = tuple((axes, dataclasses.replace(link, skew_s=0.0, skew_lead_s=0.0))
                   for axes, link in cluster.group_links)
    return dataclasses.replace(cluster.with_links(plain), group_links=groups)


def run_config(model_name: str, config: str, args) -> dict:
    from treadle.cost.cluster import ClusterSpec
    from treadle.pricing import price
    from treadle.profile.hardware import calibrate_cpu
    from treadle.schedule.replay import load_schedule
    from treadle.testing import spawn

    variants = VARIANTS[args.compare]
    names_v = tuple(variants)
    shape = tuple(int(x) for x in config.split("x"))
    names = ("dp", "tp") if len(shape) == 2 else ("x",)
    world = math.prod(shape)
    device = calibrate_cpu(threads=1)
    texts = spawn(_calibrate_rank, world, shape, names, device, variants, timeout_s=1800)[0]
    seconds = {v: texts[v][1] for v in names_v}
    clusters = {v: ClusterSpec.from_json(texts[v][0]).with_ranks(threads_per_rank=1, ranks_per_host=world,
                                                              cores_per_host=os.cpu_count())
                for v in names_v}
    clusters = {v: c if variants[v][1] else _without_skew(c) for v, c in clusters.items()}
    for v, c in clusters.items():
        print(f"  {v} (calibrated in {seconds[v]:.1f} s): " + "; ".join(f"{a} {c.link(a)} skew {c.link(a).skew_s * 1e3:.2f} ms after "
                                     f"{c.link(a).skew_lead_s * 1e3:.2f} ms" for a in c.mesh.names), flush=True)
    scheds = pvm.schedules(model_name, shape, names, args.batch, args.seq, clusters[names_v[-1]], False)
    res = spawn(pvm._measure_rank, world, model_name, args.batch, args.seq, scheds, args.steps, args.repeats,
                timeout_s=3000)[0]
    rows = []
    for label, text in scheds:
        ts = res["times"][label]
        row = {"schedule": label, "measured_s": statistics.median(ts), "measured_rel_ci95": pvm.median_rel_ci95(ts)}
        for v, cluster in clusters.items():
            model, inputs = pvm.make_model(model_name, args.batch, args.seq)
            row[f"predicted_s_{v}"] = price(load_schedule(model, text), inputs, cluster).step_s
        rows.append(row)
    print(f"\n{model_name} batch {args.batch} x seq {args.seq}, gloo {config} ({world} ranks): measured, then "
          f"predicted and measured/predicted under each calibration ({', '.join(names_v)})")
    print(f"  {'schedule':30} {'meas ms':>8} {'+-%':>4}" + "".join(f" {v + ' ms':>11} {'ratio':>6}"
                                                               for v in names_v))
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        print(f"  {r['schedule']:30} {r['measured_s'] * 1e3:8.1f} {100 * r['measured_rel_ci95']:4.0f}"
              + "".join(f" {r[f'predicted_s_{v}'] * 1e3:11.1f} {r['measured_s'] / r[f'predicted_s_{v}']:6.2f}"
                        for v in names_v))
    summary = {}
    for v in names_v:
        pred = [r[f"predicted_s_{v}"] for r in rows]
        meas = [r["measured_s"] for r in rows]
        ratios = [m / p for m, p in zip(meas, pred)]
        rho = pvm.spearman(pred, meas)
        verdict = pvm.targets(rho, ratios, [1.0])  # memory does not depend on the calibration of the links
        summary[v] = {"spearman": rho, "time_ratio_spread": max(ratios) / min(ratios), "calibration_s": seconds[v],
                      "spearman_ok": verdict["Spearman >= 0.9"],
                      "ratio_ok": verdict["time ratios within +-25% of one factor"]}
        print(f"  {v:8}: Spearman {rho:.2f} ({'PASS' if summary[v]['spearman_ok'] else 'FAIL'}), time ratio "
              f"max/min {max(ratios) / min(ratios):.2f} ({'PASS' if summary[v]['ratio_ok'] else 'FAIL'})",
              flush=True)
    return {"model": model_name, "config": config, "compare": args.compare, "rows": rows, "summary": summary}


def main() -> None:
    args = pvm.parse_args(__doc__.splitlines()[0], lambda ap: ap.add_argument(
        "--compare", choices=sorted(VARIANTS), default="chain", help="which two calibrations (default chain)"))
    out = [run_config(m, c, args) for m in args.models for c in args.configs]
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"bench_calibration_{args.compare}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
