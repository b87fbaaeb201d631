"""Slapo parity, ready-made schedules by structure: `treadle.models.megatron` finds the column/row layout of
blocks it has no named recipe for as a constrained plan (the planner's data-flow analysis: separate or fused
q/k/v, rotary or learned positions, parallel or sequential residual, plain or gated MLP), verified on tiny
Hugging Face models at world 2 against the single-process model (outputs, every gradient, an optimizer step); a
clear error names the weight that cannot be split."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import treadle
from treadle import Mesh, ScheduleError, create_schedule

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TP2 = Mesh((2,), ("tp",))
COMMON = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=256, max_position_embeddings=64)


def gpt_neo():  # learned positions, sequential residual, attention nested one level deeper
    import transformers as T

    torch.manual_seed(0)
    return T.GPTNeoForCausalLM(T.GPTNeoConfig(num_layers=2, hidden_size=64, num_heads=4,
                                              attention_types=[[["global", "local"], 1]], vocab_size=256,
                                              max_position_embeddings=64, resid_dropout=0.0, embed_dropout=0.0,
                                              attention_dropout=0.0))


def phi():  # partial rotary, parallel residual, q/k/v with bias
    import transformers as T

    torch.manual_seed(0)
    return T.PhiForCausalLM(T.PhiConfig(num_hidden_layers=2, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                                        **COMMON))


def roberta():  # BERT-like encoder, post-norm, learned positions with a padding offset
    import transformers as T

    torch.manual_seed(0)
    return T.RobertaForMaskedLM(T.RobertaConfig(num_hidden_layers=2, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0, pad_token_id=1,
                                                **{**COMMON, "max_position_embeddings": 64 + 2}))


def _inputs():
    ids = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids, "use_cache": False}


# GPT-NeoX, GPT-J, Qwen2, Gemma and Mistral run the same check in the generality suite (tests/arch_suite.py)
@pytest.mark.parametrize("make", [gpt_neo, pytest.param(phi, marks=pytest.mark.slow),
                                  pytest.param(roberta, marks=pytest.mark.slow)])
def test_megatron_by_structure_verifies(make):
    model = make()
    sch = create_schedule(model, mesh=TP2)
    treadle.models.megatron(sch, tp="tp", vocab_parallel_head=False)
    rows = [r.path for r in sch.records if r.op == "sync"]
    assert rows and all(r.args.get("to") is not None for r in sch.records if r.op == "sync")
    vocab = {p for p, m in model.named_modules() if m in (model.get_input_embeddings(), model.get_output_embeddings())}
    assert len(vocab) == 2 and not [r for r in sch.records if r.op == "shard" and r.path in vocab]  # kept whole
    inputs = _inputs()
    if make is roberta:  # an encoder: no KV cache argument
        inputs.pop("use_cache")
    treadle.verify(sch, inputs, steps=1)


class Odd(nn.Module):
    """Three Linear leaves in a chain: no attention, no MLP pair."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


class Stack(nn.Module):
    def __init__(self, *blocks: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_megatron_splits_any_chain_of_linears_by_data_flow_and_it_verifies():
    """No named recipe knows the block: the constrained plan splits every weight over tp (each block's dims
    by data flow) and adds the reductions the layouts need."""
    sch = create_schedule(Stack(Odd(), Odd()), mesh=TP2)
    treadle.models.megatron(sch, tp="tp", example_inputs={"x": torch.randn(2, 8)})
    shards = {r.path for r in sch.records if r.op == "shard"}
    assert shards == {f"layers.{i}.{m}" for i in (0, 1) for m in "abc"}
    assert treadle.verify(sch, {"x": torch.randn(4, 8)}, steps=1).ok


def test_megatron_names_the_weight_that_cannot_be_split():
    sch = create_schedule(Stack(nn.Linear(3, 3), nn.Linear(3, 3)), mesh=TP2)
    with pytest.raises(ScheduleError, match=r"megatron on Stack: the recipe's layout cannot be built: pin "
                                            r"'layers\.\*\.weight' \(axis 'tp': Shard\(any dim\)\) cannot hold: .*"
                                            r"shape \(3, 3\), no dim of which divides over axis 'tp' of size 2"):
        treadle.models.megatron(sch, tp="tp", example_inputs={"x": torch.randn(2, 3)})
    assert not sch.records  # nothing half-applied


@pytest.mark.slow
def test_megatron_as_a_plan_on_t5_with_zero3_a_split_vocabulary_and_checkpoints_verifies_on_4_ranks():
    """An encoder-decoder no named recipe knows, every option of the recipe at once: both stacks split over tp,
    the shared embedding and head (one tied weight, stated at lm_head) over the vocabulary, ZeRO-3 over dp (T5's blocks hold lists of layers: FSDP2
    wraps the blocks only, NOTE [FSDP2 units]), half the decoder blocks checkpointed."""
    from arch_suite import build

    model, inputs = build("t5")
    sch = create_schedule(model, mesh=Mesh((2, 2), ("dp", "tp")))
    treadle.models.megatron(sch, tp="tp", dp="dp", zero3=True, vocab_parallel_head=True, checkpoint_fraction=0.5,
                            example_inputs=inputs)
    shards = {r.path for r in sch.records if r.op == "shard"}
    assert {"lm_head", "encoder.block.1.layer.1.DenseReluDense.wi", "decoder.block.0.layer.1.EncDecAttention.o"} <= shards
    assert [r.path for r in sch.records if r.op == "checkpoint"] == ["decoder.block.0"]
    assert [r.args.get("shard") for r in sch.records if r.op == "data_parallel"] == [True]
    assert treadle.verify(sch, inputs, steps=1, timeout_s=300).ok
