"""A compiled step in the price (NOTE [compiled step]): fusion runs, their external bytes against hand sums, and
the price of a LLaMA with its blocks compiled against the same step eager."""

from __future__ import annotations

import pytest
import torch

import treadle
from treadle.cost.cluster import parse_cluster
from treadle.errors import PlanError
from treadle.mesh import Mesh
from treadle.pricing import rehearse
from treadle.pricing.compiled import compiled_times, compiled_units, fusion_groups
from treadle.profile.hardware import hardware_preset
from treadle.profile.records import OpRecord
from treadle.profile.roofline import memory_time_s

transformers = pytest.importorskip("transformers")


def _rec(i, kind, module="layers.0", phase="forward", time_s=1e-6, saved=0):
    r = OpRecord(i, f"aten.op{i}", kind, module, phase, "bfloat16")
    r.time_s = time_s
    r.saved_bytes = saved
    return r


def test_fusion_runs_stop_at_extern_kernels_units_and_phases():
    kinds = [("pointwise", "layers.0", "forward"), ("reduction", "layers.0.norm", "forward"),
             ("matmul", "layers.0.q", "forward"), ("pointwise", "layers.0", "forward"),
             ("pointwise", "layers.0", "forward"), ("pointwise", "layers.1", "forward"),
             ("pointwise", "layers.1", "forward"), ("pointwise", "head", "forward"),
             ("pointwise", "head", "forward"), ("pointwise", "layers.1", "backward"),
             ("view", "layers.1", "backward"), ("attention", "layers.1", "backward")]
    recs = [_rec(i, k, m, p) for i, (k, m, p) in enumerate(kinds)]
    # the 2 ops before the matmul (across the block's sub-modules), 2 after it, the next block's 2, its backward's 2;
    # the head is not compiled
    assert fusion_groups(recs, ("layers.0", "layers.1")) == [(0, 2), (3, 5), (5, 7), (9, 11)]


def test_a_whole_tensor_reduction_ends_its_kernel():
    """float8's scale: abs, amax to a scalar, then the cast of the same tensor. The amax ends its run (its consumer
    waits for all of it), so the cast starts the next one and reads the tensor again; a row-wise reduction (a
    norm: it writes more than a scalar) fuses with what follows."""
    recs = [_rec(i, k) for i, k in enumerate(["pointwise", "reduction", "pointwise", "pointwise", "reduction",
                                              "pointwise", "matmul"])]
    for r in recs:
        r.read_bytes, r.write_bytes = 4096, 4096
    recs[1].write_bytes = 4  # amax: one float32
    assert fusion_groups(recs, ("layers.0",)) == [(0, 2), (2, 6)]
    recs[1].write_bytes = 64  # a reduction over rows
    assert fusion_groups(recs, ("layers.0",)) == [(0, 6)]


def test_a_fused_run_moves_only_what_it_takes_in_and_hands_out():
    """a = x * 2; b = a + 1 (b saved for backward); c = b.exp(); then a matmul reads c. The run reads x once and
    writes b (saved) and c (read later); a never leaves the kernel."""
    hw = hardware_preset("h100")
    X, A, B, C = (1, -1), (2, 0), (3, 1), (4, 2)
    n = 1 << 20
    recs = [_rec(0, "pointwise"), _rec(1, "pointwise", saved=n), _rec(2, "pointwise"),
            _rec(3, "matmul", module="layers.0.fc", time_s=5e-6)]
    flows = [(((X, n),), ((A, n),)), (((A, n),), ((B, n),)), (((B, n),), ((C, n),)), (((C, n),), (((5, 3), n),))]
    times = compiled_times(recs, flows, ("layers.0",), hw)
    assert times[0] == pytest.approx(memory_time_s(3 * n, hw) + hw.op_overhead_s)
    assert times[1:3] == [0.0, 0.0]
    assert times[3] == pytest.approx(5e-6 + hw.op_overhead_s)
    assert compiled_times(recs, flows, (), hw) == [r.time_s + hw.op_overhead_s for r in recs]  # nothing compiled
    # a run of views alone (a transpose and a reshape between two matmuls) moves nothing
    views = [_rec(0, "matmul", module="layers.0.q"), _rec(1, "view"), _rec(2, "view"),
             _rec(3, "matmul", module="layers.0.k")]
    vflows = [((), ((A, n),)), (((A, n),), ()), (((A, n),), ()), (((A, n),), (((5, 3), n),))]
    assert compiled_times(views, vflows, ("layers.0",), hw)[1:3] == [hw.op_overhead_s, 0.0]


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
                                   use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 512, (2, 256))
    return model, {"input_ids": ids, "labels": ids}


def test_compiled_price_fuses_the_blocks_and_leaves_the_rest_eager():
    model, inputs = _llama()
    cluster = parse_cluster("1:h100")
    assert compiled_units(model) == ("model.layers.0", "model.layers.1")
    sch = treadle.create_schedule(model, mesh=Mesh((1,), ("dp",)))
    eager = treadle.price(sch, inputs, cluster)
    compiled = treadle.price(sch, inputs, cluster, execution="compiled")
    assert (eager.execution, compiled.execution) == ("eager", "compiled")
    assert str(compiled).endswith(", compiled")
    assert compiled.step_s < eager.step_s
    assert compiled.peak_bytes == eager.peak_bytes  # memory as eager's (NOTE [compiled step])

    def by(p, inside):
        return sum(s["compute_s"] for s in p.segments if s["module"].startswith("model.layers.") == inside)

    assert by(compiled, False) == pytest.approx(by(eager, False))  # embedding, final norm, head, loss: eager
    assert by(compiled, True) < 0.97 * by(eager, True)
    # the extern kernels keep their time; a fused run's time is charged where it starts, the rest of it is 0
    hw = cluster.rank_hardware()
    reh = rehearse(sch, inputs, hw, None, gpu=True, flows=True)
    times = compiled_times(reh.records, reh.flows, compiled_units(reh.model), hw)
    for r, t in zip(reh.records, times):
        if r.kind in ("matmul", "attention"):
            assert t == r.time_s + hw.op_overhead_s
    assert sum(t == 0 for t in times) > len(times) // 4


def test_execution_is_checked_and_a_pipeline_runs_eager():
    model, inputs = _llama()
    cluster = parse_cluster("1:h100")
    sch = treadle.create_schedule(model, mesh=Mesh((1,), ("dp",)))
    with pytest.raises(PlanError, match=r"execution must be one of \['eager', 'compiled'\], got 'jit'"):
        treadle.price(sch, inputs, cluster, execution="jit")
    pp = treadle.create_schedule(_llama()[0], mesh=Mesh((2,), ("pp",)))
    pp["model.layers.0"].cut_pipeline_stage()
    pp.pipeline(axis="pp", schedule="1f1b", n_microbatches=2, example_inputs=inputs)
    with pytest.raises(PlanError, match="a pipeline schedule runs eager"):
        treadle.price(pp, inputs, parse_cluster("1x2:h100"), execution="compiled")


def test_run_compiles_the_blocks_the_price_fuses():
    """One fact: `treadle.run --compile` compiles exactly `compiled_units` (outer stacks' blocks, not a stack
    nested inside a block)."""
    from torch import nn

    from treadle.run.loop import _compile_blocks

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block()])
    model.head = nn.Linear(4, 4)
    assert compiled_units(model) == ("layers.0", "layers.1")
    assert _compile_blocks(model, torch.device("cpu")) == 2
    compiled = {p for p, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None}
    assert compiled == {"layers.0", "layers.1"}
