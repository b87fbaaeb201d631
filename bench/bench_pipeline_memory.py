"""Pipeline activation memory, predicted against measured, per schedule and micro-batch count, in one run.

Each schedule of a tiny LLaMA (batch 8 x seq 64) cut into stages over 2 gloo ranks (`pp`; 1F1B: 2 stages; the
multi-stage schedules: 4, two a rank) over 2 and 8 micro-batches: rank 0's activation bytes as `treadle.price`
states them (its walk over the schedule class's order, NOTE [pipeline price]) against the most bytes autograd holds
saved at once during a measured step on rank 0 (pack hooks, storages once, parameters excluded; under a split
backward also the output gradients each I holds for its W: the measurement of `bench_price_vs_measured.py`'s memory
column). Prints a table and writes bench/results/bench_pipeline_memory.json. Target (issue 26): within 5%.

Beside it, the whole step (NOTE [a stage's gradients at its peak]): the most bytes of every storage the step allocates
live at once on rank 0 (activations, the gradients as they accumulate over the micro-batches, each backward's
working set, the sends' buffers; a dispatch mode with a weak reference on each new storage) plus what the rank
holds before it (parameters, AdamW's state, its inputs), against the price's rank-0 peak.

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
    pred, peak = {}, {}
    for label, text in scheds:
        model, inputs = pvm.make_model("llama", 8, 64)
        rank0 = price(load_schedule(model, text), inputs, cluster).pipeline["ranks"]["0"]
        pred[label], peak[label] = rank0["activation_bytes"], rank0["peak_bytes"]
    res = spawn(pvm._measure_rank, 2, "llama", 8, 64, scheds, 1, 1, timeout_s=900)
    steps = spawn(_measure_step_peak, 2, scheds, timeout_s=900)
    rows = []
    print(f"{'schedule':24} {'activations: price MiB':>22} {'measured':>9} {'meas/price':>10}   "
          f"{'step peak: price MiB':>20} {'measured':>9} {'meas/price':>10}")
    for label, _ in scheds:
        meas = res[0]["mem"][label]["saved_bytes"]
        pk, mk = peak[label], steps[0][label]
        rows.append({"schedule": label, "predicted_bytes": pred[label], "measured_bytes": meas,
                     "ratio": meas / pred[label], "predicted_peak_bytes": pk, "measured_peak_bytes": mk,
                     "peak_ratio": mk / pk})
        print(f"{label:24} {pred[label] / 2**20:22.3f} {meas / 2**20:9.3f} {meas / pred[label]:10.3f}   "
              f"{pk / 2**20:20.3f} {mk / 2**20:9.3f} {mk / pk:10.3f}")
    pvm.write_results("bench_pipeline_memory.json", rows)


def _live_peak(step) -> int:
    """The most bytes of the storages `step()` allocates live at once (each freed when its storage dies; an op whose
    outputs alias its inputs, a view or an in-place op, allocates none)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    state = {"live": 0, "peak": 0}
    refs: dict[int, tuple[int, weakref.ref]] = {}

    def gone(key: int) -> None:
        state["live"] -= refs.pop(key)[0]

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(r.alias_info is not None for r in func._schema.returns):  # a view or an in-place op: no storage
                return out
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    st = t.untyped_storage()
                    if id(st) not in refs and st.nbytes():
                        refs[id(st)] = (st.nbytes(), weakref.ref(st, lambda _r, k=id(st): gone(k)))
                        state["live"] += st.nbytes()
                        state["peak"] = max(state["peak"], state["live"])
            return out

    with Allocations():
        step()
    return state["peak"]


def _measure_step_peak(rank: int, world: int, scheds: list) -> dict:
    """Per schedule, rank's peak over a training step (its second: the first infers the stages' shapes and
    makes AdamW's state): what it holds before the step (parameters, AdamW's state, its inputs) and the most the
    step's own allocations hold at once."""
    import torch

    torch.set_num_threads(1)
    out = {}
    for label, text in scheds:
        m, inputs, opt = pvm.build_rank("llama", 8, 64, text)
        pvm._train_step(m, inputs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        held = sum(pvm._local(p).numel() * pvm._local(p).element_size() for p in m.parameters())
        held += sum(pvm._local(v).numel() * pvm._local(v).element_size() for st in opt.state.values()
                    for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
        held += sum(b.numel() * b.element_size() for b in m.buffers())
        held += sum(v.numel() * v.element_size() for v in inputs.values() if torch.is_tensor(v)) if rank == 0 else 0
        out[label] = held + _live_peak(lambda: pvm._train_step(m, inputs))
        opt.zero_grad(set_to_none=True)
    return out


if __name__ == "__main__":
    main()
