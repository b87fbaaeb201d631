"""Kernel schedules for Hugging Face GPT-2 and LLaMA blocks: SDPA attention, fused bias+GeLU / SwiGLU, and fused
residual(+dropout)+norm — each a graph-level primitive over the stock model, composable with `megatron`.

Per block, in this order (NOTE [kernel order]): replace the attention module by one built on
`F.scaled_dot_product_attention` (same children, so tensor-parallel shards of its projections still apply);
trace the block (children stay leaves) and fuse ``h = x + residual; norm(h)`` (with the dropout before the add
when the graph has one) with `torch.compile`; trace the MLP, decompose its first projection (GPT-2) and fuse
``gelu(x + bias)`` (GPT-2) or ``silu(gate) * up`` (LLaMA). The block is traced before its MLP so that the
block's capture never runs a compiled region.

This module also registers the functional forms of HF activation/norm modules and the decomposition of
GPT-2's Conv1D, which the pattern matcher and `decompose` use (the one place model classes are named).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ScheduleError
from ..forms.tensor.leaf_rules import HF_CONV1D
from ..graph.pattern import register_module_form
from ..graph.rewrite import register_decomposition
from ..schedule.core import Schedule
from .common import blocks_path, has_children, named_family
from .regions import (_GATED, bias_gelu, bias_gelu_tanh, fuse_residual_norm, geglu, geglu_tanh,  # noqa: F401
                      probe_activation, probe_norm, residual_norm_pattern, swiglu)

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ registrations
def _register() -> None:
    """transformers' classes, by qualified name (NOTE [registrations on first use]: transformers not imported)."""
    forms = {
        "transformers.activations.NewGELUActivation": lambda m: ("gelu", {"approximate": "tanh"}, ()),
        "transformers.activations.GELUActivation": lambda m: ("gelu", {"approximate": "none"}, ()),
        "transformers.activations.SiLUActivation": lambda m: ("silu", {}, ()),
    }
    for name, f in forms.items():
        register_module_form(name, f)

    @register_decomposition(HF_CONV1D, out_dim=1, in_dim=0)
    def _conv1d(graph, x, path):  # Conv1D: y = x @ W + b with W (in, out)
        return graph.call_function(torch.matmul, (x, graph.get_attr(f"{path}.weight")))


_register()


# ------------------------------------------------------------------------------------------ SDPA attention
class GPT2SdpaAttention(nn.Module):
    """GPT-2 self-attention on `F.scaled_dot_product_attention`, sharing the original's projections.
    Input/output as GPT2Attention: (B, T, E) -> ((B, T, E), None). Under tensor parallelism the fused q|k|v
    projection yields this rank's heads; the head count follows from `split_size` / `head_dim`."""

    def __init__(self, old: nn.Module):
        super().__init__()
        if getattr(old, "is_cross_attention", False):
            raise ScheduleError("GPT2SdpaAttention: cross-attention is not supported")
        self.c_attn = old.c_attn
        self.c_proj = old.c_proj
        self.attn_dropout = old.attn_dropout
        self.resid_dropout = old.resid_dropout
        self.split_size = old.split_size
        self.head_dim = old.head_dim
        self.num_heads = old.num_heads
        self.scaling = old.scaling
        self.layer_idx = old.layer_idx

    def forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, output_attentions=False, **kwargs):
        if encoder_hidden_states is not None:
            raise ScheduleError("GPT2SdpaAttention: cross-attention inputs are not supported")
        q, k, v = self.c_attn(hidden_states).split(self.split_size, dim=2)  # (B, T, E_local) each
        shape = (*q.shape[:-1], -1, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hd)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        return _sdpa_out(self, q, k, v, attention_mask, self.attn_dropout.p), None

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.c_proj(y))


def _more_than_one(n: Any) -> bool:
    """`n > 1` as a Python bool; a symbolic length under export (a traced sequence) counts as more than one,
    so `is_causal` stays a plain bool instead of a SymBool that SDPA cannot take."""
    return n > 1 if isinstance(n, int) else True


def _sdpa_out(mod, q, k, v, mask, dropout_p: float) -> torch.Tensor:
    if mask is not None and mask.dim() == 4:
        mask = mask[:, :, :, : k.shape[-2]]
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p if mod.training else 0.0,
                                       is_causal=mask is None and _more_than_one(q.shape[2]), scale=mod.scaling,
                                       enable_gqa=q.shape[1] != k.shape[1])
    y = y.transpose(1, 2).reshape(*q.shape[:1], q.shape[2], -1)  # (B, T, nh * hd)
    return mod._out(y)


class LlamaSdpaAttention(nn.Module):
    """LLaMA attention (rotary, grouped-query) on `F.scaled_dot_product_attention` (``enable_gqa``), sharing
    the original's projections. Input/output as LlamaAttention."""

    def __init__(self, old: nn.Module):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = old.q_proj, old.k_proj, old.v_proj, old.o_proj
        self.head_dim = old.head_dim
        self.scaling = old.scaling
        self.layer_idx = old.layer_idx
        self.attention_dropout = old.attention_dropout
        self.config = old.config

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        return _sdpa_out(self, q, k, v, attention_mask, self.attention_dropout), None

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        return self.o_proj(y)


def _require(old: Any, children: tuple[str, ...], attrs: tuple[str, ...], what: str) -> None:
    """A factory's check of the module it replaces (a schedule file may name the factory for any module)."""
    missing = [c for c in children if not isinstance(getattr(old, "_modules", {}).get(c), nn.Module)]
    missing += [a for a in attrs if not hasattr(old, a)]
    if not isinstance(old, nn.Module) or missing:
        raise ScheduleError(f"{what} replaces a {what.split('_')[1].upper()} attention module; "
                            f"{type(old).__name__} lacks {missing or 'nn.Module'}")


def sdpa_gpt2_attention(old: nn.Module) -> nn.Module:
    """Factory for `replace`: a GPT2SdpaAttention sharing `old`'s projections. Raises ScheduleError for a
    module without GPT-2 attention's children (c_attn, c_proj, dropouts) and sizes."""
    _require(old, ("c_attn", "c_proj", "attn_dropout", "resid_dropout"),
             ("split_size", "head_dim", "num_heads", "scaling", "layer_idx"), "sdpa_gpt2_attention")
    return GPT2SdpaAttention(old)


def sdpa_llama_attention(old: nn.Module) -> nn.Module:
    """Factory for `replace`: a LlamaSdpaAttention sharing `old`'s projections. Raises ScheduleError for a
    module without LLaMA attention's projections (q/k/v/o_proj) and sizes."""
    _require(old, ("q_proj", "k_proj", "v_proj", "o_proj"),
             ("head_dim", "scaling", "layer_idx", "attention_dropout", "config"), "sdpa_llama_attention")
    return LlamaSdpaAttention(old)


# ------------------------------------------------------------------------------------------ recipes
def kernel_schedule(sch: Schedule, *, example_inputs: dict[str, Any], compiler: str = "inductor",
                    attention: bool = True, fuse_mlp: bool = True, fuse_norm: bool = True,
                    report: list[str] | None = None) -> Schedule:
    """Apply the kernel schedule to every block of the model's main stack. GPT-2, LLaMA-like and BERT blocks
    (exactly their modules: NOTE [a named recipe only for its own blocks] in common.py) get their named schedule
    (SDPA attention modules, fused residual+norm and MLP regions); any other block gets what its data flow
    offers (`fusions.data_flow_kernels`: residual+norm and activation regions found in its graph), and a block where
    nothing matches is left as it is. `example_inputs`: keyword inputs of the whole model (for capture;
    use_cache=False avoids KV caches). `report`, when given, receives one line per block: what was replaced or
    fused, and what was skipped and why. Composes with `megatron` applied before it (tensor-parallel shards of
    the projections carry over; a decomposed column-parallel projection gets its input-gradient reduction at
    build). Raises ScheduleError when a named family's part is missing or not what it computes (Gemma's
    RMSNorm: pass fuse_norm=False)."""
    blocks = blocks_path(sch)
    first = sch[f"{blocks}.0"].mod
    family = named_family(first)  # NOTE [a named recipe only for its own blocks] in common.py
    if family == "bert":
        return _bert_kernels(sch, blocks, example_inputs=example_inputs, compiler=compiler, fuse_mlp=fuse_mlp,
                             fuse_norm=fuse_norm)
    norm = {"gpt2": "ln_2", "llama": "post_attention_layernorm"}.get(family or "")
    if norm is None or not has_children(first, norm):
        from .fusions import data_flow_kernels

        return data_flow_kernels(sch, blocks, example_inputs=example_inputs, compiler=compiler, fuse_mlp=fuse_mlp,
                                 fuse_norm=fuse_norm, attention=attention, report=report)
    gated = None
    if family == "llama":  # LLaMA-like: check every part before anything is replaced or traced
        gated = _check_llama_like(sch, blocks, fuse_mlp=fuse_mlp, fuse_norm=fuse_norm)
    for i in range(len(sch[blocks].mod)):
        b = f"{blocks}.{i}"
        attn = f"{b}.attn" if family == "gpt2" else f"{b}.self_attn"
        if attention:
            sch[attn].replace(sdpa_gpt2_attention if family == "gpt2" else sdpa_llama_attention)
        if fuse_norm:
            sch[b].trace(example_inputs=example_inputs)
            norm = "ln_2" if family == "gpt2" else "post_attention_layernorm"
            if not fuse_residual_norm(sch[b], norm, compiler=compiler):
                raise ScheduleError(f"kernel_schedule at {b!r}: no residual add feeding {norm!r}")
        if fuse_mlp:
            mlp = sch[f"{b}.mlp"]
            mlp.trace(example_inputs=example_inputs)
            if family == "gpt2":
                sch[f"{b}.mlp.c_fc"].decompose()
                ms = mlp.find_pattern(bias_gelu_tanh) or mlp.find_pattern(bias_gelu)
            else:
                ms = mlp.find_pattern(gated)
            if not ms:
                raise ScheduleError(f"kernel_schedule at {b!r}: the MLP has no "
                                    f"{'bias+GeLU' if family == 'gpt2' else gated.__name__}")
            mlp.fuse(ms[0], compiler=compiler)
    logger.info("kernel_schedule: %s, %d blocks (attention=%s, mlp=%s, norm=%s, %s)", family,
                len(sch[blocks].mod), attention, fuse_mlp, fuse_norm, compiler)
    return sch


def _check_llama_like(sch: Schedule, blocks: str, *, fuse_mlp: bool, fuse_norm: bool):
    """The gated-MLP pattern of a LLaMA-like model after checking, before any tracing, that its norms and its
    activation have known functional forms. Raises ScheduleError naming the module and what to turn off."""
    gated = None
    for i in range(len(sch[blocks].mod)):
        b = sch[f"{blocks}.{i}"]
        if fuse_norm and probe_norm(b["post_attention_layernorm"].mod) is None:
            raise ScheduleError(f"kernel_schedule at {b.path!r}: {type(b['post_attention_layernorm'].mod).__name__} "
                                f"is not an F.rms_norm of its weight (checked numerically), so the residual+norm "
                                f"fusion does not apply; pass fuse_norm=False")
        act = getattr(b["mlp"].mod, "act_fn", None)
        if fuse_mlp:
            name = probe_activation(act) if isinstance(act, nn.Module) else None
            if name not in _GATED:
                raise ScheduleError(f"kernel_schedule at {b.path!r}: the MLP activation "
                                    f"{type(act).__name__} is not SiLU or GeLU (checked numerically); "
                                    f"pass fuse_mlp=False")
            gated = _GATED[name]
    return gated


def _bert_kernels(sch: Schedule, blocks: str, *, example_inputs: dict[str, Any], compiler: str, fuse_mlp: bool,
                  fuse_norm: bool) -> Schedule:
    """BERT (post-norm): fused dropout+residual+LayerNorm in both output modules and fused bias+GeLU in the
    intermediate module. Attention keeps the model's own implementation (no SDPA replacement is offered)."""
    for i in range(len(sch[blocks].mod)):
        b = f"{blocks}.{i}"
        if fuse_norm:
            for out in (f"{b}.attention.output", f"{b}.output"):
                sch[out].trace(example_inputs=example_inputs)
                p = float(sch[f"{out}.dropout"].mod.p)
                if not fuse_residual_norm(sch[out], "LayerNorm", compiler=compiler, dropout_p=p):
                    raise ScheduleError(f"kernel_schedule at {out!r}: no dropout + residual add feeding its LayerNorm")
        if fuse_mlp:
            inter = sch[f"{b}.intermediate"]
            inter.trace(example_inputs=example_inputs)
            sch[f"{b}.intermediate.dense"].decompose()
            ms = inter.find_pattern(bias_gelu) or inter.find_pattern(bias_gelu_tanh)
            if not ms:
                raise ScheduleError(f"kernel_schedule at {b!r}: the intermediate module has no bias+GeLU")
            inter.fuse(ms[0], compiler=compiler)
    logger.info("kernel_schedule: bert, %d blocks (mlp=%s, norm=%s, %s)", len(sch[blocks].mod), fuse_mlp, fuse_norm,
                compiler)
    return sch
