"""`treadle.price`: any schedule priced by rehearsal; each pricing rule against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import treadle
from treadle import Mesh, Replicate
from treadle.cost import collective_cost as cc
from treadle.cost.cluster import ClusterSpec, parse_cluster
from treadle.cost.overlap import Collective, Segment, simulate
from treadle.forms.data.facts import ddp_buckets, fsdp_units
from treadle.errors import LayoutError, PlanError
from treadle.models.zoo import named_model
from treadle.pricing import price

MiB = 2**20


# ------------------------------------------------------------------------------------------ overlap model (pure)
def _segs(*secs: float) -> list[Segment]:
    return [Segment(f"m{i}", "bwd", s) for i, s in enumerate(secs)]


def test_blocking_collective_is_on_the_critical_path():
    c = Collective("all_reduce", "tp", 100, 0.5, "m0", "fwd", issue_after=0)
    tl = simulate(_segs(1, 2, 3), [c])
    assert tl.step_s == pytest.approx(6.5) and tl.exposed_comm_s == pytest.approx(0.5)
    assert (c.start_s, c.end_s, c.exposed_s) == pytest.approx((1.0, 1.5, 0.5))
    assert tl.segment_start_s == pytest.approx([0.0, 1.5, 3.5])


def test_async_collective_hides_behind_the_compute_after_it():
    short = Collective("all_reduce", "dp", 1, 4.0, "m0", "bwd", issue_after=0, blocking=False)
    tl = simulate(_segs(1, 2, 3), [short])  # runs 1..5, compute ends at 6
    assert tl.step_s == pytest.approx(6.0) and tl.exposed_comm_s == 0 and tl.overlapped_comm_s == pytest.approx(4)
    long = Collective("all_reduce", "dp", 1, 6.0, "m0", "bwd", issue_after=0, blocking=False)
    tl = simulate(_segs(1, 2, 3), [long])  # runs 1..7
    assert tl.step_s == pytest.approx(7.0) and long.exposed_s == pytest.approx(1.0)


def test_one_channel_per_axis_fifo_and_prefetch_waits():
    # two gathers on one axis queue; the second is needed before segment 2
    a = Collective("all_gather", "dp", 1, 2.0, "u1", "fwd", issue_after=-1, blocking=False, needed_before=1)
    b = Collective("all_gather", "dp", 1, 2.0, "u2", "fwd", issue_after=-1, blocking=False, needed_before=2)
    tl = simulate([Segment("u0", "fwd", 1.0), Segment("u1", "fwd", 1.0), Segment("u2", "fwd", 1.0)], [a, b])
    # a: 0..2 (segment 1 waits 1 s), b: 2..4 (segment 2 would start at 3, waits 1 s)
    assert (a.end_s, b.end_s) == pytest.approx((2.0, 4.0))
    assert tl.segment_start_s == pytest.approx([0.0, 2.0, 4.0]) and tl.step_s == pytest.approx(5.0)
    assert a.exposed_s + b.exposed_s == pytest.approx(tl.exposed_comm_s) == pytest.approx(2.0)


def test_no_overlap_serialises_everything():
    c = Collective("all_reduce", "dp", 1, 4.0, "m0", "bwd", issue_after=0, blocking=False)
    tl = simulate(_segs(1, 2, 3), [c], overlap=False)
    assert tl.step_s == pytest.approx(10.0) and tl.exposed_comm_s == pytest.approx(4.0)


def test_simulate_rejects_a_collective_outside_the_step():
    with pytest.raises(ValueError, match="issue_after 5 outside the 3 segments"):
        simulate(_segs(1, 1, 1), [Collective("all_reduce", "dp", 1, 1.0, "m", "bwd", issue_after=5)])


def test_ddp_buckets_first_1mib_then_25mib_one_dtype_each():
    grads = [("a", MiB // 2, "f32"), ("b", MiB * 6 // 10, "f32"), ("h", MiB, "bf16"), ("c", 10 * MiB, "f32"),
             ("d", 20 * MiB, "f32"), ("e", MiB, "f32")]
    # f32: a+b = 1.1 MiB closes the first bucket (>= 1 MiB); c+d = 30 MiB closes the next (>= 25 MiB); e stays
    # bf16: h alone reaches its own first 1 MiB limit
    assert ddp_buckets(grads) == [["a", "b"], ["h"], ["c", "d"], ["e"]]


# ------------------------------------------------------------------------------------------ rehearsed schedules
class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 3):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


def _gpu_cluster(mesh: Mesh) -> ClusterSpec:
    return ClusterSpec.uniform(mesh, "nvlink4", device="h100-sxm")


def test_ddp_prices_one_bucketed_all_reduce_overlapped_with_backward():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    sch = treadle.create_schedule(model, mesh=Mesh((2,), ("dp",)))
    sch.data_parallel(axis="dp")
    cl = _gpu_cluster(sch.mesh)
    p = price(sch, {"x": x}, cl)
    grad_bytes = sum(q.numel() * 4 for q in model.parameters())
    assert grad_bytes < MiB  # one bucket
    (ddp,) = [c for c in p.collectives if c["source"] == "ddp"]
    assert ddp["kind"] == "all_reduce" and ddp["nbytes"] == grad_bytes
    assert ddp["time_s"] == pytest.approx(cc.all_reduce_time_s(grad_bytes, 2, cl.link("dp")))
    # the bucket is complete when the first parameter's gradient (inp) is: the end of backward; the
    # optimizer waits for it
    assert p.exposed_comm_s == pytest.approx(ddp["time_s"]) and p.step_s == pytest.approx(p.compute_s + ddp["time_s"])
    assert p.grad_bytes == grad_bytes and p.data_parallel == "ddp over dp"


def test_ddp_buckets_follow_gradient_readiness_and_hide_behind_backward():
    torch.manual_seed(0)
    model, x = Net(d=256, n=3), torch.randn(8, 256)  # each block 2 MiB of fp32 gradients
    sch = treadle.create_schedule(model, mesh=Mesh((2,), ("dp",)))
    sch.data_parallel(axis="dp")
    cl = _gpu_cluster(sch.mesh)
    p = price(sch, {"x": x}, cl)
    ddp = [c for c in p.collectives if c["source"] == "ddp"]
    sizes = [c["nbytes"] for c in ddp]
    # ready order: blocks.2.down (1 MiB + bias: closes bucket 1), blocks.2.up, blocks.1.*, ... (< 25 MiB), inp
    assert sizes[0] == 256 * 1024 * 4 + 256 * 4
    assert sum(sizes) == sum(q.numel() * 4 for q in model.parameters()) and len(ddp) == 2
    # hand timeline: a bucket starts when its last gradient is ready and its axis is free
    end = {(s["module"], s["phase"]): s["start_s"] + s["compute_s"] for s in p.segments}
    assert ddp[0]["start_s"] == pytest.approx(end["blocks.2.down", "bwd"])
    assert ddp[0]["start_s"] < p.segments[-1]["start_s"]  # issued inside backward: overlapped
    assert ddp[1]["start_s"] == pytest.approx(max(ddp[0]["end_s"], end["inp", "bwd"]))
    for c in ddp:
        assert c["end_s"] == pytest.approx(c["start_s"] + cc.all_reduce_time_s(c["nbytes"], 2, cl.link("dp")))
    (optim,) = [s for s in p.segments if s["phase"] == "optim"]  # waits for every bucket
    assert optim["start_s"] == pytest.approx(max(end["inp", "bwd"], ddp[1]["end_s"]))
    assert p.step_s == pytest.approx(optim["start_s"] + optim["compute_s"])
    assert p.exposed_comm_s == pytest.approx(p.step_s - p.compute_s)
    assert p.overlapped_comm_s == pytest.approx(p.comm_s - p.exposed_comm_s) and p.overlapped_comm_s > 0


def test_fsdp2_gathers_per_unit_with_prefetch_and_reduce_scatters():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    sch = treadle.create_schedule(model, mesh=Mesh((2,), ("dp",)))
    sch.data_parallel(axis="dp", shard=True)
    cl = _gpu_cluster(sch.mesh)
    p = price(sch, {"x": x}, cl)
    assert fsdp_units(model) == ["blocks.0", "blocks.1", "blocks.2", ""]
    block_bytes = sum(q.numel() * 4 for q in model.blocks[0].parameters())
    root_bytes = sum(q.numel() * 4 for q in model.inp.parameters())
    fs = [c for c in p.collectives if c["source"] == "fsdp"]
    gathers = [(c["module"], c["phase"], c["nbytes"]) for c in fs if c["kind"] == "all_gather"]
    assert gathers == [("", "fwd", root_bytes)] + [(f"blocks.{i}", "fwd", block_bytes) for i in range(3)] + \
        [(f"blocks.{i}", "bwd", block_bytes) for i in (2, 1, 0)]  # the root is not gathered again in backward
    rs = sorted((c["module"], c["nbytes"]) for c in fs if c["kind"] == "reduce_scatter")
    assert rs == [("", root_bytes)] + [(f"blocks.{i}", block_bytes) for i in range(3)]
    for c in fs:
        assert c["time_s"] == pytest.approx(getattr(cc, f"{c['kind']}_time_s")(c["nbytes"], 2, cl.link("dp")))
    # parameters, gradients and optimizer state are divided over dp
    n = sum(q.numel() for q in model.parameters())
    assert p.grad_bytes == n * 4 / 2


def _tiny(name="tiny-gpt2", batch=8, seq=32):
    return named_model(name, batch=batch, seq=seq, dropout=False)


# NOTE [a fake group leaves no trace]
def test_pricing_leaves_the_processs_excepthook_and_process_group_as_it_found_them():
    import sys

    import torch.distributed as dist

    from treadle.profile.overheads import distributed_overheads_s

    before = sys.excepthook
    model, x = Net(), torch.randn(8, 16)
    for _ in range(3):  # torch wraps the hook at every init_process_group and never unwraps it
        sch = treadle.create_schedule(model, mesh=Mesh((2,), ("dp",)))
        sch.data_parallel(axis="dp")
        price(sch, {"x": x}, _gpu_cluster(sch.mesh))
    assert distributed_overheads_s(reps=1) is not None  # calibrate_cpu's DTensor / FSDP2 probes: a fake group too
    assert sys.excepthook is before and not dist.is_initialized()


def test_megatron_recipe_with_sync_shard_attr_blocks3_and_vocab_loss_is_priced():
    model, inputs = _tiny()
    sch = treadle.create_schedule(model, mesh=Mesh((2,), ("tp",)))
    blk = sch["transformer.h.0"]
    blk["attn.c_attn"].shard("weight", dim=1, axis="tp", blocks=3).shard("bias", dim=0, axis="tp", blocks=3)
    blk["attn"].shard_attr("split_size", axis="tp")
    blk["attn.c_proj"].shard("weight", dim=0, axis="tp").sync("fwd_post", to=Replicate(), axis="tp")
    cl = _gpu_cluster(sch.mesh)
    p = price(sch, inputs, cl)
    tp = [c for c in p.collectives if c["source"] == "tp"]
    # the row-parallel c_proj sums its output (forward) and c_attn sums its input's gradient (backward)
    # (the gradient all-reduce is made where c_attn's input enters it, so it is charged to the attention)
    assert sorted((c["module"], c["phase"], c["kind"]) for c in tp) == [
        ("transformer.h.0.attn", "bwd", "all_reduce"), ("transformer.h.0.attn.c_proj", "fwd", "all_reduce")]
    act = 8 * 32 * 64 * 4  # one (batch, seq, n_embd) fp32 activation
    for c in tp:
        assert c["nbytes"] == act and c["blocking"] and c["exposed_s"] == pytest.approx(c["time_s"])
    full = price(treadle.models.megatron(treadle.create_schedule(_tiny()[0], mesh=Mesh((2,), ("tp",))), tp="tp"),
                 inputs, cl)
    assert full.activation_bytes < p.activation_bytes and full.peak_bytes < p.peak_bytes
    assert any(r.module.startswith("transformer.h.3") and r.comm_s for r in full.rows)


def test_checkpoint_recomputes_and_saves_less():
    model, inputs = _tiny()
    cl = _gpu_cluster(Mesh((2,), ("dp",)))
    plain = treadle.create_schedule(model, mesh=cl.mesh)
    ck = treadle.create_schedule(_tiny()[0], mesh=cl.mesh)
    for i in range(4):
        ck[f"transformer.h.{i}"].checkpoint()
    a, b = price(plain, inputs, cl), price(ck, inputs, cl)
    assert a.recompute_s == 0 and b.recompute_s > 0 and b.activation_bytes < a.activation_bytes / 2
    assert b.step_s == pytest.approx(b.compute_s + b.recompute_s + b.exposed_comm_s)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-bert", "tiny-llama", "tiny-opt", "tiny-t5"])
def test_activation_bytes_equal_what_autograd_saves(name):
    model, inputs = _tiny(name, batch=4, seq=16)
    sch = treadle.create_schedule(model, mesh=Mesh((1,), ("dp",)))
    p = price(sch, inputs, ClusterSpec.uniform(sch.mesh, "loopback"))
    seen: set[int] = set()
    params = {id(q.untyped_storage()) for q in model.parameters()}
    inputs_st = {id(t.untyped_storage()) for t in inputs.values() if torch.is_tensor(t)}
    total = 0

    def pack(t):
        nonlocal total
        key = id(t.untyped_storage())
        if key not in seen and key not in params and key not in inputs_st:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs)
    del out
    assert abs(p.activation_bytes - total) <= 0.03 * total, (p.activation_bytes, total)


def test_rank_device_shares_cores_and_ignores_the_callers_threads():
    cl = parse_cluster("2x2:cpu")
    assert cl.rank_device().cores_per_rank == 1 and not cl.rank_device().overlap
    shared = cl.with_ranks(cores_per_host=2)
    d = shared.rank_device()
    assert d.cores_per_rank == 0.5 and d.ranks_per_host == 4
    assert d.peak_flops_per_s["float32"] == pytest.approx(cl.hardware().peak_flops_per_s["float32"] / 2)
    assert shared.with_ranks(cores_per_host=16).rank_device().overlap  # 16 cores >= 4 ranks x (1 + 1 comm thread)
    assert ClusterSpec.from_dict(shared.to_dict()) == shared
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = shared.rank_hardware()
        torch.set_num_threads(2)
        assert shared.rank_hardware() == one
    finally:
        torch.set_num_threads(before)
    with pytest.raises(LayoutError, match="cores_per_host must be a positive int"):
        cl.with_ranks(cores_per_host=0)


def test_price_errors_name_the_problem():
    model, inputs = _tiny()
    sch = treadle.create_schedule(model, mesh=Mesh((2,), ("dp",)))
    sch.data_parallel(axis="dp")
    odd = {k: v[:3] for k, v in inputs.items()}
    with pytest.raises(PlanError, match="batch 3, not divisible by the data-parallel axis of size 2"):
        price(sch, odd, _gpu_cluster(sch.mesh))
    with pytest.raises(PlanError, match="cluster has 4 ranks"):
        price(sch, inputs, parse_cluster("2x2:cpu"))
    with pytest.raises(PlanError, match="example_inputs must be a dict"):
        price(sch, (inputs["input_ids"],), _gpu_cluster(sch.mesh))


def test_price_cli(tmp_path, capsys):
    from treadle.cli import main

    model, _ = _tiny()
    sch = treadle.create_schedule(model, mesh=Mesh((2, 2), ("dp", "tp")))
    treadle.models.megatron(sch, tp="tp", dp="dp")
    f = tmp_path / "schedule.json"
    f.write_text(sch.to_json())
    out = tmp_path / "price.json"
    assert main(["price", str(f), "--model", "tiny-gpt2", "--cluster", "2x2:cpu", "--batch", "8", "--seq", "32",
                 "--json", str(out)]) == 0
    import json

    d = json.loads(out.read_text())
    assert d["step_s"] > 0 and d["device"]["cores_per_rank"] == 1 and d["data_parallel"] == "ddp over dp"
    assert {c["source"] for c in d["collectives"]} == {"tp", "ddp"}
    assert math.isclose(d["peak_bytes"], d["static_bytes"] + d["activation_bytes"] + d["transient_bytes"])


def test_price_refuses_inside_a_process_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model, inputs = _tiny()
    sch = treadle.create_schedule(model, mesh=Mesh((1,), ("dp",)))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        with pytest.raises(PlanError, match="already initialised in this process"):
            price(sch, inputs, ClusterSpec.uniform(sch.mesh, "loopback"))
    finally:
        dist.destroy_process_group()
