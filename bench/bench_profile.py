"""Benchmark of the symbolic profiler.

1. LLaMA-2-70B, batch 1, seq 4096, forward + backward, profiled two ways in one run:
   treadle (`treadle.profile.profile`, block reuse) vs the plain baseline of running the whole model under
   FakeTensorMode + FlopCounterMode. Both run on the same fake model; the eager-attention model is the
   like-for-like comparison (FlopCounterMode counts CPU SDPA as zero, so on the SDPA model its total is short by
   the attention FLOPs, which treadle counts). Target: treadle <= 1 s, >= 7x faster, identical totals.
2. Accuracy on this machine: predicted (roofline on the calibrated `cpu` spec) vs measured per-op time of a real
   GPT-2 small training step; Spearman rank correlation over ops, and predicted vs measured step time.

Run:  HF_HUB_OFFLINE=1 .venv/bin/python bench/bench_profile.py [--quick]
Writes bench/results/bench_profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402
from torch._guards import detect_fake_mode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from treadle.models.zoo import named_model  # noqa: E402
from treadle.profile import calibrate_cpu, profile  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def baseline(model, inputs) -> tuple[int, float]:
    """Whole model under FakeTensorMode + FlopCounterMode, forward + backward; (total FLOPs, seconds)."""
    fake_mode = detect_fake_mode(list(model.parameters())[:1])
    t0 = time.perf_counter()
    with fake_mode, FlopCounterMode(display=False) as fc:
        loss = model(**inputs).loss
        loss.backward()
    elapsed = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops(), elapsed


def treadle(model, inputs):
    t0 = time.perf_counter()
    prof = profile(model, inputs, hardware="h100-sxm")
    return prof, time.perf_counter() - t0


def bench_70b(console: Console, *, seq: int, reps: int) -> dict:
    rows = {}
    for attn in ("eager", "sdpa"):
        t0 = time.perf_counter()
        model, inputs = named_model("llama-2-70b", batch=1, seq=seq, fake=True, dtype=torch.bfloat16, attn=attn)
        build_s = time.perf_counter() - t0
        base_s, ours_s = [], []
        for _ in range(reps):  # interleaved, so both see the same machine load
            base_flops, s = baseline(model, inputs)
            base_s.append(s)
            prof, s = treadle(model, inputs)
            ours_s.append(s)
        rows[attn] = dict(build_s=build_s, baseline_s=min(base_s), treadle_s=min(ours_s),
                          baseline_runs_s=base_s, treadle_runs_s=ours_s, speedup=min(base_s) / min(ours_s),
                          baseline_flops=base_flops, treadle_flops=prof.total_flops, ops=len(prof.ops),
                          peak_bytes=prof.peak_bytes, peak_module=prof.peak_module, step_time_s=prof.step_time_s,
                          mfu=prof.mfu)
    rows["eager"]["identical_totals"] = rows["eager"]["baseline_flops"] == rows["eager"]["treadle_flops"]
    rows["sdpa"]["treadle_equals_eager_count"] = rows["sdpa"]["treadle_flops"] == rows["eager"]["baseline_flops"]
    t = Table(title=f"LLaMA-2-70B, batch 1, seq {seq}, fwd+bwd on fake tensors (best of {reps})",
              title_justify="left")
    for col in ("attention", "baseline s", "treadle s", "speedup", "baseline FLOPs", "treadle FLOPs", "equal"):
        t.add_column(col, justify="right")
    for attn, r in rows.items():
        equal = r["baseline_flops"] == r["treadle_flops"]
        t.add_row(attn, f"{r['baseline_s']:.3f}", f"{r['treadle_s']:.3f}", f"{r['speedup']:.1f}x",
                  f"{r['baseline_flops']:.6e}", f"{r['treadle_flops']:.6e}",
                  "yes" if equal else "no (CPU SDPA = 0 in FlopCounterMode)")
    console.print(t)
    console.print(f"model build on fake tensors (not timed above): {rows['eager']['build_s']:.2f} s; "
                  f"treadle predicts peak {rows['sdpa']['peak_bytes'] / 2**30:.1f} GiB, step "
                  f"{rows['sdpa']['step_time_s']:.2f} s, MFU {100 * rows['sdpa']['mfu']:.1f} % on h100-sxm")
    return rows


class _OpTimer(TorchDispatchMode):
    """Wall time of every ATen op of a real run, keyed by (op, k-th occurrence) in run order."""

    def __init__(self):
        super().__init__()
        self.times: list[tuple[str, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.times.append((str(func), time.perf_counter() - t0))
        return out


def _keyed(seq):
    seen = defaultdict(int)
    out = {}
    for op, value in seq:
        out[(op, seen[op])] = value
        seen[op] += 1
    return out


def bench_accuracy(console: Console, *, seq: int, reps: int) -> dict:
    # measured now, on the threads the timed run uses, under the same machine load
    hw = calibrate_cpu(threads=torch.get_num_threads())
    torch.manual_seed(0)
    model, inputs = named_model("gpt2", batch=1, seq=seq, dropout=False)
    prof = profile(model, inputs, hardware=hw)
    runs = []
    for _ in range(reps + 1):  # the first run warms up
        timer = _OpTimer()
        with timer:
            model(**inputs).loss.backward()
        model.zero_grad(set_to_none=True)
        runs.append(_keyed(timer.times))
    measured = {k: statistics.median(r[k] for r in runs[1:] if k in r) for k in runs[1]}
    predicted = _keyed((r.op, r.time_s) for r in prof.ops)
    # pair the k-th run of an op with its k-th prediction, for ops that ran equally often in both runs
    n_meas, n_pred = defaultdict(int), defaultdict(int)
    for op, _ in measured:
        n_meas[op] += 1
    for op, _ in predicted:
        n_pred[op] += 1
    keys = [k for k in predicted if k in measured and n_meas[k[0]] == n_pred[k[0]]]
    pred = [predicted[k] for k in keys]
    meas = [measured[k] for k in keys]
    rho_all = spearmanr(pred, meas).statistic
    mm = [i for i, k in enumerate(keys) if any(s in k[0] for s in ("mm", "bmm", "addmm", "attention"))]
    rho_mm = spearmanr([pred[i] for i in mm], [meas[i] for i in mm]).statistic if len(mm) > 2 else float("nan")
    heavy = [i for i, p in enumerate(pred) if p > 1e-5]  # ops the roofline prices above 10 us
    rho_heavy = spearmanr([pred[i] for i in heavy], [meas[i] for i in heavy]).statistic
    res = dict(seq=seq, matched_ops=len(keys), profiled_ops=len(prof.ops), measured_ops=len(measured),
               spearman_all=rho_all, spearman_matmul=rho_mm, spearman_over_10us=rho_heavy,
               n_over_10us=len(heavy), predicted_step_s=sum(pred), measured_step_s=sum(meas),
               predicted_matmul_s=sum(pred[i] for i in mm), measured_matmul_s=sum(meas[i] for i in mm),
               cpu_spec=hw.to_dict())
    t = Table(title=f"GPT-2 small, batch 1, seq {seq}: roofline on calibrated cpu vs measured per-op time",
              title_justify="left")
    for col in ("ops", "Spearman rho", "predicted s", "measured s"):
        t.add_column(col, justify="right")
    t.add_row(f"all ({len(keys)})", f"{rho_all:.3f}", f"{sum(pred):.4f}", f"{sum(meas):.4f}")
    t.add_row(f"matmul + attention ({len(mm)})", f"{rho_mm:.3f}", f"{res['predicted_matmul_s']:.4f}",
              f"{res['measured_matmul_s']:.4f}")
    t.add_row(f"predicted > 10 us ({len(heavy)})", f"{rho_heavy:.3f}", "", "")
    console.print(t)
    console.print(f"cpu spec: {hw}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repetition, shorter sequences")
    args = ap.parse_args()
    console = Console(width=140)
    reps = 1 if args.quick else 2
    out = {"llama_2_70b": bench_70b(console, seq=4096, reps=reps),
           "gpt2_accuracy": bench_accuracy(console, seq=128 if args.quick else 256, reps=3),
           "torch": torch.__version__, "threads": torch.get_num_threads()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "bench_profile.json"
    path.write_text(json.dumps(out, indent=2, default=str))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
