"""A plain-PyTorch decoder written as torchtitan writes its Llama: the blocks in an `nn.ModuleDict` keyed "0",
"1", ..., the model arguments a slotted dataclass on `model.config`. It profiles with block reuse, plans with its
blocks captured once each (no raw `vars()` TypeError), and the planner's data-parallel plan verifies on gloo."""

from __future__ import annotations

import pytest
import torch

from treadle import Mesh
from treadle.cost.cluster import ClusterSpec
from treadle.planner import plan_model
from treadle.profile import profile
from arch_suite import TitanArgs, TitanLlama  # torchtitan's code shape


def _model_and_inputs(batch: int = 4, seq: int = 8):
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(1))
    return TitanLlama(TitanArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64)), {
        "input_ids": ids, "labels": ids.clone()}


def test_a_moduledict_of_blocks_profiles_with_block_reuse():
    model, inputs = _model_and_inputs()
    fast = profile(model, inputs, hardware="a100-80gb")
    full = profile(model, inputs, hardware="a100-80gb", reuse_blocks=False)
    assert fast.reused_blocks and not full.reused_blocks
    assert (fast.forward_flops, fast.backward_flops, fast.saved_bytes) == \
        (full.forward_flops, full.backward_flops, full.saved_bytes)


def test_the_capture_shortens_a_moduledict_of_blocks_and_restores_it():
    from treadle.planner.capture import capture

    model, inputs = _model_and_inputs()
    graph = capture(model, (), inputs)
    assert sorted((b.path, b.weight) for b in graph.blocks) == [("layers.0", 1), ("layers.1", 3)]
    assert list(model.layers.keys()) == ["0", "1", "2", "3"]  # restored


@pytest.mark.slow
def test_a_moduledict_of_blocks_plans_and_its_plan_verifies():
    from treadle.verify import verify

    model, inputs = _model_and_inputs()
    cluster = ClusterSpec.uniform(Mesh((2,), ("dp",)), "loopback")
    plan = plan_model(model, inputs, cluster=cluster, dp_axis="dp", checkpoint="none")
    assert "data_parallel" in plan.schedule.to_json()
    report = verify(plan.schedule, inputs, timeout_s=240)
    assert report.ok, report
