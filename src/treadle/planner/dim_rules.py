"""The dimension rules of the ATen ops the planner knows, one per op family, registered in the one registry of
sharding rules (`treadle.sharding_rules.register_dims`). Each turns an op into its `DimSpec`: one letter per dim of
every tensor (NOTE [one-axis options] in `dims.py` says what the planner does with it)."""

from __future__ import annotations

import torch

from ..sharding_rules import register_dims
from .capture import Node, TensorMeta
from .dims import DimSpec, _arg, _broadcast, _dim, _inputs_meta, _is_ref, _Letters, _meta, split_blocks


_UNARY = ("neg", "silu", "gelu", "relu", "tanh", "sigmoid", "exp", "log", "rsqrt", "sqrt", "abs", "cos", "sin",
          "erf", "reciprocal", "square", "softplus", "to", "_to_copy", "clone", "contiguous", "alias", "detach",
          "lift_fresh_copy", "full_like", "zeros_like", "ones_like", "empty_like", "dropout", "gelu_", "relu_",
          "silu_", "tanh_", "log1p", "expm1", "sign", "floor", "ceil", "round", "logical_not", "bitwise_not",
          "isnan", "isinf", "hardtanh", "leaky_relu", "elu", "mish", "_log_softmax_backward_data", "fill_",
          "fill", "triu", "tril", "pow", "clamp", "clamp_min", "clamp_max", "nan_to_num", "bernoulli",
          "type_as", "mul", "div", "add", "sub", "rsub", "where", "masked_fill", "masked_fill_", "maximum",
          "minimum", "eq", "ne", "lt", "le", "gt", "ge", "__and__", "__or__", "bitwise_and", "bitwise_or",
          "logical_and", "logical_or", "add_", "mul_", "div_", "sub_", "copy_", "lerp", "addcmul", "addcdiv",
          "fmod", "remainder", "floor_divide", "atan2", "xlogy", "native_dropout")
_LINEAR_UNARY = {"neg", "to", "_to_copy", "clone", "contiguous", "alias", "detach", "type_as"}


@register_dims(*_UNARY)
def _elementwise(node: Node, nodes: list[Node]) -> DimSpec | None:
    out = node.out[0] if isinstance(node.out, tuple) else node.out
    if not isinstance(out, TensorMeta):
        return None
    L = _Letters()
    ins, ol = _broadcast(node, nodes, out.shape, L)
    if not ins and node.inputs:
        return None
    n_out = len(node.out) if isinstance(node.out, tuple) else 1
    outs = [ol if isinstance(o, TensorMeta) and o.shape == out.shape else None
            for o in (node.out if isinstance(node.out, tuple) else (node.out,))]
    outs = outs if n_out > 1 else [ol]
    name = node.op_name
    partial_in: list[tuple[int, ...]] = []
    tensor_pos = [i for i, x in enumerate(ins) if x is not None]
    if name in ("add", "sub", "add_", "sub_") and tensor_pos and _no_scalar_addend(node):
        partial_in.append(tuple(tensor_pos))
    elif name in ("mul", "mul_") and tensor_pos:
        partial_in.extend((i,) for i in tensor_pos)
    elif name in ("div", "div_") and tensor_pos:
        partial_in.append((tensor_pos[0],))
    elif name in _LINEAR_UNARY and len(tensor_pos) == 1:
        partial_in.append((tensor_pos[0],))
    return DimSpec(ins, outs, L.sizes, partial_in=partial_in)


def _no_scalar_addend(node: Node) -> bool:
    """add(P, scalar) would add the scalar on every rank: only tensor + tensor stays linear."""
    return sum(1 for a in node.args[:2] if _is_ref(a)) == 2


@register_dims("linear")
def _linear(node: Node, nodes: list[Node]) -> DimSpec | None:
    x, w = _meta(nodes[node.inputs[0]]), _meta(nodes[node.inputs[1]])
    if x is None or w is None or len(w.shape) != 2:
        return None
    L = _Letters()
    batch = L.many(x.shape[:-1])
    k, n = L.new(x.shape[-1]), L.new(w.shape[0])
    ins: list = [batch + (k,), (n, k)]
    if len(node.inputs) > 2:
        ins.append((n,))
    # a bias makes the op affine, so x cannot be Partial through it
    partial_in = [] if len(node.inputs) > 2 else [(0,)]
    return DimSpec(ins, [batch + (n,)], L.sizes, sum_letters={k}, partial_in=partial_in)


@register_dims("mm", "addmm", "bmm", "matmul", "baddbmm")
def _matmul(node: Node, nodes: list[Node]) -> DimSpec | None:
    metas = _inputs_meta(node, nodes)
    if node.op_name in ("addmm", "baddbmm"):
        bias, a, b = metas[0], metas[1], metas[2]
    else:
        bias, (a, b) = None, metas[:2]
    if a is None or b is None or len(a.shape) < 2 or len(b.shape) < 2 or len(a.shape) != len(b.shape):
        return None
    L = _Letters()
    batch = L.many(a.shape[:-2])
    m, k, n = L.new(a.shape[-2]), L.new(a.shape[-1]), L.new(b.shape[-1])
    out = batch + (m, n)
    ins: list = [batch + (m, k), batch + (k, n)]
    partial_in = [(0,), (1,)]
    if bias is not None:
        bl = []
        for j, s in enumerate(bias.shape):
            o = len(out) - len(bias.shape) + j
            bl.append(out[o] if s == (a.shape[:-2] + (a.shape[-2], b.shape[-1]))[o] else L.new(s))
        ins = [tuple(bl)] + ins
        partial_in = []
    return DimSpec(ins, [out], L.sizes, sum_letters={k}, partial_in=partial_in)


@register_dims("embedding")
def _embedding(node: Node, nodes: list[Node]) -> DimSpec | None:
    w, ids = _meta(nodes[node.inputs[0]]), _meta(nodes[node.inputs[1]]) if len(node.inputs) > 1 else None
    if w is None or ids is None:
        return None
    L = _Letters()
    idl = L.many(ids.shape)
    v, e = L.new(w.shape[0]), L.new(w.shape[1])
    # the vocab letter is "contracted" by the one-hot lookup: a vocab-sharded table gives a Partial output
    return DimSpec([(v, e), idl], [idl + (e,)], L.sizes, sum_letters={v})


@register_dims("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention")
def _sdpa(node: Node, nodes: list[Node]) -> DimSpec | None:
    metas = _inputs_meta(node, nodes)
    q, k, v = metas[:3]
    if q is None or k is None or v is None or len(q.shape) != 4:
        return None
    L = _Letters()
    b, h, s, d = L.many(q.shape)
    t, e = L.new(k.shape[2]), L.new(v.shape[3])
    # fewer key/value heads than query heads (``enable_gqa``): query head i reads kv head i // (H / K), so
    # both head dims share one letter (sharded together, `_divisible` checks K on the local shape); a kv head
    # dim replicated under sharded queries would pair each rank's queries with the wrong kv heads
    kh = h
    kb = b if k.shape[0] == q.shape[0] else L.new(k.shape[0])
    ins: list = [(b, h, s, d), (kb, kh, t, d), (kb, kh, t, e)]
    for m in metas[3:]:  # attention mask / bias, broadcast against (b, h, s, t)
        if m is None:
            ins.append(None)
            continue
        full = (b, h, s, t)
        sizes = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        ins.append(tuple(full[4 - len(m.shape) + j] if sz == sizes[4 - len(m.shape) + j] else L.new(sz)
                         for j, sz in enumerate(m.shape)))
    outs: list = [(b, h, s, e)]
    if isinstance(node.out, tuple):
        outs = [(b, h, s, e)] + [None] * (len(node.out) - 1)
    return DimSpec(ins, outs, L.sizes, blocked={s, d, t, e})


@register_dims("_softmax", "softmax", "_log_softmax", "log_softmax", "cumsum", "logsumexp")
def _softmax_like(node: Node, nodes: list[Node]) -> DimSpec | None:
    x = _meta(nodes[node.inputs[0]])
    if x is None:
        return None
    L = _Letters()
    xl = L.many(x.shape)
    dims = _arg(node, 1, "dim", -1)
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    blocked = {xl[_dim(d, len(x.shape))] for d in dims}
    if node.op_name == "logsumexp":
        keep = bool(_arg(node, 2, "keepdim", False))
        out = tuple(l if l not in blocked else L.new(1) for l in xl) if keep else \
            tuple(l for l in xl if l not in blocked)
        return DimSpec([xl], [out], L.sizes, blocked=blocked)
    return DimSpec([xl], [xl], L.sizes, blocked=blocked)


@register_dims("sum", "mean", "amax", "amin", "max", "min", "var", "std", "prod", "any", "all", "argmax",
               "argmin", "norm")
def _reduction(node: Node, nodes: list[Node]) -> DimSpec | None:
    x = _meta(nodes[node.inputs[0]])
    out = node.out[0] if isinstance(node.out, tuple) else node.out
    if x is None or not isinstance(out, TensorMeta):
        return None
    L = _Letters()
    xl = L.many(x.shape)
    dims = _arg(node, 1, "dim", None)
    if dims is None or _is_ref(dims):
        dims = list(range(len(x.shape)))
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    if not dims:
        dims = list(range(len(x.shape)))
    red = {_dim(d, len(x.shape)) for d in dims}
    keep = len(out.shape) == len(x.shape)
    ol = tuple((L.new(1) if j in red else l) for j, l in enumerate(xl)) if keep else \
        tuple(l for j, l in enumerate(xl) if j not in red)
    reduced = {xl[j] for j in red}
    n_out = len(node.out) if isinstance(node.out, tuple) else 1
    outs = [ol] * n_out if n_out > 1 and node.op_name in ("max", "min") else [ol] + [None] * (n_out - 1)
    if node.op_name == "sum":
        return DimSpec([xl], outs, L.sizes, sum_letters=reduced, partial_in=[(0,)])
    return DimSpec([xl], outs, L.sizes, blocked=reduced)


@register_dims("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm")
def _norm(node: Node, nodes: list[Node]) -> DimSpec | None:
    metas = _inputs_meta(node, nodes)
    x = metas[0]
    if x is None:
        return None
    shape_arg = _arg(node, 1, "normalized_shape", [x.shape[-1]])
    nd = len(shape_arg) if isinstance(shape_arg, (list, tuple)) else 1
    L = _Letters()
    xl = L.many(x.shape)
    normed = xl[len(xl) - nd:]
    ins = [xl] + [normed if m is not None else None for m in metas[1:]]
    outs: list = [xl]
    if isinstance(node.out, tuple):
        outs = [xl] + [None] * (len(node.out) - 1)
    return DimSpec(ins, outs, L.sizes, blocked=set(normed))


@register_dims("cross_entropy_loss", "nll_loss", "nll_loss_nd")
def _cross_entropy(node: Node, nodes: list[Node]) -> DimSpec | None:
    x, tgt = _inputs_meta(node, nodes)[:2]
    if x is None or tgt is None or len(x.shape) != 2:
        return None
    L = _Letters()
    nl, c = L.new(x.shape[0]), L.new(x.shape[1])
    reduction = _arg(node, 3, "reduction", 1)
    ins: list = [(nl, c), (nl,)] + [None] * (len(node.inputs) - 2)
    if reduction == 0:  # 'none': per-row losses keep the row dim
        return DimSpec(ins, [(nl,)], L.sizes, blocked={c})
    # a mean over rows is a sum of row shards divided by the (global) count: row shards give Partial; the
    # class dim only by a vocab-parallel loss (complete output, a few all-reduces of per-row scalars)
    return DimSpec(ins, [()], L.sizes, blocked={c}, sum_letters={nl}, vocab_letters={c})


@register_dims("transpose", "t", "permute", "numpy_T", "swapaxes")
def _permute(node: Node, nodes: list[Node]) -> DimSpec | None:
    x = _meta(nodes[node.inputs[0]])
    if x is None:
        return None
    L = _Letters()
    xl = L.many(x.shape)
    r = len(x.shape)
    if node.op_name == "permute":
        order = [_dim(d, r) for d in _arg(node, 1, "dims")]
    elif node.op_name in ("t", "numpy_T"):
        order = list(reversed(range(r)))
    else:
        a, b = _dim(_arg(node, 1, "dim0"), r), _dim(_arg(node, 2, "dim1"), r)
        order = list(range(r))
        order[a], order[b] = order[b], order[a]
    return DimSpec([xl], [tuple(xl[o] for o in order)], L.sizes, partial_in=[(0,)])


@register_dims("unsqueeze", "squeeze", "expand", "view", "reshape", "_unsafe_view", "flatten", "unflatten",
               "expand_as", "view_as", "reshape_as")
def _view(node: Node, nodes: list[Node]) -> DimSpec | None:
    """Map letters through a reshape: dims group where running products meet; the leading non-1 dim of an
    input group maps to the leading non-1 dim of its output group (the only dim that can stay sharded)."""
    x = _meta(nodes[node.inputs[0]])
    out = node.out if isinstance(node.out, TensorMeta) else None
    if x is None or out is None:
        return None
    L = _Letters()
    xl = L.many(x.shape)
    if node.op_name in ("expand", "expand_as"):
        r, q = len(out.shape), len(x.shape)
        ol = tuple(L.new(s) for s in out.shape[: r - q]) + tuple(
            xl[j] if x.shape[j] == out.shape[r - q + j] else L.new(out.shape[r - q + j]) for j in range(q))
        blocked = {l for l in ol if l not in xl}
        return DimSpec([xl] + [None] * (len(node.inputs) - 1), [ol], L.sizes, blocked=blocked, partial_in=[(0,)])
    ol_list: list[int | None] = [None] * len(out.shape)
    blocked: set[int] = set()
    i = j = 0
    xs, os_ = x.shape, out.shape
    while i < len(xs) or j < len(os_):
        gi, gj = [i], [j]
        pi = xs[i] if i < len(xs) else 1
        pj = os_[j] if j < len(os_) else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(xs):
                pi *= xs[i]; gi.append(i); i += 1
            elif j < len(os_):
                pj *= os_[j]; gj.append(j); j += 1
            else:
                return None
        gi = [a for a in gi if a < len(xs)]
        gj = [b for b in gj if b < len(os_)]
        lead_i = next((a for a in gi if xs[a] != 1), None)
        lead_j = next((b for b in gj if os_[b] != 1), None)
        for b in gj:
            if b == lead_j and lead_i is not None:
                ol_list[b] = xl[lead_i]
            else:
                ol_list[b] = L.new(os_[b])
        for a in gi:
            if a != lead_i:
                blocked.add(xl[a])
        if lead_i is not None and lead_j is not None and xs[lead_i] != os_[lead_j]:
            # the sharded leading dim splits or merges: it survives only if its shard is a whole
            # multiple of the following dims; checked per axis size by `_view_ok`
            L.sizes[xl[lead_i]] = min(xs[lead_i], os_[lead_j])
    return DimSpec([xl] + [None] * (len(node.inputs) - 1), [tuple(ol_list)], L.sizes, blocked=blocked,
                   partial_in=[(0,)])


@register_dims("slice", "narrow", "select", "index_select", "gather", "split", "split_with_sizes",
               "chunk", "unbind", "cat", "stack", "pad", "constant_pad_nd", "roll", "flip", "diff", "repeat",
               "repeat_interleave", "masked_select", "index_put", "scatter", "scatter_add")
def _dim_op(node: Node, nodes: list[Node]) -> DimSpec | None:
    """Ops that work along one dim (slice, cat, split, gather...): that dim cannot be sharded."""
    metas = _inputs_meta(node, nodes)
    x = metas[0]
    outs_meta = node.out if isinstance(node.out, tuple) else (node.out,)
    if x is None:
        return None
    name = node.op_name
    rank = len(x.shape)
    if name in ("cat", "stack"):
        dim = _arg(node, 1, "dim", 0)
        # cat skips 1-d empty tensors (a KV cache's first update: ``cat([tensor([]), k], dim=-2)``): they hold
        # no letters and stay replicated
        empty = [m is not None and m.shape == (0,) for m in metas]
        real = [m for m, e in zip(metas, empty) if not e]
        if name == "stack" or not real or any(m is None or len(m.shape) != len(real[0].shape) for m in real):
            return None
        x = real[0]
        rank = len(x.shape)
        L = _Letters()
        xl = L.many(x.shape)
        d = _dim(dim, rank)
        ins = [None if e else tuple(L.new(s) if j == d else xl[j] for j, s in enumerate(m.shape))
               for m, e in zip(metas, empty)]
        out = outs_meta[0]
        ol = tuple(L.new(s) if j == d else xl[j] for j, s in enumerate(out.shape))
        return DimSpec(ins, [ol], L.sizes, blocked={l for t in ins if t for l in t if l not in xl} | {ol[d], xl[d]},
                       partial_in=[tuple(i for i, e in enumerate(empty) if not e)])
    if name in ("index_put", "masked_select", "index_select", "gather", "scatter", "scatter_add",
                "repeat", "repeat_interleave", "pad", "constant_pad_nd", "diff", "unbind"):
        return None  # shape changes that need more than one dim: replicate only
    if name == "select":
        d = _dim(_arg(node, 1, "dim"), rank)
    else:
        d = _dim(_arg(node, 1, "dim", 0), rank) if name not in ("split", "split_with_sizes", "chunk") \
            else _dim(_arg(node, 2, "dim", 0), rank)
    if name in ("roll", "flip"):
        dims = _arg(node, 2 if name == "roll" else 1, "dims", [0])
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        L = _Letters()
        xl = L.many(x.shape)
        return DimSpec([xl], [xl], L.sizes, blocked={xl[_dim(a, rank)] for a in dims})
    L = _Letters()
    xl = L.many(x.shape)
    k = split_blocks(node, nodes)
    if k:  # NOTE [blocked split]: every piece is sharded like the fused dim, one letter for all
        L.sizes[xl[d]] = x.shape[d] // k
        outs = [xl if isinstance(o, TensorMeta) else None for o in outs_meta]
        return DimSpec([xl] + [None] * (len(node.inputs) - 1), outs, L.sizes, partial_in=[(0,)])
    outs = []
    for o in outs_meta:
        if not isinstance(o, TensorMeta):
            outs.append(None)
            continue
        if name == "select":
            outs.append(tuple(l for j, l in enumerate(xl) if j != d))
        else:
            outs.append(tuple(L.new(o.shape[j]) if j == d else xl[j] for j in range(rank)))
    ins: list = [xl] + [None] * (len(node.inputs) - 1)
    return DimSpec(ins, outs, L.sizes, blocked={xl[d]}, partial_in=[(0,)])


@register_dims("index")
def _index(node: Node, nodes: list[Node]) -> DimSpec | None:
    """``x[idx]`` with one index tensor on dim 0 (a row gather: the experts' routed rows, their results put back
    in token order): the indexed dim and the index's dims never shard; x's other dims keep their letters; the
    gather is linear in x, so a pending sum passes through. Other index forms: replicate only."""
    x = _meta(nodes[node.inputs[0]]) if node.inputs else None
    indices = _arg(node, 1, "indices")
    out = _meta(node)
    if x is None or out is None or not isinstance(indices, (list, tuple)) or len(indices) != 1 \
            or not _is_ref(indices[0]) or len(node.inputs) != 2:
        return None
    idx = _meta(nodes[indices[0][1]])
    if idx is None or idx.dtype.is_floating_point or idx.dtype == torch.bool or not x.shape \
            or out.shape != tuple(idx.shape) + tuple(x.shape[1:]):
        return None
    L = _Letters()
    xl = L.many(x.shape)
    il = L.many(idx.shape)
    return DimSpec([xl, il], [il + xl[1:]], L.sizes, blocked={xl[0], *il}, partial_in=[(0,)])


_GROUPED_MM = ("grouped_mm_fallback", "_grouped_mm")


@register_dims(*_GROUPED_MM)
def _grouped_mm(node: Node, nodes: list[Node]) -> DimSpec | None:
    """The experts' grouped product: rows (M, K) grouped by offsets times one (K, N) matrix per group (G, K, N)
    -> (M, N), or batched (G, M, K) x (G, K, N). N shards like a column-parallel linear, K gives a pending sum
    like a row-parallel one; the rows and the groups never shard (the offsets index them). Linear in each
    operand."""
    metas = _inputs_meta(node, nodes)
    if len(metas) < 2 or metas[0] is None or metas[1] is None or len(metas[1].shape) != 3 \
            or any(m is not None and m.dtype.is_floating_point for m in metas[2:]):
        return None
    a, w = metas[0], metas[1]
    L = _Letters()
    g, k, n = L.many(w.shape)
    if len(a.shape) == 2:
        m = L.new(a.shape[0])
        ins: list = [(m, k), (g, k, n)]
        out = (m, n)
    elif len(a.shape) == 3 and a.shape[0] == w.shape[0]:
        m = L.new(a.shape[1])
        ins, out = [(g, m, k), (g, k, n)], (g, m, n)
    else:
        return None
    ins += [None if x is None else L.many(x.shape) for x in metas[2:]]
    blocked = {g, m} | {l for t in ins[2:] if t for l in t}
    return DimSpec(ins, [out], L.sizes, blocked=blocked, sum_letters={k}, partial_in=[(0,), (1,)])


@register_dims("getitem")
def _getitem(node: Node, nodes: list[Node]) -> DimSpec | None:
    """A piece of a split into equal pieces reads the layout of the split's (first) output: identity. Other
    tuple producers publish their first output's layout only, so their pieces stay replicated."""
    src = nodes[node.inputs[0]] if node.inputs else None
    out = _meta(node)
    if src is None or out is None or src.op_name not in ("split", "split_with_sizes", "chunk"):
        return None
    if not isinstance(src.out, tuple) or any(not isinstance(o, TensorMeta) or o.shape != out.shape for o in src.out):
        return None
    L = _Letters()
    ol = L.many(out.shape)
    return DimSpec([ol], [ol], L.sizes, partial_in=[(0,)])


# ------------------------------------------------------------------------------------------- convolutional nets
# Activations are (N, C, *spatial). Spatial dims never shard (a window would need its neighbours' rows); a
# convolution's output channels shard like a column-parallel Linear, its input channels (groups=1, no bias) give a
# Partial output like a row-parallel one; a batch norm in training normalises over N and the spatial dims, so only
# its channels shard (NOTE [batch statistics] in treadle.forms.data.facts).
@register_dims("conv1d", "conv2d", "conv3d")
def _conv(node: Node, nodes: list[Node]) -> DimSpec | None:
    x, w = _meta(nodes[node.inputs[0]]), _meta(nodes[node.inputs[1]])
    out = node.out[0] if isinstance(node.out, tuple) else node.out
    if x is None or w is None or not isinstance(out, TensorMeta) or len(w.shape) < 3 or len(x.shape) != len(w.shape):
        return None
    L = _Letters()
    n, c = L.new(x.shape[0]), L.new(x.shape[1])
    sp_in, o = L.many(x.shape[2:]), L.new(w.shape[0])
    grouped = _arg(node, 6, "groups", 1) != 1
    wc = L.new(w.shape[1]) if grouped else c
    kernel, sp_out = L.many(w.shape[2:]), L.many(out.shape[2:])
    bias = len(node.inputs) > 2
    ins: list = [(n, c) + sp_in, (o, wc) + kernel] + ([(o,)] if bias else [])
    blocked = set(sp_in) | set(kernel) | set(sp_out) | ({c, o, wc} if grouped else set()) | ({c} if bias else set())
    return DimSpec(ins, [(n, o) + sp_out], L.sizes, blocked=blocked, sum_letters=set() if grouped or bias else {c},
                   partial_in=[] if bias else [(0,)])


@register_dims("batch_norm")
def _batch_norm(node: Node, nodes: list[Node]) -> DimSpec | None:
    x = _meta(nodes[node.inputs[0]])
    if x is None or len(x.shape) < 2:
        return None
    L = _Letters()
    xl = L.many(x.shape)
    ins = [xl] + [(xl[1],) for _ in node.inputs[1:]]  # weight, bias, running mean / var: per channel
    training = _arg(node, 5, "training", True)
    blocked = {xl[0], *xl[2:]} if training else set(xl[2:])
    return DimSpec(ins, [xl], L.sizes, blocked=blocked)


@register_dims("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
               "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
               "adaptive_max_pool2d")
def _pool(node: Node, nodes: list[Node]) -> DimSpec | None:
    x = _meta(nodes[node.inputs[0]])
    outs_meta = node.out if isinstance(node.out, tuple) else (node.out,)
    if x is None or len(x.shape) < 3 or not all(isinstance(o, TensorMeta) for o in outs_meta):
        return None
    L = _Letters()
    n, c = L.new(x.shape[0]), L.new(x.shape[1])
    sp_in, sp_out = L.many(x.shape[2:]), L.many(outs_meta[0].shape[2:])
    linear = "avg" in node.op_name  # an average of a pending sum is the pending sum of the averages
    return DimSpec([(n, c) + sp_in], [(n, c) + sp_out for _ in outs_meta], L.sizes, blocked=set(sp_in) | set(sp_out),
                   partial_in=[(0,)] if linear else [])
