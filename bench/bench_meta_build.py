"""What `build` holds per rank while it gives a meta model its values (NOTE [late materialisation]), against the
model materialised whole first: what ``--init real`` does, and what ``--init meta`` did before values came late.

A LLaMA of ~155M parameters (hidden 1024, 8 blocks, vocabulary 32000; 0.62 GB in fp32) on 4 gloo ranks, each
schedule built twice in fresh processes: "whole" creates the model on meta, materialises it whole (the same seeded
values) and builds; "late" builds the meta model. Per rank: the high-water mark of the process's resident memory
during model creation + build, over its resident memory before (MB); the rank's own parameters after build (MB);
the largest over ranks is printed. The ratio is late / whole, in one run. The ranks run with glibc's mmap threshold
fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_, unless set): with its default dynamic threshold, freed whole tensors of a few
tens of MB stay in the heap (reused by later allocations, but counted in the resident high-water mark), which would
hide what build holds.

    python bench/bench_meta_build.py           # prints a table, writes bench/results/meta_build.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "FSDP2 x4": {"mesh": (4,), "names": ("dp",), "shard": True},
    "FSDP2 x2 . TP2": {"mesh": (2, 2), "names": ("dp", "tp"), "shard": True},
    "DDP x2 . TP2": {"mesh": (2, 2), "names": ("dp", "tp"), "shard": False},
    "PP4 (1F1B)": {"mesh": (4,), "names": ("pp",), "cuts": [1, 3, 5]},
    "PP2 . FSDP2 x2": {"mesh": (2, 2), "names": ("pp", "dp"), "shard": True, "cuts": [3]},
}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from treadle.run.setup import parameters_on_meta

    cfg = LlamaConfig(num_hidden_layers=8, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                      intermediate_size=2816, vocab_size=32000, max_position_embeddings=256, use_cache=False)
    with parameters_on_meta():
        return LlamaForCausalLM(cfg)


def _rank(rank: int, world: int, case: dict, mode: str) -> dict:
    import treadle
    from treadle import Mesh, create_schedule
    from treadle.models import megatron
    from treadle.runtime.materialize import materialize

    torch.set_num_threads(1)
    before = _rss_mb()
    model = _model()
    if mode == "whole":
        materialize(model, None, "cpu")
    sch = create_schedule(model, mesh=Mesh(tuple(case["mesh"]), tuple(case["names"])))
    if "tp" in case["names"]:
        megatron(sch, tp="tp", vocab_parallel_head=False)
    if "dp" in case["names"]:
        sch.data_parallel(axis="dp", shard=case["shard"])
    for c in case.get("cuts", []):
        sch[f"model.layers.{c}"].cut_pipeline_stage()
    if "pp" in case["names"]:
        ids = torch.randint(0, 32000, (8, 64))
        sch.pipeline(axis="pp", schedule="1f1b", n_microbatches=4, example_inputs={"input_ids": ids, "labels": ids})
    built = treadle.build(sch)
    params = built.param_dict().values() if hasattr(built, "param_dict") else built.parameters()
    own = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in params)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
    return {"peak_mb": peak - before, "own_mb": own / 2**20}


def main() -> None:
    from treadle.testing import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "meta_build.json"))
    args = ap.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by each spawned rank's C library at its start
    rows = []
    print(f"{'schedule':<16} {'own MB':>7} {'whole: peak MB':>15} {'late: peak MB':>14} {'late / whole':>13}")
    for name, case in CASES.items():
        world = 1
        for n in case["mesh"]:
            world *= n
        got = {mode: spawn(_rank, world, case, mode, timeout_s=600) for mode in ("whole", "late")}
        row = {"schedule": name, "own_mb": max(r["own_mb"] for r in got["late"]),
               **{f"{m}_peak_mb": max(r["peak_mb"] for r in got[m]) for m in got}}
        row["ratio"] = row["late_peak_mb"] / row["whole_peak_mb"]
        rows.append(row)
        print(f"{name:<16} {row['own_mb']:>7.0f} {row['whole_peak_mb']:>15.0f} {row['late_peak_mb']:>14.0f} "
              f"{row['ratio']:>13.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "LLaMA hidden 1024, 8 blocks, vocab 32000 (fp32)", "ranks": 4, "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
