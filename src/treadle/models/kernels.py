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
from ..graph.pattern import canonical_op, register_form_probe, register_module_form
from ..graph.rewrite import register_decomposition
from ..schedule.core import Schedule
from .common import blocks_path, has_children, named_family

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


# ------------------------------------------------------------------------------------------ patterns
def bias_gelu_tanh(x, bias):
    return F.gelu(x + bias, approximate="tanh")


def bias_gelu(x, bias):
    return F.gelu(x + bias)


def bias_relu(x, bias):
    return F.relu(x + bias)


def bias_silu(x, bias):
    return F.silu(x + bias)


_BIAS_ACTS = (bias_gelu_tanh, bias_gelu, bias_relu, bias_silu)


def swiglu(gate, up):
    return F.silu(gate) * up


def geglu_tanh(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def geglu(gate, up):
    return F.gelu(gate) * up


# NOTE [forms by behaviour]: LLaMA-like models (Qwen2, Mistral, Gemma, ...) each define their own RMSNorm and
# activation classes. A class is given a functional form only when a probe shows it computes that functional
# (on a copy with random weights and a random input), never because of its name; Gemma's RMSNorm scales by
# (1 + weight), so it is not an ``F.rms_norm`` and its norm fusion is refused before any tracing.
_ACTS = {"silu": (lambda x: F.silu(x), {}), "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), {"approximate": "tanh"}),
         "gelu": (lambda x: F.gelu(x), {"approximate": "none"}), "relu": (lambda x: F.relu(x), {})}
_GATED = {"silu": swiglu, "gelu_tanh": geglu_tanh, "gelu": geglu}


def _eps_of(m: nn.Module) -> float | None:
    for a in ("variance_epsilon", "eps"):
        v = getattr(m, a, None)
        if isinstance(v, float):
            return v
    return None


_PROBED: dict[type, tuple] = {}  # type -> probe result; a class computes one function, so this changes nothing


def probe_norm(m: nn.Module) -> tuple[str, list[int], float] | None:
    """(kind, normalized shape, eps) when `m` computes ``F.layer_norm`` or ``F.rms_norm`` with its weight,
    checked numerically on a copy with random weights; None otherwise (then it is not fused)."""
    import copy

    if isinstance(m, nn.LayerNorm):
        return "layer_norm", list(m.normalized_shape), m.eps
    w, eps = getattr(m, "weight", None), _eps_of(m)
    if (not isinstance(w, torch.Tensor) or w.dim() != 1 or eps is None or getattr(m, "bias", None) is not None
            or len(list(m.parameters())) != 1 or len(list(m.children())) or w.is_meta):
        return None
    key = ("norm", type(m))
    if key not in _PROBED:
        g = torch.Generator().manual_seed(0)
        probe = copy.deepcopy(m).float()
        with torch.no_grad():
            probe.weight.copy_(torch.rand(w.shape, generator=g) + 0.5)
            x = torch.randn(2, 3, w.shape[0], generator=g)
            try:
                ok = torch.allclose(probe(x), F.rms_norm(x, [w.shape[0]], probe.weight, eps), rtol=1e-4, atol=1e-5)
            except Exception:  # not a norm over the last dim
                ok = False
        _PROBED[key] = (ok,)
    return ("rms_norm", [w.shape[0]], eps) if _PROBED[key][0] else None


def probe_activation(m: nn.Module) -> str | None:
    """"silu", "gelu_tanh", "gelu" or "relu" when a parameter-free leaf `m` computes that function (checked on a random
    input); None otherwise."""
    if len(list(m.parameters())) or len(list(m.children())) or isinstance(m, nn.Dropout):
        return None
    key = ("act", type(m))
    if key not in _PROBED:
        x = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
        found = None
        try:
            with torch.no_grad():
                y = m(x)
            found = next((n for n, (fn, _) in _ACTS.items() if isinstance(y, torch.Tensor) and y.shape == x.shape
                          and torch.allclose(y, fn(x), rtol=1e-5, atol=1e-6)), None)
        except Exception:  # takes other inputs: not an activation
            found = None
        _PROBED[key] = (found,)
    return _PROBED[key][0]


def _form_probe(m: nn.Module):
    """The form maker of a leaf recognised by behaviour (an RMSNorm or an activation), for the pattern matcher
    and region inlining (treadle.graph.pattern.module_form)."""
    if probe_norm(m) is not None and not isinstance(m, nn.LayerNorm):
        return lambda mm: ("rms_norm", {"normalized_shape": [mm.weight.shape[0]], "eps": _eps_of(mm)}, ("weight",))
    act = probe_activation(m)
    if act is not None:
        return lambda mm: (act, {}, ()) if act in ("silu", "relu") else ("gelu", dict(_ACTS[act][1]), ())
    return None


register_form_probe(_form_probe)


def residual_norm_pattern(kind: str, shape: list[int], eps: float, dropout_p: float | None, *, both: bool = True):
    """Pattern ``h = [dropout(x)] + residual; return (h,) norm(h)`` for a LayerNorm (``kind="layer_norm"``,
    inputs x, residual, weight, bias) or an RMSNorm (``"rms_norm"``, inputs x, residual, weight). With
    ``both=False`` only the norm is an output (post-norm blocks, where the sum feeds nothing else)."""
    if kind == "layer_norm":
        def residual_layer_norm(x, residual, weight, bias):
            if dropout_p is not None:
                x = F.dropout(x, dropout_p, True)
            h = x + residual
            y = F.layer_norm(h, shape, weight, bias, eps)
            return (h, y) if both else y

        return residual_layer_norm

    def residual_rms_norm(x, residual, weight):
        if dropout_p is not None:
            x = F.dropout(x, dropout_p, True)
        h = x + residual
        y = F.rms_norm(h, shape, weight, eps)
        return (h, y) if both else y

    return residual_rms_norm


def fuse_residual_norm(sch: Schedule, norm_path: str, *, compiler: str, dropout_p: float | None = None) -> int:
    """Fuse ``[dropout +] residual add -> norm`` feeding the norm leaf `norm_path` (relative to traced `sch`).
    Tries the form with dropout first when `dropout_p` is given. Returns the number of fused regions."""
    norm = sch[norm_path].mod
    form = probe_norm(norm)
    if form is None:
        raise ScheduleError(f"fuse_residual_norm at {sch[norm_path].path!r}: {type(norm).__name__} does not compute "
                            f"F.layer_norm or F.rms_norm of its weight (NOTE [forms by behaviour])")
    kind, shape, eps = form
    for p in ([dropout_p] if dropout_p is not None else []) + [None]:
        for both in (False, True):  # the sum as an output only when something else reads it (pre-norm residual)
            ms = [m for m in sch.find_pattern(residual_norm_pattern(kind, shape, eps, p, both=both))
                  if m.outputs[-1].target == norm_path]
            if ms:
                sch.fuse(ms[0], compiler=compiler)
                return 1
    return 0


# ------------------------------------------------------------------------------------------ recipes
def kernel_schedule(sch: Schedule, *, example_inputs: dict[str, Any], compiler: str = "inductor",
                    attention: bool = True, fuse_mlp: bool = True, fuse_norm: bool = True,
                    report: list[str] | None = None) -> Schedule:
    """Apply the kernel schedule to every block of the model's main stack. GPT-2, LLaMA-like and BERT blocks
    (exactly their modules: NOTE [a named recipe only for its own blocks] in common.py) get their named schedule
    (SDPA attention modules, fused residual+norm and MLP regions); any other block gets what its data flow
    offers (`data_flow_kernels`: residual+norm and activation regions found in its graph), and a block where
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
        return data_flow_kernels(sch, blocks, example_inputs=example_inputs, compiler=compiler, fuse_mlp=fuse_mlp,
                                 fuse_norm=fuse_norm, report=report)
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


# ------------------------------------------------------------------------------------------ by data flow
# NOTE [kernels by data flow]: for a block no named schedule knows, the regions worth one fused kernel are found in
# its graph, not by module names. The block is traced (its children stay leaves) and each child that computes a
# norm (`probe_norm`: LayerNorm, or an F.rms_norm of its weight, checked numerically) and reads a residual sum
# made in the block gets ``add -> norm`` fused; then each child holding an activation leaf (`probe_activation`)
# is traced and its gated product (``act(gate) * up``) fused, or else each Linear whose output feeds the
# activation is decomposed and ``act(x + bias)`` fused. Attention is not replaced by data flow: a block whose
# graph already calls scaled_dot_product_attention (transformers' default) says so. Everything that does not
# match is reported and left as the model wrote it; every region keeps its numbers (verified).
def data_flow_kernels(sch: Schedule, blocks: str, *, example_inputs: dict[str, Any], compiler: str = "inductor",
                      fuse_mlp: bool = True, fuse_norm: bool = True, report: list[str] | None = None) -> Schedule:
    """Fuse what the data flow of each block of `blocks` offers (NOTE [kernels by data flow]); returns `sch`.
    `report` (when given) receives one line per block."""
    lines: list[str] = []
    for i in range(len(sch[blocks].mod)):
        b = f"{blocks}.{i}"
        block = sch[b].mod
        done: list[str] = []
        skipped: list[str] = []
        norms = [n for n, c in block.named_children() if probe_norm(c) is not None]
        acts = _mlp_paths(block)
        at_block = fuse_mlp and (not acts or acts == [""])  # the activation is the block's own (or functional)
        acts = [a for a in acts if a]
        if norms and fuse_norm or at_block:  # the block's own graph: its norms, or its activations
            try:
                sch[b].trace(example_inputs=example_inputs)
            except ScheduleError as e:
                lines.append(f"{b}: skipped (its graph cannot be captured: {str(e)[:160]})")
                continue
            if any("scaled_dot_product_attention" in str(n.target) for n in sch[b].mod.graph.nodes):
                done.append("attention already SDPA")
            drops = sorted({float(nd.args[1] if len(nd.args) > 1 else nd.kwargs.get("p", 0.5))
                            for nd in sch[b].mod.graph.nodes if canonical_op(nd) == "dropout"})
            for n in norms if fuse_norm else []:
                if any(fuse_residual_norm(sch[b], n, compiler=compiler, dropout_p=p) for p in (drops or [None])):
                    done.append(f"residual+norm -> {n}")
                else:
                    skipped.append(f"{n} (its input is not directly a residual sum made in the block)")
            if at_block:
                what = _fuse_activation(sch, b, example_inputs=example_inputs, compiler=compiler)
                (done if what.startswith("fused") else skipped).append(f"block: {what}")
        for n in acts if fuse_mlp else []:
            what = _fuse_activation(sch, f"{b}.{n}", example_inputs=example_inputs, compiler=compiler)
            (done if what.startswith("fused") else skipped).append(f"{n}: {what}")
        lines.append(f"{b}: " + ("; ".join(done) or "nothing fused") + (f"; skipped {'; '.join(skipped)}"
                                                                         if skipped else ""))
    for line in lines:
        logger.info("kernel_schedule: %s", line)
    if report is not None:
        report.extend(lines)
    return sch


def _mlp_paths(block: nn.Module) -> list[str]:
    """Modules of `block` ("" for the block itself) whose own children include an activation leaf and a Linear-like
    leaf (an MLP), outermost only."""
    from ..forms.tensor.leaf_rules import matmul_dims

    out: list[str] = []
    for p, m in block.named_modules():
        kids = list(m.children())
        if (any(probe_activation(c) is not None for c in kids) and any(matmul_dims(c) is not None for c in kids)
                and not any(q == "" or p.startswith(q + ".") for q in out)):
            out.append(p)
    return out


def _fuse_activation(sch: Schedule, path: str, *, example_inputs: dict[str, Any], compiler: str) -> str:
    """Trace the module at `path` (unless it is) and fuse its gated product, else its bias + activation regions."""
    mod = sch[path]
    if not isinstance(mod.mod, torch.fx.GraphModule):
        try:
            mod.trace(example_inputs=example_inputs)
        except ScheduleError as e:
            return f"its graph cannot be captured ({str(e)[:120]})"
    for gated in (swiglu, geglu_tanh, geglu):
        ms = mod.find_pattern(gated)
        if ms:
            for m in ms:
                mod.fuse(m, compiler=compiler)
            return f"fused {len(ms)} x {gated.__name__}"
    fed = [n.target for n in mod.mod.graph.nodes if n.op == "call_module"
           and getattr(mod.mod.get_submodule(n.target), "bias", None) is not None
           and any(u.op in ("call_module", "call_function") and _is_activation(mod.mod, u) for u in n.users)]
    if not fed:
        return "no gated product or biased projection feeding the activation"
    for target in fed:
        try:
            sch[f"{path}.{target}"].decompose()
        except ScheduleError as e:
            return f"{target} cannot be decomposed ({str(e)[:120]})"
    count = 0
    for pattern in _BIAS_ACTS:
        for m in mod.find_pattern(pattern):
            mod.fuse(m, compiler=compiler)
            count += 1
    return f"fused {count} x bias+activation" if count else "no bias+activation region after decomposing"


def _is_activation(gm: nn.Module, node: Any) -> bool:
    """Whether graph node `node` applies GeLU, SiLU or ReLU (a leaf found so by `probe_activation`, or the op)."""
    if node.op == "call_module":
        return probe_activation(gm.get_submodule(node.target)) is not None
    return canonical_op(node) in ("gelu", "silu", "relu")
