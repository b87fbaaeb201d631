"""Blocking collectives inside real training steps: each call's time on every rank against the calibrated price.

The measurement behind NOTE [collectives in a chain] and NOTE [lead-dependent skew] (`treadle.cost.calibrate`).
For GPT-2 or the tiny LLaMA of `bench_price_vs_measured.py` (batch 8 x seq 64) on a gloo mesh, three schedules
(Megatron TP (x DP on 2x2), + sequence parallelism, + full checkpointing) are built and stepped; every call of
`treadle.runtime.collectives`' all-reduce, all-gather and reduce-scatter is timed on each rank, with its *lead*
(the time since the rank left the previous such call, or since the step's start). Prints, per schedule and rank,
the calls per step and the seconds per step spent inside them against the calibrated alpha-beta price of the same
calls (lead ignored), and rank 0's calls bucketed by kind and lead (mean and median measured, priced).

Needs a calibrated cluster: bench/results/cluster_<config>.json as `bench_price_vs_measured.py` writes it
(or --cluster FILE).

    .venv/bin/python bench/bench_collectives_in_step.py [--model gpt2|llama] [--config 2x2|4|2] [--steps 10]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_price_vs_measured as pvm  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _rank(rank: int, world: int, model_name: str, texts: list, steps: int) -> dict:
    import torch.distributed as dist

    import treadle.runtime.collectives as C

    torch.set_num_threads(1)
    calls: list[tuple[str, int, float, float]] = []  # (kind, bytes, lead s, time s)
    state = {"last": 0.0, "on": False}

    def timed(kind, fn, nbytes_of):
        def call(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            t1 = time.perf_counter()
            if state["on"]:
                calls.append((kind, nbytes_of(a), t0 - state["last"], t1 - t0))
            state["last"] = t1
            return out
        return call

    nbytes = lambda i: (lambda a: a[i].numel() * a[i].element_size())  # noqa: E731
    C._all_gather_base = timed("all_gather", C._all_gather_base, nbytes(0))
    C._reduce_scatter_base = timed("reduce_scatter", C._reduce_scatter_base, nbytes(1))
    wrapped = type("dist", (), {k: getattr(dist, k) for k in dir(dist) if not k.startswith("__")})
    wrapped.all_reduce = staticmethod(timed("all_reduce", dist.all_reduce, nbytes(0)))
    C.dist = wrapped
    out = {}
    for label, text in texts:
        m, inputs, opt = pvm.build_rank(model_name, 8, 64, text)
        for _ in range(2):
            m(**inputs).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        calls.clear()
        step_s = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            state["last"], state["on"] = t0, True
            m(**inputs).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            state["on"] = False
            step_s.append(time.perf_counter() - t0)
        out[label] = {"step_s": step_s, "calls": list(calls)}
    return out


def main() -> None:
    import treadle
    from treadle import Mesh
    from treadle.cost import collective_cost as cc
    from treadle.cost.cluster import ClusterSpec
    from treadle.models import megatron as meg
    from treadle.testing import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", choices=("gpt2", "llama"))
    ap.add_argument("--config", default="2x2", help="2x2, 4 or 2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cluster", help="calibrated cluster JSON (default bench/results/cluster_<config>.json)")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.config.split("x"))
    names = ("dp", "tp") if len(shape) == 2 else ("x",)
    tp, dp = names[-1], (names[0] if len(shape) == 2 else None)
    path = Path(args.cluster) if args.cluster else RESULTS / f"cluster_{args.config}.json"
    if not path.exists():
        raise SystemExit(f"{path} not found: run bench_price_vs_measured.py --configs {args.config} first, or pass "
                         f"--cluster")
    cluster = ClusterSpec.from_json(path.read_text())
    mesh = Mesh(shape, names)
    texts = []
    for label, fn in (("Megatron TP", lambda s: meg(s, tp=tp, dp=dp)),
                      ("TP + SP", lambda s: meg(s, tp=tp, dp=dp, sequence_parallel=True)),
                      ("TP + ckpt", lambda s: meg(s, tp=tp, dp=dp, checkpoint_fraction=1.0))):
        model, _ = pvm.make_model(args.model, 8, 64)
        sch = treadle.create_schedule(model, mesh=mesh)
        fn(sch)
        texts.append((label, sch.to_json()))
    res = spawn(_rank, math.prod(shape), args.model, texts, args.steps, timeout_s=1200)
    link, n = cluster.link(tp), cluster.mesh.size(tp)
    priced = {"all_reduce": cc.all_reduce_time_s, "all_gather": cc.all_gather_time_s,
              "reduce_scatter": cc.reduce_scatter_time_s}
    print(f"{args.model} on gloo {args.config}; link {tp}: {link}, skew {link.skew_s * 1e3:.2f} ms after "
          f"{link.skew_lead_s * 1e3:.2f} ms ({path})")
    for label, _ in texts:
        print(f"\n{label}: step median {statistics.median(res[0][label]['step_s']) * 1e3:.1f} ms")
        for r, rank_res in enumerate(res):
            calls = rank_res[label]["calls"]
            inside = sum(c[3] for c in calls) / args.steps
            price = sum(priced[k](b, n, link) for k, b, _, _ in calls) / args.steps
            print(f"  rank {r}: {len(calls) / args.steps:.0f} calls a step, inside them {inside * 1e3:.1f} ms a step, "
                  f"priced {price * 1e3:.1f} ms (lead ignored)")
        buckets: dict[tuple[str, str], list] = {}
        for kind, b, lead, t in res[0][label]["calls"]:
            key = (kind, "lead < 0.5 ms" if lead < 5e-4 else "lead 0.5-2 ms" if lead < 2e-3 else "lead >= 2 ms")
            buckets.setdefault(key, []).append((t, priced[kind](b, n, link), lead))
        for (kind, lead), v in sorted(buckets.items()):
            print(f"    {kind:15} {lead:14} {len(v):4} calls: measured mean "
                  f"{statistics.fmean(x[0] for x in v) * 1e3:5.2f} ms, median {statistics.median(x[0] for x in v) * 1e3:5.2f}"
                  f"; priced {statistics.fmean(x[1] for x in v) * 1e3:5.2f}; mean lead "
                  f"{statistics.fmean(x[2] for x in v) * 1e3:5.2f} ms")


if __name__ == "__main__":
    main()
