"""Layout conversions on a 2x2 gloo mesh: predicted vs measured time, and treadle vs DTensor.redistribute.

Four gloo ranks on this machine. First the mesh is calibrated (treadle.cost.calibrate: alpha, beta and launch
cost per axis). Then, for every pair of layouts of a 3-D float32 tensor (per axis R, S0, S1, S2, P; both
shard orders where two axes shard one dim), each rank times treadle's conversion (`redistribute`, forward)
and, for the pairs DTensor supports, `DTensor.redistribute` of the same local data, interleaved, median of
`--reps` runs after a warm-up; a run's time is the slowest rank's. Reports

- predicted (calibrated cost model) vs measured treadle time: Spearman rank correlation, median relative error;
- measured treadle / DTensor time: median and geometric mean of the ratio, wins and losses, worst cases.

Prints a table and writes every row to bench/results/bench_layouts.json.

    .venv/bin/python bench/bench_layouts.py [--shape 32 64 128] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from treadle import testing
from treadle.cost.calibrate import calibrate_cluster
from treadle.cost.convert import plan_conversion
from treadle.cost.layout import Layout, enumerate_layouts, shard_slices
from treadle.mesh import Mesh
from treadle.runtime.redistribute import redistribute

RESULTS = Path(__file__).resolve().parent / "results"


def _timed(fn, reps: int) -> float:
    fn()  # warm-up: planning caches, DTensor's sharding propagation caches
    samples = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        samples.append(dt.item())
    return statistics.median(samples)


def _wait(t: torch.Tensor) -> torch.Tensor:
    """DTensor's functional collectives return before they finish (AsyncCollectiveTensor): wait for them."""
    return t.wait() if hasattr(t, "wait") else t


def _rank(rank: int, world: int, shape: tuple[int, ...], reps: int):
    from torch.distributed.tensor import DTensor

    mesh = Mesh((2, 2), ("a", "b")).bind()
    t0 = time.perf_counter()
    cal = calibrate_cluster(mesh)
    calib_s = time.perf_counter() - t0
    cluster = cal.cluster
    layouts = list(enumerate_layouts(2, len(shape), shard_orders=True))
    x_glob = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    rows = []
    for src in layouts:
        x = x_glob[shard_slices(shape, src, mesh, rank)].contiguous()
        if src.partial_axes:  # a valid summand: the value on coordinate 0 of every Partial axis, zeros elsewhere
            coord = mesh.coordinate(rank)
            if any(coord[mesh.names[a]] for a in src.partial_axes):
                x = torch.zeros_like(x)
        dt = None
        if src.has_default_order:
            dt = DTensor.from_local(x, mesh.device_mesh, list(src.placements), run_check=False,
                                    shape=torch.Size(shape), stride=x_glob.stride())
        for dst in layouts:
            plan = plan_conversion(src, dst, global_shape=shape, itemsize=4, cluster=cluster)
            ours_s = _timed(lambda: redistribute(x, src, dst, mesh=mesh, global_shape=shape, cluster=cluster), reps)
            theirs_s = None
            if dt is not None and dst.has_default_order and not dst.partial_axes:
                theirs_s = _timed(lambda: _wait(dt.redistribute(mesh.device_mesh, list(dst.placements)).to_local()),
                                  reps)
            rows.append({"src": str(src), "dst": str(dst), "predicted_s": plan.time_s, "treadle_s": ours_s,
                         "dtensor_s": theirs_s, "collectives": plan.num_collectives,
                         "steps": [f"{s.op}({'+'.join(s.axes)})" for s in plan.steps]})
    return {"rows": rows, "calibration": json.loads(cal.to_json()), "calibrate_s": calib_s}


def _spearman(xs: list[float], ys: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(xs, ys).statistic)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[32, 64, 128], help="global tensor shape (float32)")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per pair and system (median)")
    args = ap.parse_args(argv)
    shape = tuple(args.shape)
    t0 = time.perf_counter()
    out = testing.spawn(_rank, 4, shape, args.reps, timeout_s=1800)[0]
    wall_s = time.perf_counter() - t0
    rows = out["rows"]

    comm = [r for r in rows if r["collectives"] > 0]
    rho = _spearman([r["predicted_s"] for r in comm], [r["treadle_s"] for r in comm])
    rel = [abs(r["predicted_s"] - r["treadle_s"]) / r["treadle_s"] for r in comm]
    both = [r for r in rows if r["dtensor_s"] is not None and r["src"] != r["dst"]]
    ratios = [r["treadle_s"] / r["dtensor_s"] for r in both]
    geo = math.exp(statistics.fmean(math.log(x) for x in ratios))
    wins = sum(x < 0.9 for x in ratios)
    losses = sum(x > 1.1 for x in ratios)

    by_op: dict[str, list[float]] = {}
    for r in comm:
        if r["collectives"] == 1 and len(r["steps"]) == 1:
            by_op.setdefault(r["steps"][0].split("(")[0] + ("(flat)" if "+" in r["steps"][0] else ""), []).append(
                r["treadle_s"] / r["predicted_s"])
    cal = out["calibration"]
    print(f"2x2 gloo mesh, tensor {shape} float32 ({math.prod(shape) * 4 / 2**20:.1f} MiB), {args.reps} reps, "
          f"{len(rows)} pairs, wall {wall_s:.0f} s (calibration {out['calibrate_s']:.1f} s)")
    for link in cal["cluster"]["links"]:
        scales = ", ".join(f"{k} x{v:.2f}" for k, v in link["op_scale"].items())
        print(f"  calibrated {link['name']}: latency {link['latency_s'] * 1e6:.0f} us, launch "
              f"{link['launch_s'] * 1e6:.0f} us, {link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; {scales}")
    held = [abs(h["predicted_s"] - h["measured_s"]) / h["measured_s"] for h in cal["held_out"]]
    held_ag = [abs(h["predicted_s"] - h["measured_s"]) / h["measured_s"] for h in cal["held_out"]
               if h["op"] == "all_gather"]
    print(f"  held-out sizes: all-gather max error {max(held_ag):.0%}, all collectives median error "
          f"{statistics.median(held):.0%} ({len(held)} points)")
    print()
    print(f"{'metric':58s} {'value':>10s}")
    print(f"{'pairs with communication':58s} {len(comm):>10d}")
    print(f"{'Spearman rank correlation, predicted vs measured':58s} {rho:>10.3f}")
    print(f"{'median |predicted - measured| / measured':58s} {statistics.median(rel):>10.2f}")
    for op, xs in sorted(by_op.items()):
        print(f"{'  measured / predicted, single ' + op + f' ({len(xs)} pairs), median':58s} "
              f"{statistics.median(xs):>10.2f}")
    print(f"{'pairs timed against DTensor.redistribute':58s} {len(both):>10d}")
    print(f"{'treadle / DTensor time, median ratio':58s} {statistics.median(ratios):>10.3f}")
    print(f"{'treadle / DTensor time, geometric mean ratio':58s} {geo:>10.3f}")
    print(f"{'pairs treadle >10% faster / >10% slower':58s} {f'{wins} / {losses}':>10s}")
    print()
    print(f"{'pair':34s} {'steps':44s} {'pred us':>8s} {'ours us':>8s} {'DT us':>8s} {'ratio':>6s}")
    showcase = {("(S(0), S(0))", "(R, R)"), ("(P, P)", "(R, R)"), ("(P, P)", "(S(0), S(1))"),
                ("(S(0), R)", "(S(1), R)"), ("(P, R)", "(S(0), R)"), ("(S(0), S(1))", "(S(1), S(0))")}
    worst = sorted(both, key=lambda r: r["treadle_s"] / r["dtensor_s"])[-3:]
    for r in [r for r in rows if (r["src"], r["dst"]) in showcase] + worst:
        dt_us = f"{r['dtensor_s'] * 1e6:8.0f}" if r["dtensor_s"] else f"{'-':>8s}"
        ratio = f"{r['treadle_s'] / r['dtensor_s']:6.2f}" if r["dtensor_s"] else f"{'-':>6s}"
        print(f"{r['src'] + ' -> ' + r['dst']:34s} {' '.join(r['steps'])[:44]:44s} {r['predicted_s'] * 1e6:8.0f} "
              f"{r['treadle_s'] * 1e6:8.0f} {dt_us} {ratio}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "bench_layouts.json"
    path.write_text(json.dumps({"shape": shape, "reps": args.reps, "spearman": rho, "median_rel_error":
                                statistics.median(rel), "ratio_median": statistics.median(ratios),
                                "ratio_geomean": geo, "wins": wins, "losses": losses, **out}, indent=1))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
