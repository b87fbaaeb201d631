"""NOTE [framework overheads]: the host costs of checkpointing, FSDP2 and the optimizer, each charged by
`treadle.price` and by the planner's cost graph where the runtime pays it (hand computations)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import treadle
from treadle import Mesh
from treadle.cost.cluster import ClusterSpec
from treadle.errors import ProfileError
from treadle.profile import overheads as ov
from treadle.profile.hardware import CPU_CORE, HardwareSpec, hardware_preset
from treadle.pricing import price
from treadle.runtime.optimizer import adamw_ops

from test_price import Net

ZERO = dict(op_overhead_s=0.0, subclass_op_overhead_s=0.0, checkpoint_region_s=0.0, checkpoint_op_s=0.0,
            fsdp_unit_s=0.0, fsdp_param_s=0.0)


def _cluster(mesh: Mesh, **overheads) -> ClusterSpec:
    hw = dataclasses.replace(hardware_preset("h100-sxm"), **{**ZERO, **overheads})
    return ClusterSpec.uniform(mesh, "nvlink4", device=hw)


def _sch(mesh: Mesh, *, dp: str | None = None, shard: bool = False, ckpt: int = 0):
    torch.manual_seed(0)
    model = Net(d=16, n=3)
    sch = treadle.create_schedule(model, mesh=mesh)
    if dp:
        sch.data_parallel(axis=dp, shard=shard)
    for i in range(ckpt):
        sch[f"blocks.{i}"].checkpoint()
    return sch, {"x": torch.randn(8, 16)}


def test_checkpoint_costs_a_region_and_each_recomputed_op():
    mesh = Mesh((1,), ("x",))
    base = price(*_sch(mesh, ckpt=2), _cluster(mesh))
    p = price(*_sch(mesh, ckpt=2), _cluster(mesh, checkpoint_region_s=1e-3, checkpoint_op_s=1e-5))
    n_ops = sum(s["ops"] for s in base.segments if s["phase"] == "recompute")
    assert n_ops > 0
    assert p.recompute_s - base.recompute_s == pytest.approx(2 * 1e-3 + n_ops * 1e-5)
    assert p.compute_s == pytest.approx(base.compute_s)  # forward, backward, optimizer untouched
    # without checkpointing nothing is charged
    plain = price(*_sch(mesh), _cluster(mesh, checkpoint_region_s=1e-3, checkpoint_op_s=1e-5))
    assert plain.recompute_s == 0


def test_fsdp2_units_and_parameters_cost_host_time_per_step():
    mesh = Mesh((2,), ("dp",))
    base = price(*_sch(mesh, dp="dp", shard=True), _cluster(mesh))
    p = price(*_sch(mesh, dp="dp", shard=True), _cluster(mesh, fsdp_unit_s=1e-3, fsdp_param_s=1e-5))
    n_params = sum(1 for _ in Net(d=16, n=3).parameters())
    units = 4  # blocks.0-2 and the root
    assert p.compute_s - base.compute_s == pytest.approx(units * 1e-3 + n_params * 1e-5)
    # DDP pays none of it
    d0 = price(*_sch(mesh, dp="dp"), _cluster(mesh))
    d1 = price(*_sch(mesh, dp="dp"), _cluster(mesh, fsdp_unit_s=1e-3, fsdp_param_s=1e-5))
    assert d1.compute_s == pytest.approx(d0.compute_s)


@pytest.mark.parametrize("foreach", [False, True])
def test_optimizer_dispatches_per_tensor_or_per_list_and_dtensor_parameters_pay_the_subclass_cost(foreach):
    mesh = Mesh((2,), ("dp",))
    n = sum(1 for _ in Net(d=16, n=3).parameters())
    ops, list_ops = adamw_ops(n, foreach)
    assert (ops, list_ops) == ((12 + 2 * n, 12) if foreach else (10 * n, 10 * n))

    def optim_s(**kw) -> float:
        sch, x = _sch(mesh, dp="dp", shard=kw.pop("shard", False))
        cl = _cluster(mesh, **kw)
        cl = ClusterSpec(cl.mesh, cl.links, dataclasses.replace(cl.device, optimizer_foreach=foreach,
                                                                 optimizer_fused=False), cl.copy_bytes_per_s)
        (seg,) = [s for s in price(sch, x, cl).segments if s["phase"] == "optim"]
        return seg["compute_s"]

    assert optim_s(op_overhead_s=1e-5) - optim_s() == pytest.approx(ops * 1e-5)
    # plain (DDP) parameters are no subclass; FSDP2's are DTensors
    assert optim_s(subclass_op_overhead_s=1e-4) == pytest.approx(optim_s())
    assert optim_s(shard=True, subclass_op_overhead_s=1e-4) - optim_s(shard=True) == pytest.approx(list_ops * 1e-4)


def test_rank_hardware_scales_every_overhead_by_the_cores_a_rank_gets():
    mesh = Mesh((4,), ("x",))
    cl = ClusterSpec.uniform(mesh, "loopback", device=CPU_CORE).with_ranks(threads_per_rank=1, ranks_per_host=4,
                                                                            cores_per_host=2)
    hw = cl.rank_hardware()
    for k in ZERO:
        assert getattr(hw, k) == pytest.approx(getattr(CPU_CORE, k) * 2), k  # half a core each
    assert hw.optimizer_foreach is True  # NOTE [foreach optimizer]: the runtime's AdamW on CPU too
    assert hw.optimizer_fused is True  # NOTE [fused optimizer]: and fused where it can


def test_cost_graph_charges_checkpointed_blocks_and_fsdp_units_like_price():
    from treadle.models.zoo import named_model
    from treadle.planner.capture import capture
    from treadle.planner.cost_graph import Roles, build_cost_graph
    from treadle.planner.ilp import evaluate

    model, inputs = named_model("tiny-gpt2", batch=4, seq=16, dropout=False)
    graph = capture(model, (), inputs)
    mesh = Mesh((2,), ("dp",))
    kw = dict(checkpoint_region_s=1e-3, checkpoint_op_s=1e-5, fsdp_unit_s=2e-3)
    cg0 = build_cost_graph(graph, _cluster(mesh), Roles("dp", True, (), ()))
    cg1 = build_cost_graph(graph, _cluster(mesh, **kw), Roles("dp", True, (), ()))
    (t, info), = cg1.templates.items()
    # the ops the block's nodes dispatch in forward, counted at capture (NOTE [ops per node]), up to its last op that
    # saves a tensor: what the recompute runs (NOTE [recompute stops early])
    last = max(i for i in graph.blocks[t].nodes if i in graph.packers)
    ops = sum(graph.fwd_ops.get(i, 0) for u in info.units for i in cg1.units[u].nodes if i <= last)
    ops += sum(graph.packs.get(i, 0) for u in info.units for i in cg1.units[u].nodes)  # and a detach per activation
    assert ops >= sum(len(cg1.units[u].nodes) for u in info.units) // 2
    assert cg1.ckpt_host_s[t] == pytest.approx(1e-3 + ops * 1e-5) and cg0.ckpt_host_s[t] == 0
    assert cg1.host_s == pytest.approx((info.count + 1) * 2e-3)  # every block and the root are FSDP2 units
    choice = [0] * len(cg1.units)
    s0, _, _ = evaluate(cg0, choice, {t: 2})
    s1, _, terms = evaluate(cg1, choice, {t: 2})
    assert s1 - s0 == pytest.approx(2 * (1e-3 + ops * 1e-5) + (info.count + 1) * 2e-3)


def test_hardware_spec_overheads_round_trip_and_are_validated(tmp_path):
    path = tmp_path / "cpu.json"
    CPU_CORE.save(path)
    back = HardwareSpec.load(path)
    assert back == CPU_CORE and back.optimizer_foreach is True
    with pytest.raises(ProfileError, match="fsdp_unit_s must be >= 0"):
        dataclasses.replace(CPU_CORE, fsdp_unit_s=-1.0)


def test_overhead_probes_fit_two_points_and_measure_positive_costs():
    assert ov._fit_line(2, 5.0, 6, 13.0) == (1.0, 2.0)
    assert ov._fit_line(1, 5.0, 3, 1.0) == (5.0, 0.0)  # a negative slope (noise) clamps to 0
    # the probes are differences of timings: under a loaded runner a difference can measure 0 (clamped), so only
    # their sign and a loose upper bound are facts here, no timing
    region_s, op_s = ov.checkpoint_overheads_s(reps=2)
    assert region_s >= 0 and op_s >= 0
    sub, unit_s, param_s, kept_s = ov.distributed_overheads_s(reps=2)
    assert sub > 0 and unit_s >= 0 and param_s >= 0 and 0 <= kept_s < 1e-2
    # the selective-checkpoint probe: a region and an op of the dispatch modes, each a difference (>= 0)
    sel_region, sel_op = ov.selective_overheads_s(reps=2)
    assert sel_region >= 0 and 0 <= sel_op < 1e-3
    # a split stage backward walks the graph and runs autograd twice: more host time per backward op; the bound
    # only catches a unit error (a second, not microseconds): on a loaded 2-core runner it measured 225 us
    assert 0 <= ov.split_backward_op_s(reps=3) < 2e-3


def test_the_split_backward_probe_times_the_same_gradients_as_the_whole_one():
    """What `split_backward_op_s` differences is the same work done two ways: torch's split stage backward
    (input, then weight gradients) gives the whole backward's gradients exactly."""
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[ov._TinyBlock() for _ in range(3)])
    params = list(model.parameters())
    x = torch.randn(2, 4, requires_grad=True)
    g = torch.ones(2, 4)
    (dx,) = stage_backward(model(x), g, [x])
    whole = [dx] + [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    (dx,), groups = stage_backward_input([model(x)], [g], [x], iter(params))
    stage_backward_weight(iter(params), groups)
    split = [dx] + [p.grad for p in params]
    assert len(whole) == len(split) == 1 + 6 * 3
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ NOTE [kernel rates]
def test_kernel_rates_refine_the_roofline_by_kind_size_and_op():
    from treadle.profile.roofline import matmul_efficiency, op_time_s

    base = hardware_preset("h100-sxm")
    hw = dataclasses.replace(base, matmul_curve=((1e6, 0.2), (1e8, 0.8)), attention_efficiency=0.4,
                             elementwise_s_per_elem={"tanh": 1e-9})
    peak = hw.peak_for("float32")
    # clamped below and above, log-interpolated between: 1e7 is half-way in log space
    assert matmul_efficiency(1e5, hw) == 0.2 and matmul_efficiency(1e9, hw) == 0.8
    assert matmul_efficiency(1e7, hw) == pytest.approx(0.5)
    assert op_time_s(int(1e7), 0, hw, "float32", kind="matmul") == pytest.approx(1e7 / (peak * 0.5))
    assert op_time_s(int(1e7), 0, hw, "float32", kind="attention") == pytest.approx(1e7 / (peak * 0.4))
    assert op_time_s(int(1e7), 0, hw, "float32", kind="pointwise") == pytest.approx(1e7 / (peak * 0.7))
    # an arithmetic-bound pointwise op takes at least elems x its rate; other ops keep the memory roofline
    mem = op_time_s(0, 8 * 10**6, hw, "float32")
    assert op_time_s(0, 8 * 10**6, hw, "float32", op="tanh", elems=10**6) == pytest.approx(max(mem, 1e-3))
    assert op_time_s(0, 8 * 10**6, hw, "float32", op="add", elems=10**6) == pytest.approx(mem)
    # the spec keeps its rates through JSON and through a rank's share of a CPU host
    assert HardwareSpec.from_json(hw.to_json()) == hw
    cpu = dataclasses.replace(CPU_CORE, elementwise_s_per_elem={"tanh": 1e-9}, matmul_curve=((1e6, 0.5),))
    cl = ClusterSpec.uniform(Mesh((4,), ("x",)), "loopback", device=cpu).with_ranks(cores_per_host=2)
    rh = cl.rank_hardware()
    assert rh.elementwise_s_per_elem["tanh"] == pytest.approx(2e-9) and rh.matmul_curve == ((1e6, 0.5),)
    with pytest.raises(ProfileError, match="matmul_curve"):
        dataclasses.replace(base, matmul_curve=((1e6, 1.5),))


# NOTE [operands as a step holds them]
def test_kernel_probes_take_each_calls_operands_from_a_ring_larger_than_the_private_caches():
    from treadle.profile import kernel_rates as kr

    made = []

    def make():
        made.append((torch.zeros(64, 64), torch.zeros(64, 64)))  # 32 KiB a pair
        return made[-1]

    nxt, n = kr._ring(make, 1 << 20)
    assert n == 32 and len(made) == 32 and len({id(a) for a, _ in made}) == 32
    seen = [nxt() for _ in range(2 * n)]  # every copy in turn, then around again
    assert [id(x[0]) for x in seen[:n]] == [id(x[0]) for x in seen[n:]] and len({id(x[0]) for x in seen}) == n
    nxt, n = kr._ring(make, 0)  # 0: one copy, every call the same operands (the hot probe)
    assert n == 1 and nxt() is nxt()
    assert kr.ROTATE_BYTES >= 8 * 2**20  # more than a server core's L2
    curve = kr.matmul_curve(1e15, reps=1, rotate_bytes=1 << 20)  # (no timing asserted: a fraction per size)
    assert [f for f, _ in curve] == [2.0 * n**3 for n in kr.MATMUL_SIZES] and all(0 < e <= 1 for _, e in curve)
    assert 0 < kr.attention_efficiency(1e12, reps=1, rotate_bytes=1 << 20) <= 1


def test_price_uses_the_kernel_rates_of_its_device():
    mesh = Mesh((1,), ("x",))

    def step_s(hw) -> float:
        torch.manual_seed(0)
        sch = treadle.create_schedule(Net(d=256, n=3), mesh=mesh)
        return price(sch, {"x": torch.randn(64, 256)}, ClusterSpec.uniform(mesh, "nvlink4", device=hw)).compute_s

    plain = dataclasses.replace(hardware_preset("h100-sxm"), **ZERO)
    # every product at 1% of the peak instead of 70%: memory-bound on an H100 at this size, compute-bound then
    assert step_s(dataclasses.replace(plain, matmul_curve=((1.0, 0.01),))) > 3 * step_s(plain)


# ------------------------------------------------------------------------------- NOTE [attention as a GPU runs it]
class _Attn(torch.nn.Module):
    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, d).pow(2).mean()


def test_attention_with_dropout_is_rehearsed_as_the_fused_kernel_on_a_gpu_and_as_pytorchs_cpu_path_on_a_cpu():
    import importlib

    price_mod = importlib.import_module("treadle.pricing")
    mesh = Mesh((1,), ("x",))
    x = {"x": torch.randn(2, 64, 32)}

    def ops_and_saved(cluster):
        torch.manual_seed(0)
        sch = treadle.create_schedule(_Attn(), mesh=mesh)
        reh = price_mod.rehearse(sch, x, cluster.rank_hardware(), None, gpu=not cluster.is_cpu())
        p = price(treadle.create_schedule(_Attn(), mesh=mesh), x, cluster)
        return {r.op.split(".")[1] for r in reh.records}, p.activation_bytes

    gpu_ops, gpu_saved = ops_and_saved(_cluster(mesh))
    cpu_ops, cpu_saved = ops_and_saved(ClusterSpec.uniform(mesh, "loopback", device=CPU_CORE))
    assert "_scaled_dot_product_flash_attention_for_cpu" in gpu_ops and "bernoulli_" not in gpu_ops
    assert "bernoulli_" in cpu_ops and "_scaled_dot_product_flash_attention_for_cpu" not in cpu_ops
    scores = 2 * 4 * 64 * 64 * 4  # one (batch, heads, q, k) fp32 tensor: the math path saves such tensors
    assert cpu_saved - gpu_saved >= scores


def test_capture_measures_attention_saved_bytes_as_the_planned_device_runs_it():
    from treadle.planner.capture import capture

    x = {"x": torch.randn(2, 64, 32)}
    torch.manual_seed(0)
    gpu = capture(_Attn(), (), x, gpu_attention=True)
    cpu = capture(_Attn(), (), x)
    assert gpu.saved is not None and cpu.saved is not None
    scores = 2 * 4 * 64 * 64 * 4
    assert sum(cpu.saved.values()) - sum(gpu.saved.values()) >= scores


@pytest.mark.parametrize("fused", [True, False])
def test_optimizer_moves_one_pass_fused_or_eight_passes(fused):
    """NOTE [AdamW traffic]: fused 3p + 4s bytes per element (28 B in fp32), else 6p + 14s (80 B), priced at the
    device's bandwidth."""
    from treadle.runtime.optimizer import adamw_bytes_per_elem

    assert adamw_bytes_per_elem(4, 8) == 80 and adamw_bytes_per_elem(4, 8, fused=True) == 28
    assert adamw_bytes_per_elem(2, 8) == 68 and adamw_bytes_per_elem(2, 8, fused=True) == 22  # bf16 p and g
    mesh = Mesh((2,), ("dp",))
    sch, x = _sch(mesh, dp="dp")
    # memory-bound by far: a slow memory, a fast ALU, no dispatch overhead
    hw = dataclasses.replace(hardware_preset("h100-sxm"), **ZERO, hbm_bytes_per_s=1e9, optimizer_fused=fused)
    cl = ClusterSpec.uniform(mesh, "nvlink4", device=hw)
    (seg,) = [s for s in price(sch, x, cl).segments if s["phase"] == "optim"]
    elems = sum(p.numel() for p in Net(d=16, n=3).parameters())
    per = 28 if fused else 80
    assert seg["compute_s"] == pytest.approx(elems * per / (1e9 * hw.memory_efficiency), rel=1e-3)


def test_fused_optimizer_dispatches_two_list_ops_and_one_per_tensor():
    n = sum(1 for _ in Net(d=16, n=3).parameters())
    assert adamw_ops(n, True, fused=True) == (2 + n, 2)
    mesh = Mesh((2,), ("dp",))

    def optim_s(**kw) -> float:
        sch, x = _sch(mesh, dp="dp", shard=kw.pop("shard", False))
        cl = _cluster(mesh, **kw)
        assert cl.device.optimizer_fused  # the presets say what the runtime runs
        (seg,) = [s for s in price(sch, x, cl).segments if s["phase"] == "optim"]
        return seg["compute_s"]

    assert optim_s(op_overhead_s=1e-5) - optim_s() == pytest.approx((2 + n) * 1e-5)
    assert optim_s(shard=True, subclass_op_overhead_s=1e-4) - optim_s(shard=True) == pytest.approx(2 * 1e-4)
