"""Training-step time of GPT-2 under tensor parallelism on CPU gloo, world 2: treadle's Megatron schedule vs
`torch.distributed.tensor.parallel.parallelize_module` with the same plan vs the single-process model.

Both TP runs use the same model: GPT-2 with its Conv1D layers as `nn.Linear` and the fused q|k|v split into
three linears (`parallelize_module`'s Colwise/RowwiseParallel take Linear and Embedding only, and a
contiguous column split of a fused q|k|v is not attention), the same Megatron plan (q/k/v/fc column, proj
row, one all-reduce forward and one backward per attention and MLP), embedding and LM head replicated.
Each rank runs 1 thread (world 2 on 2 cores) and holds both TP models, stepped alternately so that
machine noise hits both alike; the single-process baseline runs 2 threads.

    python bench/bench_tp.py                      # GPT-2 small: 12 layers, seq 256, batch 8
    python bench/bench_tp.py --layers 2 --steps 2 # quick
Prints a table and writes bench/results/bench_tp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from torch import nn


class QKV(nn.Module):
    """Fused q|k|v as three linears whose outputs are concatenated (same math as GPT-2's c_attn)."""

    def __init__(self, conv) -> None:
        super().__init__()
        e = conv.weight.shape[0]
        self.q, self.k, self.v = (nn.Linear(e, e) for _ in range(3))
        w, b = conv.weight.detach().t(), conv.bias.detach()  # Conv1D weight is (in, out)
        for i, lin in enumerate((self.q, self.k, self.v)):
            lin.weight.data.copy_(w[i * e:(i + 1) * e])
            lin.bias.data.copy_(b[i * e:(i + 1) * e])

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def to_linear(conv) -> nn.Linear:
    lin = nn.Linear(conv.weight.shape[0], conv.weight.shape[1])
    lin.weight.data.copy_(conv.weight.detach().t())
    lin.bias.data.copy_(conv.bias.detach())
    return lin


def make_model(layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    for blk in model.transformer.h:
        blk.attn.c_attn = QKV(blk.attn.c_attn)
        blk.attn.c_proj = to_linear(blk.attn.c_proj)
        blk.mlp.c_fc = to_linear(blk.mlp.c_fc)
        blk.mlp.c_proj = to_linear(blk.mlp.c_proj)
    return model


class Stepper:
    """One AdamW training step of a model on fixed inputs, timed."""

    def __init__(self, model, inputs) -> None:
        self.model, self.inputs = model, inputs
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(self) -> float:
        t0 = time.perf_counter()
        loss = self.model(**self.inputs).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def _inputs(batch: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50257, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def treadle_tp(model, world: int):
    import treadle
    from treadle import Mesh, Replicate

    sch = treadle.create_schedule(model, mesh=Mesh((world,), ("tp",)))
    for i in range(len(model.transformer.h)):
        b = sch[f"transformer.h.{i}"]
        for p in ("q", "k", "v"):
            b[f"attn.c_attn.{p}"].shard(["weight", "bias"], dim=0, axis="tp")
        b["attn"].shard_attr("split_size", axis="tp")
        b["attn.c_proj"].shard("weight", dim=1, axis="tp").sync("fwd_post", to=Replicate(), axis="tp")
        b["mlp.c_fc"].shard(["weight", "bias"], dim=0, axis="tp")
        b["mlp.c_proj"].shard("weight", dim=1, axis="tp").sync("fwd_post", to=Replicate(), axis="tp")
    return treadle.build(sch)


def dtensor_tp(model, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = {}
    for i, blk in enumerate(model.transformer.h):
        for p in ("q", "k", "v"):
            plan[f"transformer.h.{i}.attn.c_attn.{p}"] = ColwiseParallel()
        plan[f"transformer.h.{i}.attn.c_proj"] = RowwiseParallel()
        plan[f"transformer.h.{i}.mlp.c_fc"] = ColwiseParallel()
        plan[f"transformer.h.{i}.mlp.c_proj"] = RowwiseParallel()
        blk.attn.split_size //= world
    return parallelize_module(model, dm, plan)


def _rank(rank: int, world: int, layers: int, batch: int, seq: int, steps: int):
    """Both TP models in the same ranks, stepped alternately, so machine noise hits both alike."""
    torch.set_num_threads(1)
    inputs = _inputs(batch, seq)
    runs = {"dtensor": Stepper(dtensor_tp(make_model(layers), world), inputs),
            "treadle": Stepper(treadle_tp(make_model(layers), world), inputs)}
    times = {k: [] for k in runs}
    losses = {k: [] for k in runs}
    for i in range(steps + 1):  # the first round warms up
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]
        for k in order:
            t = runs[k].step()
            if i:
                times[k].append(t)
    return times


def main() -> None:
    from treadle import testing

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="bench/results/bench_tp.json")
    a = ap.parse_args()
    rows = {}
    torch.set_num_threads(2)
    single = Stepper(make_model(a.layers), _inputs(a.batch, a.seq))
    single.step()  # warm-up
    rows["single process (2 threads)"] = [single.step() for _ in range(a.steps)]
    del single
    per_rank = testing.spawn(_rank, 2, a.layers, a.batch, a.seq, a.steps, timeout_s=3600)
    for kind, label in (("dtensor", "DTensor parallelize_module TP=2"), ("treadle", "treadle TP=2")):
        rows[label] = [max(ts) for ts in zip(*(r[kind] for r in per_rank))]  # a step ends with the slowest rank
    med = {k: statistics.median(v) for k, v in rows.items()}
    ref = med["DTensor parallelize_module TP=2"]
    print(f"GPT-2 {a.layers} layers, batch {a.batch}, seq {a.seq}, fp32, CPU gloo, AdamW step; median of {a.steps}")
    print(f"{'configuration':<36}{'step s':>10}{'vs DTensor TP':>16}")
    for k, v in med.items():
        print(f"{k:<36}{v:>10.3f}{v / ref:>15.3f}x")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "step_s": rows, "median_s": med,
                                       "treadle_over_dtensor": med["treadle TP=2"] / ref}, indent=1))


if __name__ == "__main__":
    main()
