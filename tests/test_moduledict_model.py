"""A plain-PyTorch decoder written as torchtitan writes its Llama: the blocks in an `nn.ModuleDict` keyed "0",
"1", ..., the model arguments a slotted dataclass on `model.config`. It profiles with block reuse, plans with its
blocks captured once each (no raw `vars()` TypeError), and the planner's data-parallel plan verifies on gloo."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from treadle import Mesh
from treadle.cost.cluster import ClusterSpec
from treadle.planner import plan_model
from treadle.profile import profile


@dataclass(slots=True)
class Args:
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 64


class Block(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.heads = a.n_heads
        self.attention_norm = nn.RMSNorm(a.dim)
        self.wqkv = nn.Linear(a.dim, 3 * a.dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)
        self.ffn_norm = nn.RMSNorm(a.dim)
        self.w1 = nn.Linear(a.dim, 2 * a.dim, bias=False)
        self.w2 = nn.Linear(2 * a.dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, d))
        return x + self.w2(F.silu(self.w1(self.ffn_norm(x))))


class TitanStyle(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.config = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleDict({str(i): Block(a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def _model_and_inputs(batch: int = 4, seq: int = 8):
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(1))
    return TitanStyle(Args()), {"tokens": ids, "labels": ids.clone()}


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
