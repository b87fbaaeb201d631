"""`treadle.price` on GPU presets, where the rehearsal disagreed with what a GPU runs.

Sequence-parallel gathers hand their consumers one contiguous tensor (NOTE [contiguous gathers] in
`treadle.runtime.collectives`), and `treadle.price` charges what that costs: one copy, saved once.

Regression for Llama-2-70B on 8x8 H100 (batch 2 per rank): the planner's SP plan gathered the sequence into a
strided view, so q, k and v (and gate and up) each copied the gathered input and autograd saved every copy —
the price came out 30 GiB over the solver, which counts the gathered input once.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import treadle
from treadle import Mesh, testing
from treadle.cost.cluster import ClusterSpec
from treadle.models.zoo import named_model
from treadle.pricing import price


def _rank_collectives(rank: int, world: int):
    from treadle.runtime import collectives as C

    g = dist.group.WORLD
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4) + 100 * rank  # (batch, seq shard, hidden)
    gathered = C.all_gather(x, 1, g)
    y = torch.arange(2 * 4 * 4, dtype=torch.float32).reshape(2, 4, 4) * (rank + 1)
    scattered = C.reduce_scatter(y, 1, g)
    return gathered, gathered.is_contiguous(), scattered, scattered.is_contiguous()


def test_gather_and_reduce_scatter_on_the_sequence_dim_are_exact_and_contiguous():
    out = testing.spawn(_rank_collectives, 2, timeout_s=120)
    xs = [torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * r for r in range(2)]
    ys_sum = sum(torch.arange(32, dtype=torch.float32).reshape(2, 4, 4) * (r + 1) for r in range(2))
    for rank, (gathered, g_contig, scattered, s_contig) in enumerate(out):
        assert torch.equal(gathered, torch.cat(xs, dim=1)) and g_contig
        assert torch.equal(scattered, ys_sum.chunk(2, dim=1)[rank]) and s_contig


def test_sequence_parallel_consumers_save_the_gathered_input_once():
    # batch 4 with tp 2: a strided gather would make q/k/v and gate/up each copy (and save) the gathered input
    model, inputs = named_model("tiny-llama", batch=4, seq=16, dropout=False)
    sch = treadle.create_schedule(model, mesh=Mesh((2,), ("tp",)))
    treadle.models.megatron(sch, tp="tp", sequence_parallel=True)
    p = price(sch, inputs, ClusterSpec.uniform(sch.mesh, "nvlink4", device="h100-sxm"))
    cfg = model.config
    gathered_bytes = 4 * 16 * cfg.hidden_size * 4  # (batch, seq, hidden) fp32, whole sequence
    rows = {r.module: r.saved_bytes for r in p.rows if r.phase == "fwd"}
    for i in range(cfg.num_hidden_layers):
        # q, k and v read the gathered input; a copy of it in any of them would be >= gathered_bytes
        qkv = sum(rows.get(f"model.layers.{i}.self_attn.{x}_proj", 0) for x in "qkv")
        assert qkv < gathered_bytes, (i, qkv, gathered_bytes)
    # per block: two gathered inputs (attention, MLP) kept for backward, made by the gathers
    for i in range(cfg.num_hidden_layers):
        assert rows.get(f"model.layers.{i}.self_attn", 0) >= gathered_bytes
        assert rows.get(f"model.layers.{i}.mlp", 0) >= gathered_bytes


def test_uninitialised_allocations_move_no_bytes():
    # torch.empty only allocates: priced as free, whereas zeros writes its bytes
    from treadle.profile.hardware import hardware_preset
    from treadle.profile.profiler import profile

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            shape = (64, 128)
            return x * self.w + torch.empty(shape).sum() * 0 + torch.zeros(shape).sum()

    prof = profile(M(), (torch.randn(64, 128),), hardware=hardware_preset("h100"))
    by_op = {r.op: r for r in prof.ops}
    assert by_op["aten.empty.memory_format"].write_bytes == 0
    assert by_op["aten.empty.memory_format"].time_s == 0
    assert by_op["aten.zeros.default"].write_bytes == 64 * 128 * 4


def test_selective_checkpoint_with_attention_dropout_recomputes_the_fused_kernel():
    """NOTE [attention as a GPU runs it] also in recomputation: the forward ran attention as the fused kernel
    (dropout folded in); a recompute on the CPU's math path ran other ops and the selective checkpoint failed
    ("aten._to_copy.default encountered during backward but not found in storage", GPT-2-XL + SAC)."""
    from treadle.models.common import blocks_path

    model, inputs = named_model("tiny-gpt2", batch=4, seq=16, fake=True, dtype=torch.bfloat16)  # dropout 0.1
    sch = treadle.create_schedule(model, mesh=Mesh((2,), ("dp",)))
    sch.data_parallel(axis="dp", shard=True)
    keep = ["aten.mm", "aten.addmm", "aten._scaled_dot_product_flash_attention_for_cpu"]
    for i in range(len(sch[blocks_path(sch)].mod)):
        sch[f"{blocks_path(sch)}.{i}"].checkpoint(save=keep)
    p = price(sch, inputs, ClusterSpec.uniform(sch.mesh, "nvlink4", device="h100-sxm"))
    assert p.recompute_s > 0
    # the fused kernel's output is kept, so no attention FLOPs are recomputed: recompute is elementwise only
    assert all(s["flops"] == 0 for s in p.segments if s["phase"] == "recompute"), \
        [s for s in p.segments if s["phase"] == "recompute" and s["flops"]]
