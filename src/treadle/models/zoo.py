"""Named model configs (Hugging Face architectures, random weights, no downloads) and their example inputs.

`named_model("llama-2-70b", batch=1, seq=4096, fake=True)` builds the model under `FakeTensorMode`, so a 70B
model costs no memory and no initialisation time; tiny configs (`tiny-gpt2`, `tiny-bert`, `tiny-llama`,
`tiny-opt`, `tiny-t5`, `tiny-mixtral`, `tiny-deepseek-v3`) are small enough to run for real in tests.
`load_model("pkg.mod:function", ...)` calls a user function returning ``(model, example_inputs)``. Example inputs are a dict of keyword arguments that
includes ``labels``, so the model returns its own training loss.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..errors import ProfileError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """One named configuration: the transformers config and model class names, and config keyword arguments."""

    family: str  # "gpt2" | "bert" | "llama" | "opt" | "t5" | "mixtral" | "qwen3_moe" | "deepseek_v3"
    config: dict[str, Any] = field(default_factory=dict)
    source: str = ""


_FAMILIES = {
    # family: (config class, model class with an LM loss)
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "bert": ("BertConfig", "BertForMaskedLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "opt": ("OPTConfig", "OPTForCausalLM"),
    "t5": ("T5Config", "T5ForConditionalGeneration"),
    # mixture-of-experts decoders (their experts stack on dim 0: `treadle.forms.expert`)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}


def _llama(h: int, ffn: int, layers: int, heads: int, kv: int, vocab: int, **kw: Any) -> dict[str, Any]:
    return dict(hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, vocab_size=vocab, **kw)


MODEL_CONFIGS: dict[str, ModelConfig] = {
    # GPT-2 sizes (Radford et al. 2019, Table 2; HF model cards)
    "gpt2": ModelConfig(family="gpt2", config=dict(n_layer=12, n_embd=768, n_head=12), source="openai-community/gpt2"),
    "gpt2-medium": ModelConfig(family="gpt2", config=dict(n_layer=24, n_embd=1024, n_head=16), source="gpt2-medium"),
    "gpt2-large": ModelConfig(family="gpt2", config=dict(n_layer=36, n_embd=1280, n_head=20), source="gpt2-large"),
    "gpt2-xl": ModelConfig(family="gpt2", config=dict(n_layer=48, n_embd=1600, n_head=25), source="gpt2-xl"),
    # BERT (Devlin et al. 2019)
    "bert-base": ModelConfig(family="bert", config=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                                        intermediate_size=3072), source="bert-base-uncased"),
    "bert-large": ModelConfig(family="bert", config=dict(hidden_size=1024, num_hidden_layers=24,
                                                         num_attention_heads=16, intermediate_size=4096),
                              source="bert-large-uncased"),
    # LLaMA 2 (Touvron et al. 2023, Table 1; HF config.json of meta-llama/Llama-2-*-hf)
    "llama-2-7b": ModelConfig(family="llama", config=_llama(4096, 11008, 32, 32, 32, 32000,
                                                            max_position_embeddings=4096, rms_norm_eps=1e-5),
                              source="meta-llama/Llama-2-7b-hf"),
    "llama-2-13b": ModelConfig(family="llama", config=_llama(5120, 13824, 40, 40, 40, 32000,
                                                             max_position_embeddings=4096, rms_norm_eps=1e-5),
                               source="meta-llama/Llama-2-13b-hf"),
    "llama-2-70b": ModelConfig(family="llama", config=_llama(8192, 28672, 80, 64, 8, 32000,
                                                             max_position_embeddings=4096, rms_norm_eps=1e-5),
                               source="meta-llama/Llama-2-70b-hf"),
    "llama-3-8b": ModelConfig(family="llama", config=_llama(4096, 14336, 32, 32, 8, 128256,
                                                            max_position_embeddings=8192, rms_norm_eps=1e-5,
                                                            rope_theta=500000.0),
                              source="meta-llama/Meta-Llama-3-8B"),
    "llama-3-70b": ModelConfig(family="llama", config=_llama(8192, 28672, 80, 64, 8, 128256,
                                                             max_position_embeddings=8192, rms_norm_eps=1e-5,
                                                             rope_theta=500000.0),
                               source="meta-llama/Meta-Llama-3-70B"),
    "llama-3.1-405b": ModelConfig(family="llama", config=_llama(16384, 53248, 126, 128, 8, 128256,
                                                                max_position_embeddings=131072, rms_norm_eps=1e-5,
                                                                rope_theta=500000.0),
                                  source="meta-llama/Llama-3.1-405B (rope scaling left out: it changes no cost)"),
    # OPT (Zhang et al. 2022, Table 1)
    "opt-1.3b": ModelConfig(family="opt", config=dict(hidden_size=2048, ffn_dim=8192, num_hidden_layers=24,
                                                      num_attention_heads=32, word_embed_proj_dim=2048,
                                                      max_position_embeddings=2048), source="facebook/opt-1.3b"),
    "opt-6.7b": ModelConfig(family="opt", config=dict(hidden_size=4096, ffn_dim=16384, num_hidden_layers=32,
                                                      num_attention_heads=32, word_embed_proj_dim=4096,
                                                      max_position_embeddings=2048), source="facebook/opt-6.7b"),
    # T5 v1.0 base (Raffel et al. 2020)
    "t5-base": ModelConfig(family="t5", config=dict(d_model=768, d_ff=3072, num_layers=12, num_decoder_layers=12,
                                                    num_heads=12, d_kv=64, vocab_size=32128), source="t5-base"),
    # Mixture-of-experts (HF config.json of each source)
    "mixtral-8x7b": ModelConfig(family="mixtral", config=_llama(4096, 14336, 32, 32, 8, 32000,
                                                                max_position_embeddings=32768, rms_norm_eps=1e-5,
                                                                rope_theta=1e6, num_local_experts=8,
                                                                num_experts_per_tok=2),
                                source="mistralai/Mixtral-8x7B-v0.1"),
    "qwen3-30b-a3b": ModelConfig(family="qwen3_moe", config=_llama(2048, 6144, 48, 32, 4, 151936, head_dim=128,
                                                                   moe_intermediate_size=768, num_experts=128,
                                                                   num_experts_per_tok=8, norm_topk_prob=True,
                                                                   max_position_embeddings=40960, rms_norm_eps=1e-6,
                                                                   rope_theta=1e6, tie_word_embeddings=False),
                                 source="Qwen/Qwen3-30B-A3B"),
    # Tiny configs for tests: same architectures, a few layers, small widths.
    "tiny-gpt2": ModelConfig(family="gpt2", config=dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256,
                                                        n_positions=128, bos_token_id=255, eos_token_id=255)),
    "tiny-bert": ModelConfig(family="bert", config=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                                        intermediate_size=128, vocab_size=256,
                                                        max_position_embeddings=128)),
    "tiny-llama": ModelConfig(family="llama", config=_llama(64, 176, 4, 4, 2, 256, max_position_embeddings=128)),
    "tiny-opt": ModelConfig(family="opt", config=dict(hidden_size=64, ffn_dim=256, num_hidden_layers=4,
                                                      num_attention_heads=4, word_embed_proj_dim=64, vocab_size=256,
                                                      max_position_embeddings=128)),
    "tiny-t5": ModelConfig(family="t5", config=dict(d_model=64, d_ff=128, num_layers=5, num_decoder_layers=5,
                                                    num_heads=4, d_kv=16, vocab_size=256)),
    "tiny-mixtral": ModelConfig(family="mixtral", config=_llama(64, 128, 2, 4, 2, 256, max_position_embeddings=128,
                                                                num_local_experts=8, num_experts_per_tok=2)),
    "tiny-deepseek-v3": ModelConfig(family="deepseek_v3", config=_llama(
        64, 128, 2, 4, 4, 256, max_position_embeddings=128, moe_intermediate_size=32, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8)),
}


def model_names() -> list[str]:
    return sorted(MODEL_CONFIGS)


def check_model_name(spec: str) -> str:
    """`spec` as the command line gives a model: a zoo name, or ``package.module:function`` (the user's, imported
    later as given). Nothing is imported or built. Raises ProfileError naming an unknown name, the closest known
    ones and every known name; returns `spec`."""
    if ":" in spec or spec in MODEL_CONFIGS:
        return spec
    close = difflib.get_close_matches(spec, list(MODEL_CONFIGS), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    raise ProfileError(f"unknown model {spec!r}; {hint}known: {model_names()}, or 'package.module:function'")


def _example_inputs(family: str, vocab: int, *, batch: int, seq: int, fake_mode: Any) -> dict[str, torch.Tensor]:
    def ids() -> torch.Tensor:
        if fake_mode is not None:  # random ids are not needed on fake tensors; shape and dtype are
            with fake_mode:
                return torch.zeros(batch, seq, dtype=torch.long)
        return torch.randint(0, vocab, (batch, seq), generator=gen)

    gen = torch.Generator().manual_seed(0)
    inputs = {"input_ids": ids(), "labels": ids()}
    if family == "t5":
        inputs["decoder_input_ids"] = ids()
    return inputs


def named_model(name: str, *, batch: int, seq: int, fake: bool = False, dtype: torch.dtype = torch.float32,
                attn: str = "sdpa", dropout: bool = True) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Build the named configuration with random weights, in training mode, and example inputs of shape
    (batch, seq) (token ids and labels; T5 also gets decoder ids of the same shape).

    `fake=True` builds parameters and inputs under one `FakeTensorMode` (no memory, no init); the mode is reachable
    from any parameter (`torch._guards.detect_fake_mode`). `attn` is the transformers attention implementation
    ("sdpa" or "eager"). `dropout=False` zeroes every dropout probability (deterministic real runs).
    Raises ProfileError for an unknown name (listing the known ones) or a `seq` beyond the model's positions.
    """
    if name not in MODEL_CONFIGS:
        raise ProfileError(f"unknown model {name!r}; known: {model_names()}, or 'package.module:function'")
    import transformers

    spec = MODEL_CONFIGS[name]
    cfg_cls, model_cls = (getattr(transformers, n) for n in _FAMILIES[spec.family])
    kwargs = dict(spec.config)
    if not dropout:
        for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
                    "dropout", "attention_dropout", "activation_dropout", "dropout_rate"):
            kwargs[key] = 0.0
    kwargs["use_cache"] = False  # training: no KV cache
    config = cfg_cls(**kwargs)
    config._attn_implementation = attn
    max_pos = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if max_pos is not None and seq > max_pos and spec.family != "t5":
        raise ProfileError(f"model {name!r}: seq={seq} exceeds its {max_pos} positions; use seq <= {max_pos}")
    fake_mode = None
    ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from transformers.initialization import no_init_weights

        fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        ctx = contextlib.ExitStack()
        ctx.enter_context(fake_mode)
        ctx.enter_context(no_init_weights())
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in `dtype` (a cast after would copy them)
    try:
        with ctx:
            model = model_cls(config)
            if fake:
                model.tie_weights()  # skipped with initialisation; tied heads must stay one parameter
    finally:
        torch.set_default_dtype(previous_dtype)
    model.train()
    if getattr(model, "loss_type", "") is None and spec.family == "gpt2":
        model.loss_type = "ForCausalLM"  # the loss transformers falls back to for GPT2LMHeadModel, without its warning
    inputs = _example_inputs(spec.family, config.vocab_size, batch=batch, seq=seq, fake_mode=fake_mode)
    logger.info("built %s (%s) batch=%d seq=%d fake=%s", name, model_cls.__name__, batch, seq, fake)
    return model, inputs


def check_file_model_spec(spec: Any, *, source: str) -> str:
    """`spec` as a file may give it (a run config's ``model``; NOTE [files are data] in
    treadle.schedule.gate): a zoo name, a local Hugging Face config directory or ``config.json``, or a
    ``package.module:function`` that the program registered with `treadle.register_ref` (exactly that
    name). A function typed on the command line needs none of this. Nothing is imported or called.
    Raises ProfileError naming `source` and the spec otherwise; returns `spec`."""
    from pathlib import Path

    from ..schedule.gate import registered

    if not isinstance(spec, str) or not spec or len(spec) > 4096:
        raise ProfileError(f"{source}: model must be a non-empty name, got {spec!r:.80}")
    if spec in MODEL_CONFIGS:
        return spec
    if ":" in spec and not Path(spec).exists():
        if callable(registered(spec)):
            return spec
        raise ProfileError(f"{source}: names model function {spec!r:.120}, which a file may not name: a file may "
                           f"give a zoo name ({', '.join(model_names()[:4])}, ...), a Hugging Face config directory, "
                           f"or a function your code registered with treadle.register_ref; pass the function as "
                           f"--model on the command line instead")
    p = Path(spec)
    if (p.is_dir() and (p / "config.json").is_file()) or (p.name == "config.json" and p.is_file()):
        return spec
    raise ProfileError(f"{source}: model {spec!r:.120} is neither a zoo name (known: {model_names()}) nor a "
                       f"directory holding a Hugging Face config.json")


def zoo_name_from_file(name: Any, *, source: str) -> str:
    """A model name a plan file gives for `named_model` (``treadle verify/price plan.json``): a zoo name only,
    never imported (NOTE [files are data]). Raises ProfileError naming `source` otherwise; returns `name`."""
    if isinstance(name, str) and name in MODEL_CONFIGS:
        return name
    raise ProfileError(f"{source}: the plan's model {name!r:.120} is not a zoo name (known: {model_names()}); "
                       f"name the model with --model")


def load_model(spec: str, *, batch: int, seq: int, fake: bool = False, **kwargs: Any) -> tuple[nn.Module, Any]:
    """A named config, or ``package.module:function`` returning ``(model, example_inputs)``. The function is called
    with whichever of `batch`, `seq`, `fake` (and `kwargs`) it accepts. Raises ProfileError if the module or
    function cannot be found or does not return a (module, inputs) pair."""
    if ":" not in spec:
        return named_model(spec, batch=batch, seq=seq, fake=fake, **kwargs)
    mod_name, _, fn_name = spec.partition(":")
    try:
        fn: Callable[..., Any] = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ProfileError(f"cannot load {spec!r}: {exc}; expected 'package.module:function'") from exc
    params = inspect.signature(fn).parameters
    offered = dict(batch=batch, seq=seq, fake=fake, **kwargs)
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    result = fn(**{k: v for k, v in offered.items() if accepts_any or k in params})
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise ProfileError(f"{spec!r} must return (nn.Module, example_inputs); got {type(result).__name__}")
    return result
