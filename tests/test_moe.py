"""Mixture-of-experts models (Hugging Face Mixtral): the experts' grouped product `aten._grouped_mm` has a FLOP
rule, its fake (meta) kernel's bfloat16-only check is bridged for the CPU's float32 (`treadle.profile.fake_gaps`),
and the routing ops (`floor_divide`, `histc`, ...) are priced; a planned schedule prices and verifies."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import treadle
from treadle.cost.cluster import parse_cluster
from treadle.profile import fake_gaps
from treadle.profile.flops import backward_flops, forward_flops, op_kind

from tiny_models import VOCAB, lm_inputs

aten = torch.ops.aten


def tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                                            max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
                                            bos_token_id=0, eos_token_id=0, pad_token_id=0))


def test_grouped_mm_flops_are_one_product_over_all_rows():
    a, w = torch.randn(10, 8), torch.randn(4, 8, 6)  # 10 routed rows, 4 experts of (8 -> 6)
    offs = torch.tensor([3, 5, 9, 10], dtype=torch.int32)
    out = torch.empty(10, 6)
    assert op_kind(aten._grouped_mm.default) == "matmul"
    assert forward_flops(aten._grouped_mm.default, (a, w), {"offs": offs}, out) == 2 * 10 * 8 * 6
    assert backward_flops(aten._grouped_mm.default, (a, w), {"offs": offs}, out,
                          needs_input_grad=[True, True]) == 2 * (2 * 10 * 8 * 6)
    a3, w3 = torch.randn(4, 5, 8), torch.randn(4, 8, 6)  # batched: (G, M, K) x (G, K, N)
    assert forward_flops(aten._grouped_mm.default, (a3, w3), {}, torch.empty(4, 5, 6)) == 2 * 4 * 5 * 8 * 6
    a2, b2 = torch.randn(5, 12), torch.randn(12, 6)  # weight gradient: K split by offsets
    assert forward_flops(aten._grouped_mm.default, (a2, b2), {}, torch.empty(3, 5, 6)) == 2 * 5 * 12 * 6


def test_fake_grouped_mm_takes_float32_like_the_cpu_kernel():
    offs = torch.tensor([3, 5, 9, 10], dtype=torch.int32)
    real = torch._grouped_mm(torch.randn(10, 8), torch.randn(4, 8, 8), offs=offs)  # the CPU kernel takes fp32
    with FakeTensorMode() as mode:
        a, w = torch.randn(10, 8), torch.randn(4, 8, 8)
        o = mode.from_tensor(offs)
        with pytest.raises(RuntimeError, match="BF16"):  # PyTorch's meta kernel alone
            torch._grouped_mm(a, w, offs=o)
        out = fake_gaps.call(aten._grouped_mm.default, (a, w), {"offs": o})
        assert out.shape == real.shape and out.dtype == torch.float32
        bf = fake_gaps.call(aten._grouped_mm.default, (a.bfloat16(), w.bfloat16()), {"offs": o})
        assert bf.dtype == torch.bfloat16  # untouched where the meta kernel works


@pytest.mark.slow
def test_mixtral_plans_prices_and_verifies_on_4_ranks():
    from treadle.planner import plan_model

    inputs = lm_inputs(8, 16)
    cl = parse_cluster("2x2:cpu")
    free = treadle.price(treadle.create_schedule(tiny_mixtral(), mesh=cl.mesh), inputs, cl)
    assert free.model_flops > 0 and free.step_s > 0
    budget = 0.7 * free.peak_bytes
    plan = plan_model(tiny_mixtral(), inputs, cluster=cl, memory_budget_bytes=budget)
    assert plan.price is not None and plan.estimate().peak_bytes <= budget  # fits as built (priced by default)
    report = treadle.verify(plan.schedule, inputs, steps=2, timeout_s=300)
    assert report.ok


def test_transformers_fallback_grouped_product_has_the_flops_of_one_product():
    # transformers' own grouped product where aten._grouped_mm cannot run (fp32 weights on CPU), registered by name
    from transformers.integrations import moe  # noqa: F401  (registers the custom op)

    op = torch.ops.transformers.grouped_mm_fallback.default
    bwd = torch.ops.transformers.grouped_mm_fallback_backward.default
    a, w, offs = torch.randn(10, 8), torch.randn(4, 8, 6), torch.tensor([3, 5, 9, 10])
    out = op(a, w, offs)
    assert op_kind(op) == "matmul" and forward_flops(op, (a, w, offs), {}, out) == 2 * 10 * 8 * 6
    assert backward_flops(op, (a, w, offs), {}, out, needs_input_grad=[True, True, False]) == 2 * (2 * 10 * 8 * 6)
    assert forward_flops(bwd, (a, w, offs, torch.randn(10, 6)), {}, None) == 2 * (2 * 10 * 8 * 6)
