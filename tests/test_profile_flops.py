"""FLOP formulas, hardware specs and the roofline, against FlopCounterMode and hand arithmetic."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from treadle.errors import ProfileError
from treadle.profile import flops as F
from treadle.profile.hardware import HARDWARE_PRESETS, HardwareSpec, cpu_spec, hardware_preset
from treadle.profile.roofline import mfu, op_time_s

aten = torch.ops.aten


def _counted(fn, *args):
    with FlopCounterMode(display=False) as fc:
        out = fn(*args)
    return fc.get_total_flops(), out


@pytest.mark.parametrize("op, shapes", [
    (aten.mm.default, [(5, 7), (7, 3)]),
    (aten.addmm.default, [(3,), (5, 7), (7, 3)]),
    (aten.bmm.default, [(2, 5, 7), (2, 7, 3)]),
    (aten.baddbmm.default, [(2, 5, 3), (2, 5, 7), (2, 7, 3)]),
])
def test_matmul_forward_and_backward_match_flop_counter(op, shapes):
    args = [torch.randn(*s, requires_grad=True) for s in shapes]
    fwd, out = _counted(op, *args)
    assert F.forward_flops(op, args, {}, out) == fwd
    with FlopCounterMode(display=False) as fc:
        out.sum().backward()
    assert F.backward_flops(op, args, {}, out) == fc.get_total_flops()


def test_backward_counts_only_inputs_needing_grad():
    x, w = torch.randn(6, 4), torch.randn(4, 5, requires_grad=True)
    out = x @ w
    with FlopCounterMode(display=False) as fc:
        out.sum().backward()
    flags = [x.requires_grad, w.requires_grad]
    assert F.backward_flops(aten.mm.default, (x, w), {}, out, needs_input_grad=flags) == fc.get_total_flops() \
        == 2 * 6 * 4 * 5
    # without flags every floating input needs a gradient (graph metadata does not say)
    assert F.backward_flops(aten.mm.default, (x, w), {}, out) == 2 * 2 * 6 * 4 * 5
    assert F.backward_flops(aten.embedding.default, (w, torch.zeros(3, dtype=torch.long)), {}, None) == 0


def test_linear_and_matmul_composites_match_their_decomposition():
    x, w, b = torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(5)
    fwd, out = _counted(torch.nn.functional.linear, x, w, b)
    assert F.forward_flops(aten.linear.default, (x, w, b), {}, out) == fwd == 2 * 6 * 8 * 5
    a, c = torch.randn(4, 1, 3, 8), torch.randn(2, 8, 5)
    fwd, out = _counted(torch.matmul, a, c)
    assert F.forward_flops(aten.matmul.default, (a, c), {}, out) == fwd == 2 * 8 * 3 * 8 * 5


def test_attention_counts_math_on_every_kernel():
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k = torch.randn(2, 2, 16, 8, requires_grad=True)  # grouped-query: 2 kv heads for 4 query heads
    v = torch.randn(2, 2, 16, 8, requires_grad=True)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)

    def eager(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, dim=-1) @ v

    eager_fwd, out = _counted(eager, q, kk, vv)
    with FlopCounterMode(display=False) as fc:
        out.sum().backward()
    eager_bwd = fc.get_total_flops()
    for op in (aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert F.forward_flops(op, (q, k, v), {}, None) == eager_fwd
        assert F.backward_flops(op, (q, k, v), {}, None) == eager_bwd
    g = torch.randn(2, 4, 16, 8)
    assert F.forward_flops(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                           (g, q, k, v, g, None, 0.0, False), {}, None) == eager_bwd
    # the bshd-layout kernels count the same
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    assert F.forward_flops(aten._flash_attention_forward.default, (qt, kt, vt), {}, None) == eager_fwd


def test_zero_cost_ops_have_a_kind_and_unknown_ops_raise():
    assert F.op_kind(aten.view.default) == "view"
    assert F.op_kind(aten.add.Tensor) == "pointwise"
    assert F.op_kind(aten.sum.dim_IntList) == "reduction"
    assert F.op_kind(aten._softmax.default) == "reduction"
    assert F.forward_flops(aten.gelu.default, (torch.randn(3),), {}, None) == 0
    with pytest.raises(ProfileError, match=r"no FLOP rule for op aten\.linalg_svd\.default"):
        F.forward_flops(aten.linalg_svd.default, (torch.randn(3, 3),), {}, None)
    with pytest.raises(ProfileError, match="double backward"):
        F.backward_flops(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                         (torch.randn(1, 1, 2, 2),) * 4, {}, None)


def test_duplicate_registration_is_rejected():
    with pytest.raises(ProfileError, match="aten.mm registered twice"):
        F.register_zero(aten.mm, kind="memory")
    with pytest.raises(ProfileError, match="unknown op kind 'fancy'"):
        F.register_flops(aten.mm, kind="fancy")


def test_presets_json_round_trip_and_validation(tmp_path):
    for name, spec in HARDWARE_PRESETS.items():
        assert hardware_preset(name) is spec
        assert HardwareSpec.from_json(spec.to_json()) == spec
    h100 = hardware_preset("H100-SXM")
    assert h100.peak_for(torch.bfloat16) == 989.4e12 and h100.hbm_bytes_per_s == 3.35e12
    assert str(h100).startswith("h100-sxm(") and "HardwareSpec(name='h100-sxm'" in repr(h100)
    path = tmp_path / "mine.json"
    mine = HardwareSpec(name="mine", peak_flops_per_s={"float32": 1e12}, hbm_bytes_per_s=1e11, memory_bytes=2**30)
    mine.save(path)
    assert hardware_preset(str(path)) == mine
    with pytest.raises(ProfileError, match="unknown hardware 'tpu-v9'.*h100-sxm"):
        hardware_preset("tpu-v9")
    with pytest.raises(ProfileError, match="no peak FLOP/s for dtype 'bfloat16'; known:"):
        hardware_preset("v100-32gb").peak_for(torch.bfloat16)
    with pytest.raises(ProfileError, match="compute_efficiency must be in"):
        HardwareSpec(name="x", peak_flops_per_s={"float32": 1.0}, hbm_bytes_per_s=1.0, memory_bytes=1,
                     compute_efficiency=1.5)
    with pytest.raises(ProfileError, match="unknown fields"):
        HardwareSpec.from_dict({**mine.to_dict(), "clock_hz": 1})


def test_cpu_spec_is_a_fixed_core_with_no_cache_and_no_thread_dependence(tmp_path, monkeypatch):
    # NOTE [no hidden state]: nothing is written to disk and the caller's thread count changes nothing
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_spec()
        torch.set_num_threads(2)
        assert cpu_spec() == one == hardware_preset("cpu")
    finally:
        torch.set_num_threads(before)
    assert one.name == "cpu" and one.peak_for("float32") == 80e9 and one.hbm_bytes_per_s == 10e9
    assert list(tmp_path.iterdir()) == []


def test_calibrate_cpu_is_explicit_and_per_core(tmp_path):
    from treadle.profile.hardware import calibrate_cpu

    before = torch.get_num_threads()
    spec = calibrate_cpu(matmul_n=128, copy_bytes=2**20, reps=2)
    assert torch.get_num_threads() == before and "1 thread(s)" in spec.source
    assert spec.peak_for("float32") > 1e6 and spec.hbm_bytes_per_s > 1e6
    spec.save(tmp_path / "cpu.json")
    assert hardware_preset(str(tmp_path / "cpu.json")) == spec


def test_roofline_is_max_of_compute_and_memory():
    hw = HardwareSpec(name="t", peak_flops_per_s={"float32": 100.0}, hbm_bytes_per_s=10.0, memory_bytes=1,
                      compute_efficiency=0.5, memory_efficiency=0.5)
    assert op_time_s(1000, 10, hw, torch.float32) == pytest.approx(20.0)  # compute: 1000 / 50
    assert op_time_s(10, 1000, hw, torch.float32) == pytest.approx(200.0)  # memory: 1000 / 5
    assert op_time_s(0, 50, hw, torch.bfloat16) == pytest.approx(10.0)  # no FLOPs: dtype not consulted
    assert mfu(1000, 20.0, hw, "float32") == pytest.approx(0.5)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-t5"])
def test_formulas_on_an_exported_graph_match_flop_counter(name):
    """The planner prices exported graphs node by node: every node has a rule, and forward totals agree."""
    from treadle.models.zoo import named_model

    model, inputs = named_model(name, batch=2, seq=16, attn="sdpa", dropout=False)
    ep = torch.export.export(model, (), inputs, strict=False)
    meta = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a  # noqa: E731
    fwd = bwd = 0
    for node in ep.graph.nodes:
        if node.op == "call_function":
            args = torch.utils._pytree.tree_map(meta, node.args)
            kwargs = torch.utils._pytree.tree_map(meta, node.kwargs)
            fwd += F.forward_flops(node.target, args, kwargs, node.meta.get("val"))
            bwd += F.backward_flops(node.target, args, kwargs, node.meta.get("val"))
    eager, _ = named_model(name, batch=2, seq=16, attn="eager", dropout=False)
    with FlopCounterMode(display=False) as fc_fwd:
        loss = eager(**inputs).loss
    with FlopCounterMode(display=False) as fc_bwd:
        loss.backward()
    assert fwd == fc_fwd.get_total_flops()
    assert bwd == fc_bwd.get_total_flops()


def test_calibrate_cpu_takes_the_median_of_repeated_overhead_measurements(monkeypatch):
    """NOTE [calibration repeats]: disturbed measurements of the per-op or checkpoint overheads (a busy sibling
    vCPU) do not become the device's figure, and the two probes are interleaved."""
    from treadle.profile import overheads as ov
    from treadle.profile.hardware import _OVERHEAD_REPEATS, calibrate_cpu

    assert _OVERHEAD_REPEATS == 11
    calls = []
    ops = iter([8e-6, 30e-6, 9e-6, 10e-6, 7e-6, 9e-6, 8e-6, 40e-6, 9e-6, 10e-6, 9e-6])  # two outliers
    fits = iter([(3e-4, 25e-6), (3e-4, 62e-6), (9e-4, 24e-6), (3.1e-4, 26e-6), (2.9e-4, 23e-6), (3e-4, 25e-6),
                 (3.2e-4, 27e-6), (2.8e-4, 90e-6), (3e-4, 24e-6), (3.1e-4, 25e-6), (3e-4, 26e-6)])
    monkeypatch.setattr(ov, "op_overhead_s", lambda reps: (calls.append("op"), next(ops))[1])
    monkeypatch.setattr(ov, "checkpoint_overheads_s", lambda reps: (calls.append("ckpt"), next(fits))[1])
    monkeypatch.setattr(ov, "distributed_overheads_s", lambda reps: None)
    spec = calibrate_cpu(matmul_n=64, copy_bytes=2**16, reps=1, kernels=False)
    assert calls == ["op", "ckpt"] * 11
    assert spec.op_overhead_s == pytest.approx(9e-6)
    assert spec.checkpoint_region_s == pytest.approx(3e-4) and spec.checkpoint_op_s == pytest.approx(25e-6)
