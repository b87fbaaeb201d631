"""Registry of pure per-ATen-op FLOP formulas: forward and backward FLOPs from (fake) tensor shapes.

Convention (that of `torch.utils.flop_counter.FlopCounterMode`): a multiply-add is 2 FLOPs, and only matrix
products count — mm/addmm/bmm/baddbmm/linear/matmul, convolutions and scaled-dot-product attention. Every other
op (pointwise, reductions, norms, softmax, copies, views, factories) is registered with 0 FLOPs and a `kind` that
tells the roofline it is priced by the bytes it moves ("view" ops alias and move nothing). This is also the
convention of model FLOPs in MFU (Chowdhery et al. 2022), so element-wise work never inflates utilisation.

Attention is counted by its math whatever kernel the dispatcher picks (math, flash, efficient, cuDNN, or CPU
flash, which FlopCounterMode counts as zero): forward = QK^T + PV = 2·b·h·s_q·s_k·(d_qk + d_v); backward = 4
matrix products (grad V, grad P, grad Q, grad K), twice the forward, as an eager attention's backward does.

Lookup: an op is resolved by its overload, then by its overload packet; ops not registered are classified by
their schema — views (`is_view`) and ops tagged `pointwise` or `reduction` cost 0 FLOPs. Anything else raises
ProfileError naming the op, never a silent zero. `register_flops` rejects duplicate registrations.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import ProfileError

aten = torch.ops.aten

# A formula takes (args, kwargs, out, needs_grad) and returns FLOPs. needs_grad(i) says whether positional tensor
# argument i needs a gradient (only backward formulas use it).
Formula = Callable[[Sequence[Any], dict, Any, Callable[[int], bool]], int]

KINDS = ("matmul", "attention", "conv", "pointwise", "reduction", "memory", "view", "factory", "other")
# Of a matmul's backward, the share its weight gradient takes (the other half: its input's gradient, one product
# of the same size each): what a zero-bubble schedule's W action runs. One rule for the pipeline price (per
# backward matmul record) and the planner (`StrategyCost.w_s`, per matmul node).
MATMUL_WEIGHT_GRAD_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class OpRule:
    """How one op is counted: its kind (see KINDS) and forward/backward FLOP formulas."""

    kind: str
    forward: Formula
    backward: Formula


_REGISTRY: dict[Any, OpRule] = {}
_RESOLVED: dict[Any, OpRule] = {}


def _zero(args: Sequence[Any], kwargs: dict, out: Any, needs: Callable[[int], bool]) -> int:
    return 0


def _no_double_backward(args: Sequence[Any], kwargs: dict, out: Any, needs: Callable[[int], bool]) -> int:
    raise ProfileError("backward of a backward op (double backward) is not modelled")


def register_flops(*ops: Any, kind: str, backward: Formula | None = None) -> Callable[[Formula], Formula]:
    """Register a forward formula (and optionally a backward one; default: raise, as for backward ops) for `ops`
    (OpOverloads or OpOverloadPackets, or the qualified name of a library's custom op, ``"transformers::
    grouped_mm_fallback"``: registering a name imports nothing). Raises ProfileError if an op is already
    registered or `kind` is unknown."""
    if kind not in KINDS:
        raise ProfileError(f"unknown op kind {kind!r}; known: {KINDS}")

    def deco(fwd: Formula) -> Formula:
        for op in ops:
            if op in _REGISTRY:
                raise ProfileError(f"FLOP formula for {op} registered twice")
            _REGISTRY[op] = OpRule(kind, fwd, backward or _no_double_backward)
        _RESOLVED.clear()
        return fwd

    return deco


def register_zero(*ops: Any, kind: str) -> None:
    """Register `ops` as costing 0 FLOPs forward and backward, priced by bytes moved (kind "view": nothing)."""
    register_flops(*ops, kind=kind, backward=_zero)(_zero)


def rule_for(func: Any) -> OpRule:
    """The rule of `func` (OpOverload, OpOverloadPacket or `operator.getitem`). Raises ProfileError naming the op
    when it is neither registered nor a view/pointwise/reduction op by its schema."""
    rule = _RESOLVED.get(func)
    if rule is not None:
        return rule
    rule = _REGISTRY.get(func)
    if rule is None:
        packet = getattr(func, "overloadpacket", None)
        rule = _REGISTRY.get(packet) if packet is not None else None
    if rule is None and isinstance(func, torch._ops.OpOverload):  # a custom op registered by its name
        rule = _REGISTRY.get(func._schema.name)
    if rule is None and isinstance(func, torch._ops.OpOverload):
        tags = set(func.tags)
        if func.is_view or torch.Tag.inplace_view in tags:
            rule = OpRule("view", _zero, _zero)
        elif torch.Tag.pointwise in tags:
            rule = OpRule("pointwise", _zero, _zero)
        elif torch.Tag.reduction in tags:
            rule = OpRule("reduction", _zero, _zero)
    if rule is None:
        raise ProfileError(f"no FLOP rule for op {func}; it is not a view, pointwise or reduction op by its schema. "
                           f"Register one with treadle.profile.flops.register_flops({func}, kind=...)")
    _RESOLVED[func] = rule
    return rule


def op_kind(func: Any) -> str:
    """The kind of `func` (one of KINDS). Raises ProfileError for an op with no rule."""
    return rule_for(func).kind


def _default_needs(args: Sequence[Any]) -> Callable[[int], bool]:
    """Without explicit flags every floating-point tensor argument needs a gradient. In a training step that is
    true of activations and trainable weights alike, and `requires_grad` on graph metadata is not reliable (an
    exported graph's activation values do not carry it)."""
    flags = {i: a.is_floating_point() for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    return lambda i: flags.get(i, False)


def forward_flops(func: Any, args: Sequence[Any], kwargs: dict | None, out: Any) -> int:
    """FLOPs of running `func(*args, **kwargs)` that returned `out` (tensors may be fake). Raises ProfileError
    naming the op if it has no rule, or if a formula cannot read the shapes it needs."""
    rule = rule_for(func)
    try:
        return int(rule.forward(args, kwargs or {}, out, _default_needs(args)))
    except ProfileError:
        raise
    except (IndexError, AttributeError, TypeError, ValueError) as exc:
        raise ProfileError(f"FLOP formula of {func} failed on its arguments: {exc}") from exc


def backward_flops(func: Any, args: Sequence[Any], kwargs: dict | None, out: Any, *,
                   needs_input_grad: Sequence[bool] | None = None) -> int:
    """FLOPs of the backward of `func` for the inputs that need gradients: `needs_input_grad[i]` for positional
    argument i, or by default every floating-point tensor argument (see `_default_needs`; the profiler passes
    the flags autograd actually had). Matrix products cost one product of forward size per input gradient (so
    2x forward when both operands need it). Raises ProfileError naming the op if it has no rule or is itself a
    backward op."""
    rule = rule_for(func)
    if needs_input_grad is not None:
        flags = list(needs_input_grad)
        needs = lambda i: i < len(flags) and bool(flags[i])  # noqa: E731
    else:
        needs = _default_needs(args)
    try:
        return int(rule.backward(args, kwargs or {}, out, needs))
    except ProfileError as exc:
        raise ProfileError(f"{func}: {exc}") from exc
    except (IndexError, AttributeError, TypeError, ValueError) as exc:
        raise ProfileError(f"backward FLOP formula of {func} failed on its arguments: {exc}") from exc


# ------------------------------------------------------------------------------------------------ matrix products

def _mm(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


@register_flops(aten.mm, kind="matmul",
                backward=lambda a, kw, o, nd: (nd(0) + nd(1)) * _mm(a[0].shape[0], a[0].shape[1], a[1].shape[1]))
def _mm_fwd(a, kw, out, nd) -> int:
    # (m, k) @ (k, n) -> (m, n)
    return _mm(a[0].shape[0], a[0].shape[1], a[1].shape[1])


@register_flops(aten.addmm, kind="matmul",
                backward=lambda a, kw, o, nd: (nd(1) + nd(2)) * _mm(a[1].shape[0], a[1].shape[1], a[2].shape[1]))
def _addmm_fwd(a, kw, out, nd) -> int:
    # bias + (m, k) @ (k, n); the bias add is not counted (FlopCounterMode convention)
    return _mm(a[1].shape[0], a[1].shape[1], a[2].shape[1])


def _bmm(x: torch.Tensor, y: torch.Tensor) -> int:
    # (b, m, k) @ (b, k, n) -> (b, m, n)
    return x.shape[0] * _mm(x.shape[1], x.shape[2], y.shape[2])


register_flops(aten.bmm, kind="matmul",
               backward=lambda a, kw, o, nd: (nd(0) + nd(1)) * _bmm(a[0], a[1]))(lambda a, kw, o, nd: _bmm(a[0], a[1]))
register_flops(aten.baddbmm, kind="matmul",
               backward=lambda a, kw, o, nd: (nd(1) + nd(2)) * _bmm(a[1], a[2]))(lambda a, kw, o, nd: _bmm(a[1], a[2]))


def _linear(x: torch.Tensor, w: torch.Tensor) -> int:
    # x (..., k), w (n, k) -> (..., n)
    return _mm(math.prod(x.shape[:-1]), x.shape[-1], w.shape[0])


register_flops(aten.linear, kind="matmul",
               backward=lambda a, kw, o, nd: (nd(0) + nd(1)) * _linear(a[0], a[1]))(
    lambda a, kw, o, nd: _linear(a[0], a[1]))


def _matmul(x: torch.Tensor, y: torch.Tensor) -> int:
    """torch.matmul semantics: 1-D operands are vectors; leading dims broadcast."""
    xs, ys = list(x.shape), list(y.shape)
    if len(xs) == 1:
        xs = [1] + xs
    if len(ys) == 1:
        ys = ys + [1]
    batch = torch.broadcast_shapes(tuple(xs[:-2]), tuple(ys[:-2]))
    return math.prod(batch) * _mm(xs[-2], xs[-1], ys[-1])


register_flops(aten.matmul, kind="matmul",
               backward=lambda a, kw, o, nd: (nd(0) + nd(1)) * _matmul(a[0], a[1]))(
    lambda a, kw, o, nd: _matmul(a[0], a[1]))


def _grouped_mm(a: torch.Tensor, b: torch.Tensor) -> int:
    """`aten._grouped_mm` (mixture-of-experts experts as one kernel): every group multiplies its rows by its own
    weight, so the FLOPs are those of one product over all rows. (M, K) x (G, K, N) with row offsets -> (M, N);
    (G, M, K) x (G, K, N) -> (G, M, N); (M, K_total) x (K_total, N) with offsets along K -> (G, M, N), each group
    contracting its own slice of K."""
    if a.dim() == 2 and b.dim() == 2:
        return _mm(a.shape[0], a.shape[1], b.shape[1])
    rows = math.prod(a.shape[:-1]) if a.dim() == 3 or b.dim() == 3 else a.shape[0]
    return _mm(rows, a.shape[-1], b.shape[-1])


register_flops(aten._grouped_mm, kind="matmul",
               backward=lambda a, kw, o, nd: (nd(0) + nd(1)) * _grouped_mm(a[0], a[1]))(
    lambda a, kw, o, nd: _grouped_mm(a[0], a[1]))
# transformers' own grouped product where `aten._grouped_mm` cannot run (fp32 weights): (S, K) x (G, K, N) with
# offsets, one product per group; its backward op computes both input gradients (two products of that size)
register_flops("transformers::grouped_mm_fallback", kind="matmul",
               backward=lambda a, kw, o, nd: (nd(0) + nd(1)) * _grouped_mm(a[0], a[1]))(
    lambda a, kw, o, nd: _grouped_mm(a[0], a[1]))
register_flops("transformers::grouped_mm_fallback_backward", kind="matmul")(
    lambda a, kw, o, nd: 2 * _grouped_mm(a[0], a[1]))


# ------------------------------------------------------------------------------------------------ convolution

def _conv(x_shape: Sequence[int], w_shape: Sequence[int], out_shape: Sequence[int], transposed: bool) -> int:
    # x (N, C_in, *spatial), w (C_out, C_in/groups, *kernel), out (N, C_out, *spatial_out)
    batch, c_out = out_shape[0], w_shape[0]
    kernel = math.prod(w_shape[2:])
    spatial = math.prod(x_shape[2:] if transposed else out_shape[2:])
    return 2 * batch * spatial * c_out * w_shape[1] * kernel


def _conv_args(a: Sequence[Any], out: Any) -> int:
    transposed = bool(a[6]) if len(a) > 6 else False
    return _conv(a[0].shape, a[1].shape, out.shape, transposed)


def _conv_bwd(a, kw, out, nd) -> int:
    return (nd(0) + nd(1)) * _conv_args(a, out)


register_flops(aten.convolution, aten._convolution, kind="conv", backward=_conv_bwd)(
    lambda a, kw, o, nd: _conv_args(a, o))


# the composite forms the planner's capture sees (input, weight, bias, stride, padding, dilation, groups): never
# transposed
register_flops(aten.conv1d, aten.conv2d, aten.conv3d, kind="conv",
               backward=lambda a, kw, o, nd: (nd(0) + nd(1)) * _conv(a[0].shape, a[1].shape, o.shape, False))(
    lambda a, kw, o, nd: _conv(a[0].shape, a[1].shape, o.shape, False))


@register_flops(aten.convolution_backward, kind="conv")
def _conv_backward_fwd(a, kw, out, nd) -> int:
    # (grad_out, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask)
    grad_out, x, w = a[0], a[1], a[2]
    mask = a[10]
    one = _conv(x.shape, w.shape, grad_out.shape, bool(a[7]))
    return (int(bool(mask[0])) + int(bool(mask[1]))) * one


# ------------------------------------------------------------------------------------------------ attention

def _attn_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> tuple[int, int, int, int, int]:
    """(batch*heads, s_q, s_k, d_qk, d_v) of query/key/value in layout "bhsd" or "bshd". Heads come from the
    query (grouped-query attention repeats key/value heads)."""
    if layout == "bhsd":
        b, h, s_q, d_qk = q.shape
        s_k, d_v = k.shape[-2], v.shape[-1]
    else:
        b, s_q, h, d_qk = q.shape
        s_k, d_v = k.shape[1], v.shape[-1]
    return b * h, s_q, s_k, d_qk, d_v


def _attn_fwd(bh: int, s_q: int, s_k: int, d_qk: int, d_v: int) -> int:
    return bh * (_mm(s_q, d_qk, s_k) + _mm(s_q, s_k, d_v))  # Q K^T, then P V


def _attn_bwd(bh: int, s_q: int, s_k: int, d_qk: int, d_v: int, *, grad_q: bool, grad_k: bool, grad_v: bool) -> int:
    total = 0
    if grad_v:
        total += bh * _mm(s_k, s_q, d_v)  # dV = P^T dO
    if grad_q or grad_k:
        total += bh * _mm(s_q, d_v, s_k)  # dP = dO V^T
    if grad_q:
        total += bh * _mm(s_q, s_k, d_qk)  # dQ = dS K
    if grad_k:
        total += bh * _mm(s_k, s_q, d_qk)  # dK = dS^T Q
    return total


def _attention_rules(layout: str, q_index: int) -> tuple[Formula, Formula, Formula]:
    def fwd(a, kw, out, nd) -> int:
        return _attn_fwd(*_attn_dims(a[q_index], a[q_index + 1], a[q_index + 2], layout))

    def bwd(a, kw, out, nd) -> int:
        i = q_index
        return _attn_bwd(*_attn_dims(a[i], a[i + 1], a[i + 2], layout), grad_q=nd(i), grad_k=nd(i + 1),
                         grad_v=nd(i + 2))

    def backward_op(a, kw, out, nd) -> int:  # a backward kernel computes all three gradients
        i = q_index
        return _attn_bwd(*_attn_dims(a[i], a[i + 1], a[i + 2], layout), grad_q=True, grad_k=True, grad_v=True)

    return fwd, bwd, backward_op


_fwd, _bwd, _ = _attention_rules("bhsd", 0)
register_flops(aten.scaled_dot_product_attention, aten._scaled_dot_product_attention_math,
               aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
               aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
               kind="attention", backward=_bwd)(_fwd)
_fwd, _bwd, _ = _attention_rules("bshd", 0)
register_flops(aten._flash_attention_forward, aten._efficient_attention_forward, kind="attention", backward=_bwd)(_fwd)
_, _, _bwd_op = _attention_rules("bhsd", 1)  # (grad_out, query, key, value, ...)
register_flops(aten._scaled_dot_product_flash_attention_for_cpu_backward,
               aten._scaled_dot_product_flash_attention_backward,
               aten._scaled_dot_product_efficient_attention_backward,
               aten._scaled_dot_product_cudnn_attention_backward, kind="attention")(_bwd_op)
_, _, _bwd_op = _attention_rules("bshd", 1)
register_flops(aten._flash_attention_backward, aten._efficient_attention_backward, kind="attention")(_bwd_op)


# ------------------------------------------------------------------------------------------------ zero-FLOP ops

register_zero(
    aten.view, aten._unsafe_view, aten.reshape, aten._reshape_alias, aten.expand, aten.expand_as, aten.permute,
    aten.transpose, aten.t, aten.select, aten.slice, aten.squeeze, aten.unsqueeze, aten.alias, aten.detach,
    aten.split, aten.split_with_sizes, aten.unbind, aten.chunk, aten.narrow, aten.as_strided, aten.diagonal,
    aten.flatten, aten.unflatten, aten.view_as, aten.lift_fresh, aten.contiguous, aten.lift_fresh_copy,
    aten._assert_tensor_metadata, aten._local_scalar_dense, aten.sym_size, aten.sym_numel, aten.sym_stride,
    aten.item, aten.is_same_size, operator.getitem, torch.ops.prim.device, torch.ops.prim.layout, kind="view")
register_zero(
    aten.arange, aten.zeros, aten.ones, aten.full, aten.empty, aten.empty_strided, aten.empty_like, aten.zeros_like,
    aten.ones_like, aten.full_like, aten.new_ones, aten.new_zeros, aten.new_empty, aten.new_full,
    aten.new_empty_strided, aten.scalar_tensor, aten.rand, aten.randn, aten.rand_like, aten.randn_like,
    aten.randint, aten.tril_indices, aten.triu_indices, kind="factory")
register_zero(
    aten.clone, aten._to_copy, aten.to, aten.copy_, aten.copy, aten.cat, aten.stack, aten.constant_pad_nd, aten.pad,
    aten.index, aten.index_select, aten.gather, aten.scatter, aten.scatter_add, aten.scatter_, aten.scatter_add_,
    aten.index_put, aten.index_put_, aten.index_copy, aten.index_copy_,
    aten.index_add, aten.embedding, aten.embedding_dense_backward, aten.slice_backward, aten.select_backward,
    aten.unsqueeze_copy, aten.masked_fill, aten.masked_fill_, aten.tril, aten.triu, aten.repeat,
    aten.repeat_interleave, aten.roll, aten.flip, aten.fill_, aten.zero_, aten.bernoulli_, aten.bernoulli,
    aten.native_dropout, aten.dropout, aten.native_dropout_backward, aten.diff, aten.type_as, aten.one_hot,
    aten.as_strided_scatter, aten.slice_scatter, aten.select_scatter, aten.diagonal_backward,
    aten.expand_copy, aten.permute_copy, aten.view_copy, aten.split_with_sizes_copy, kind="memory")
register_zero(
    aten._softmax, aten.softmax, aten._safe_softmax, aten._log_softmax, aten.log_softmax,
    aten._softmax_backward_data, aten._log_softmax_backward_data, aten.native_layer_norm, aten.layer_norm,
    aten.native_layer_norm_backward, aten.rms_norm, aten._fused_rms_norm, aten._fused_rms_norm_backward,
    aten.native_group_norm, aten.native_group_norm_backward, aten.group_norm, aten.native_batch_norm,
    aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional, aten.native_batch_norm_backward,
    aten.batch_norm, aten.nll_loss_forward, aten.nll_loss_backward, aten.nll_loss, aten.nll_loss_nd,
    aten.cross_entropy_loss, aten.mse_loss, aten.mse_loss_backward, aten.cumsum, aten.cumprod, aten.topk,
    aten.sort, aten.argmax, aten.argmin, aten.max, aten.min, aten.var_mean, aten.norm, aten.linalg_vector_norm,
    kind="reduction")
# pooling (CNNs: ResNet's stem max pool, the adaptive average pool before the head), forward and backward, and
# inference batch norm: windowed reductions, no products; priced by the bytes they read and write
register_zero(
    aten.max_pool1d, aten.max_pool2d, aten.max_pool2d_with_indices, aten.max_pool2d_with_indices_backward,
    aten.max_pool3d_with_indices, aten.max_pool3d_with_indices_backward, aten.avg_pool1d, aten.avg_pool2d,
    aten.avg_pool2d_backward, aten.avg_pool3d, aten.avg_pool3d_backward, aten.adaptive_avg_pool1d,
    aten.adaptive_avg_pool2d, aten._adaptive_avg_pool2d, aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d,
    aten._adaptive_avg_pool3d_backward, aten.adaptive_max_pool2d, aten.adaptive_max_pool2d_backward,
    aten._native_batch_norm_legit_no_training, kind="reduction")
register_zero(
    aten.where, aten.min.other, aten.__and__, aten.__or__, aten.bitwise_and, aten.bitwise_or, aten.gelu,
    aten.gelu_backward, aten.silu, aten.silu_backward, aten.relu, aten.threshold_backward,
    aten.floor_divide, aten.floor_divide_, kind="pointwise")
# complex rotary embeddings (Llama 4: `torch.polar` builds the frequencies, queries and keys are viewed as complex and
# multiplied): elementwise; the complex views move nothing
register_zero(aten.polar, kind="pointwise")
register_zero(aten.view_as_complex, aten.view_as_real, kind="view")
# data-dependent routing (mixture-of-experts: which tokens go to which expert): priced by the bytes they move
register_zero(aten.nonzero, aten.nonzero_static, aten.argwhere, aten.masked_select, aten.bincount, aten.histc,
              aten.unique_consecutive, aten._unique2, aten.searchsorted, aten.bucketize, kind="memory")
