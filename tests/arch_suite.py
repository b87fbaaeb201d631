"""The generality suite's architectures: tiny random configs (no downloads) of Hugging Face decoders, encoders,
encoder-decoders and a vision transformer, two plain-PyTorch language-model codes and two CNNs, each with example
inputs that make the model return its training loss.

Every decoder: hidden 64, 4 query heads, 2 blocks, vocab 256, dropout 0, fp32, built with a fixed seed (two calls
return identical weights). `ARCHS` maps a short name to (builder, what it exercises).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

VOCAB = 256
_COMMON = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _lm(batch: int = 4, seq: int = 16, *, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _hf(config_cls: str, model_cls: str, **cfg: Any) -> Callable[[], tuple[nn.Module, dict]]:
    def build() -> tuple[nn.Module, dict]:
        import transformers

        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**cfg)
        return getattr(transformers, model_cls)(config), _lm()

    return build


def _decoder(config_cls: str, model_cls: str, **extra: Any) -> Callable[[], tuple[nn.Module, dict]]:
    cfg = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, **_COMMON)
    cfg.update(extra)
    return _hf(config_cls, model_cls, **cfg)


def _t5() -> tuple[nn.Module, dict]:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2,
                                                num_heads=4, d_kv=16, vocab_size=VOCAB, dropout_rate=0.0,
                                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    g = torch.Generator().manual_seed(1)
    return model, {"input_ids": torch.randint(2, VOCAB, (4, 16), generator=g),
                   "labels": torch.randint(2, VOCAB, (4, 8), generator=g)}


def _vit() -> tuple[nn.Module, dict]:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                intermediate_size=128, image_size=32, patch_size=8, num_labels=10,
                                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    g = torch.Generator().manual_seed(1)
    return model, {"pixel_values": torch.randn(4, 3, 32, 32, generator=g),
                   "labels": torch.randint(0, 10, (4,), generator=g)}


def _whisper() -> tuple[nn.Module, dict]:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(WhisperConfig(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=16,
        max_target_positions=32, vocab_size=VOCAB, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, begin_suppress_tokens=None,
        suppress_tokens=None))
    g = torch.Generator().manual_seed(1)
    return model, {"input_features": torch.randn(4, 16, 32, generator=g),
                   "labels": torch.randint(3, VOCAB, (4, 8), generator=g)}


# ----------------------------------------------------------------------------- plain PyTorch codes
@dataclass(slots=True)
class TitanArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = VOCAB


class TitanBlock(nn.Module):
    """torchtitan's Llama block shape: separate wq / wk / wv (grouped key/value heads), wo; a SwiGLU w1 / w3 / w2."""

    def __init__(self, a: TitanArgs):
        super().__init__()
        self.heads, self.kv, self.hd = a.n_heads, a.n_kv_heads, a.dim // a.n_heads
        self.attention_norm = nn.RMSNorm(a.dim)
        self.wq = nn.Linear(a.dim, a.dim, bias=False)
        self.wk = nn.Linear(a.dim, self.kv * self.hd, bias=False)
        self.wv = nn.Linear(a.dim, self.kv * self.hd, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)
        self.ffn_norm = nn.RMSNorm(a.dim)
        self.w1 = nn.Linear(a.dim, 2 * a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, 2 * a.dim, bias=False)
        self.w2 = nn.Linear(2 * a.dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.wk(h).view(b, s, self.kv, self.hd).transpose(1, 2)
        v = self.wv(h).view(b, s, self.kv, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TitanLlama(nn.Module):
    """torchtitan's model code shape: blocks in an nn.ModuleDict keyed "0", "1", ...; arguments a dataclass."""

    def __init__(self, a: TitanArgs):
        super().__init__()
        self.config = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleDict({str(i): TitanBlock(a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(input_ids)
        for layer in self.layers.values():
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class NanoBlock(nn.Module):
    """nanoGPT's block: fused c_attn (q|k|v), c_proj; a GELU MLP; pre-LayerNorm with bias."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, s, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's model code shape: `transformer` a ModuleDict (wte, wpe, h, ln_f), a weight-tied lm_head, no
    Hugging Face methods (no get_input_embeddings, no config class)."""

    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2, block: int = 32):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, dim), wpe=nn.Embedding(block, dim),
            h=nn.ModuleList([NanoBlock(dim, heads) for _ in range(layers)]), ln_f=nn.LayerNorm(dim)))
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(pos)
        for blk in self.transformer.h:
            x = blk(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _titan() -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    return TitanLlama(TitanArgs()), _lm()


def _nanogpt() -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    return NanoGPT(), _lm()


def _resnet() -> tuple[nn.Module, dict]:
    from treadle.models.cnn import resnet

    return resnet((1, 1), width=1, batch=4, image=32, num_classes=10, base=8)


def _wide_resnet() -> tuple[nn.Module, dict]:
    from treadle.models.cnn import tiny_wide_resnet

    return tiny_wide_resnet(batch=4, image=32)


ARCHS: dict[str, tuple[Callable[[], tuple[nn.Module, dict]], str]] = {
    "gpt2": (_hf("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                 n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
             "fused q|k|v Conv1D, learned positions, tied head"),
    "llama": (_decoder("LlamaConfig", "LlamaForCausalLM"), "GQA, RMSNorm, rotary, SwiGLU"),
    "qwen2": (_decoder("Qwen2Config", "Qwen2ForCausalLM"), "q/k/v biases"),
    "qwen3": (_decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=16), "q/k RMSNorm per head"),
    "olmo2": (_decoder("Olmo2Config", "Olmo2ForCausalLM"), "q/k RMSNorm over the whole projection, post-norm"),
    "phi3": (_decoder("Phi3Config", "Phi3ForCausalLM"), "fused qkv_proj of unequal pieces, fused gate_up"),
    "mistral": (_decoder("MistralConfig", "MistralForCausalLM", sliding_window=8), "sliding-window attention"),
    "gemma": (_decoder("GemmaConfig", "GemmaForCausalLM", head_dim=16), "scaled embedding, GeGLU"),
    "stablelm": (_decoder("StableLmConfig", "StableLmForCausalLM", partial_rotary_factor=0.5,
                          qk_layernorm=True), "partial rotary, per-head q/k LayerNorm"),
    "cohere": (_decoder("CohereConfig", "CohereForCausalLM", use_qk_norm=False, logit_scale=1.0),
               "parallel attention + MLP, LayerNorm without bias"),
    "falcon": (_hf("FalconConfig", "FalconForCausalLM", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                   vocab_size=VOCAB, multi_query=True, parallel_attn=True, new_decoder_architecture=False,
                   hidden_dropout=0.0, attention_dropout=0.0, **_COMMON),
               "multi-query attention (fused q|k|v of unequal pieces), parallel attention"),
    "gpt_neox": (_hf("GPTNeoXConfig", "GPTNeoXForCausalLM", num_hidden_layers=2, hidden_size=64,
                     num_attention_heads=4, intermediate_size=128, vocab_size=VOCAB, rotary_pct=0.25,
                     use_parallel_residual=True, hidden_dropout=0.0, attention_dropout=0.0, **_COMMON),
                 "q|k|v interleaved per head, partial rotary, parallel residual"),
    "gpt_bigcode": (_hf("GPTBigCodeConfig", "GPTBigCodeForCausalLM", n_layer=2, n_embd=64, n_head=4,
                        vocab_size=VOCAB, n_positions=64, multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, **_COMMON), "multi-query attention in one Linear"),
    "gptj": (_hf("GPTJConfig", "GPTJForCausalLM", n_layer=2, n_embd=64, n_head=4, rotary_dim=8, vocab_size=VOCAB,
                 n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_COMMON),
             "parallel attention + MLP, rotary on part of each head"),
    "bloom": (_hf("BloomConfig", "BloomForCausalLM", n_layer=2, hidden_size=64, n_head=4, vocab_size=VOCAB,
                  hidden_dropout=0.0, attention_dropout=0.0, **_COMMON), "ALiBi, fused q|k|v per head"),
    "opt": (_hf("OPTConfig", "OPTForCausalLM", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                ffn_dim=128, vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0,
                attention_dropout=0.0, **_COMMON), "learned positions with offset, ReLU MLP"),
    "mixtral": (_decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2),
                "mixture of experts, top-2 routing"),
    "bert": (_hf("BertConfig", "BertForMaskedLM", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0, pad_token_id=0), "post-norm encoder, masked LM"),
    "t5": (_t5, "encoder-decoder, relative position bias"),
    "whisper": (_whisper, "audio encoder-decoder, convolutional stem"),
    "vit": (_vit, "vision transformer, patch convolution, CLS head"),
    "titan_llama": (_titan, "plain PyTorch, blocks in an nn.ModuleDict (torchtitan's code shape)"),
    "nanogpt": (_nanogpt, "plain PyTorch, nanoGPT's code shape (no Hugging Face methods)"),
    "resnet": (_resnet, "CNN: bottleneck ResNet, batch norm"),
    "wide_resnet": (_wide_resnet, "CNN: wide bottleneck ResNet"),
}


def build(name: str) -> tuple[nn.Module, dict]:
    """A fresh (model, example inputs) of architecture `name`."""
    return ARCHS[name][0]()
