"""Slapo parity, ready-made schedules by structure: `treadle.models.megatron` finds the column/row layout of
blocks it has no recipe for by data flow (separate or fused q/k/v, rotary or learned positions, parallel or
sequential residual, plain or gated MLP), verified on tiny Hugging Face models at world 2 against the
single-process model (outputs, every gradient, an optimizer step); a clear error names what it could not
recognise."""

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


def gpt_neox():  # fused per-head q|k|v, rotary, parallel residual
    import transformers as T

    torch.manual_seed(0)
    return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(num_hidden_layers=2, hidden_dropout=0.0, attention_dropout=0.0,
                                                **COMMON))


def gpt_j():  # separate q/k/v without bias, rotary, parallel residual, num_attention_heads attribute
    import transformers as T

    torch.manual_seed(0)
    return T.GPTJForCausalLM(T.GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, vocab_size=256,
                                          n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


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


def qwen2():  # grouped q/k/v with bias, gated MLP (LLaMA-like names: the named recipe)
    import transformers as T

    torch.manual_seed(0)
    return T.Qwen2ForCausalLM(T.Qwen2Config(num_hidden_layers=2, num_key_value_heads=2, **COMMON))


def gemma():  # separate head_dim, gelu-gated MLP, tied head
    import transformers as T

    torch.manual_seed(0)
    return T.GemmaForCausalLM(T.GemmaConfig(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, **COMMON))


def mistral():  # grouped q/k/v without bias, sliding-window attention config, gated MLP
    import transformers as T

    torch.manual_seed(0)
    return T.MistralForCausalLM(T.MistralConfig(num_hidden_layers=2, num_key_value_heads=2, sliding_window=16,
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


@pytest.mark.parametrize("make", [gpt_neox, gpt_j, pytest.param(gpt_neo, marks=pytest.mark.slow),
                                  pytest.param(phi, marks=pytest.mark.slow),
                                  pytest.param(qwen2, marks=pytest.mark.slow),
                                  pytest.param(gemma, marks=pytest.mark.slow),
                                  pytest.param(mistral, marks=pytest.mark.slow),
                                  pytest.param(roberta, marks=pytest.mark.slow)])
def test_megatron_by_structure_verifies(make):
    sch = create_schedule(make(), mesh=TP2)
    # Gemma scales its embedding inside a subclass of nn.Embedding: keep the vocabulary whole
    treadle.models.megatron(sch, tp="tp", **({"vocab_parallel_head": False} if make is gemma else {}))
    rows = [r.path for r in sch.records if r.op == "sync"]
    assert rows and all(r.args.get("to") is not None for r in sch.records if r.op == "sync")
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
