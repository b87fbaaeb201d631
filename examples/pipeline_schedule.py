"""Write a PP2 x DP2 pipeline schedule for a zoo model: two stages over the ``pp`` axis (1F1B, 2 micro-batches),
each replica its own pipeline over ``dp``. Price it, then train it:

    python examples/pipeline_schedule.py -o pp2xdp2.json          # tiny-llama, batch 8 x seq 32
    treadle price pp2xdp2.json --model tiny-llama --cluster 2x2:cpu --batch 8 --seq 32
    treadle run --nproc 4 --model tiny-llama --data examples/data/village.txt --schedule pp2xdp2.json \\
        --batch 8 --seq 32 --steps 20
"""

from __future__ import annotations

import argparse

import torch

from treadle import Mesh, create_schedule
from treadle.models.common import blocks_path
from treadle.run.setup import load_run_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="a treadle.models.zoo name")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, ... (treadle's pipeline schedules)")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--shard", action="store_true", help="FSDP2 over dp instead of replicas")
    ap.add_argument("-o", "--out", default="pp2xdp2.json")
    a = ap.parse_args()
    model = load_run_model(a.model, seq=a.seq, seed=0)
    sch = create_schedule(model, mesh=Mesh((2, 2), ("pp", "dp")))
    blocks = blocks_path(sch)
    n = len(model.get_submodule(blocks))
    sch[f"{blocks}.{n // 2 - 1}"].cut_pipeline_stage()  # half the blocks per stage
    sch.data_parallel(axis="dp", shard=a.shard)
    ids = torch.zeros(a.batch, a.seq, dtype=torch.int64)
    sch.pipeline(axis="pp", schedule=a.schedule, n_microbatches=a.microbatches,
                 example_inputs={"input_ids": ids, "labels": ids})
    with open(a.out, "w") as f:
        f.write(sch.to_json())
    print(f"wrote {a.out}: {a.model} cut after {blocks}.{n // 2 - 1}, {a.schedule} x {a.microbatches} micro-batches, "
          f"{'fsdp2' if a.shard else 'ddp'} over dp")


if __name__ == "__main__":
    main()
