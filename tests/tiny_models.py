"""Tiny Hugging Face models with random weights (no downloads), shared by the tests.

All: hidden 64, 4 heads, vocab 256, dropout 0 unless asked, fp32. Built with a fixed seed so two calls
return identical weights.
"""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

VOCAB = 256


def tiny_gpt2(n_layer: int = 2, *, dropout: float = 0.0, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0,
                     eos_token_id=0, loss_type="ForCausalLM")
    return GPT2LMHeadModel(cfg)


def tiny_llama(n_layer: int = 2, *, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=n_layer, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0, loss_type="ForCausalLM")
    return LlamaForCausalLM(cfg)


def tiny_bert(n_layer: int = 2, *, seed: int = 0):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(num_hidden_layers=n_layer, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                     vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0, loss_type="ForMaskedLM")
    return BertForMaskedLM(cfg)


MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "bert": tiny_bert}


def lm_inputs(batch: int = 4, seq: int = 16, *, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
