"""NOTE [fixed view sizes]: which reshape sizes a sharded op may meet, and which module attribute `shard_attr` must
divide for it (`view_attr_needs`); the exits of modules a cast does not change (`noop_cast`)."""

from __future__ import annotations

import torch

from .capture import CapturedGraph, Node, TensorMeta
from .dims import AxisOption


SHAPE_ARG_OPS = {"view", "reshape", "_unsafe_view", "expand"}  # ops whose second argument is the output's sizes


def noop_cast(graph: CapturedGraph, n: Node) -> bool:
    """A cast to the dtype its input has (``x.to(torch.float32)`` of a float32 `x`, as an RMSNorm does): eager
    returns `x` itself, so a user outside the module (the residual add) reads the module's input, not an exit."""
    if n.op_name not in ("to", "type_as") or not n.inputs or not isinstance(n.out, TensorMeta):
        return False
    x = graph.nodes[n.inputs[0]].out
    return isinstance(x, TensorMeta) and x == n.out


# NOTE [fixed view sizes]: a reshape in the graph shows concrete sizes, but eager code may compute a size from
# the local tensor (``x.shape[0]``, ``-1``: right on shards) or read it from a module attribute
# (``self.num_heads``: wrong on shards, silently). `AttrResolver(module_path, value)` says which: "ok" (no int
# attribute of the module holds that value), ("attr", name) (exactly one does: `shard_attr` divides it at
# build), "config" (no attribute does, but the model's config does), or "forbid" (several attributes do).
# A "config" size is taken as computed from the local tensor (HF attention reshapes with ``-1`` and
# ``x.shape``, `repeat_kv` expands with the key's own head count) unless the same call also holds a ``-1`` at
# another dim: a fixed head count read from the config there would make the ``-1`` absorb the shard (the
# sequence silently divided), so that case is refused. A fixed size read from the config anywhere else
# fails loudly on shards (numel mismatch in view / reshape, a non-1 dim in expand), never silently, except
# an expand whose local size is 1, which the planner does not guard. An attribute whose value sizes two or
# more dims of the call (``view(b, 16, 16, 16)`` with seq == heads == head_dim) cannot be told apart: the
# sharding is refused rather than dividing an attribute that may size another dim (`_broadcast_twin` settles
# the one case that can be: an expand's broadcast dim).
AttrResolver = "Callable[[str, int, str | None], str | tuple[str, str]]"  # (module path, size, prefer=name part)


def view_attr_needs(node: Node, combo: tuple[AxisOption, ...], axes: tuple[str, ...],
                    resolver) -> list[tuple[str, str]] | None:
    """(attribute, axis) pairs a sharded reshape needs (NOTE [fixed view sizes]); None if not expressible."""
    if node.op_name in ("split", "chunk", "split_with_sizes"):
        return _split_attr_needs(node, combo, axes, resolver)
    if node.op_name not in SHAPE_ARG_OPS or resolver is None or not combo or not isinstance(node.out, TensorMeta):
        return []
    sizes = node.args[1] if len(node.args) > 1 else None
    if not isinstance(sizes, (list, tuple)) or len(sizes) != len(node.out.shape):
        return []
    needs = []
    for axis, o in zip(axes, combo):
        d = o.outs[0]
        if d < 0 or o.letter is None:
            continue
        v = sizes[d]
        if not isinstance(v, int) or v < 0:
            continue  # -1 or a symbolic size: computed from the local tensor
        if _broadcast_twin(node, sizes, d):
            continue
        r = resolver(node.module, v)
        if r == "forbid" or r == "config" and any(x == -1 for k, x in enumerate(sizes) if k != d):
            return None
        if isinstance(r, tuple) and sum(x == v for x in sizes) > 1:
            return None  # the attribute may size another dim of the same value (seq == head_dim): refused
        if isinstance(r, tuple):
            needs.append((r[1], axis))
    return needs


def _broadcast_twin(node: Node, sizes, d: int) -> bool:
    """An ``expand`` whose sharded dim `d` is not broadcast (its input size is not 1) while another dim of the
    same call, broadcast from 1, takes the same size: the attribute holding that size sizes the broadcast dim
    (a broadcast size cannot be read from the input tensor; a non-broadcast one can, and must be on shards).
    HF `repeat_kv` when the kv groups equal the kv heads (Llama-2-70B: 8 and 8): ``expand(b, 8, n_rep=8, s, d)``
    with the kv heads sharded must not divide ``num_key_value_groups``. Were the sharded dim read from the same
    attribute too, the expand fails loudly on shards (a non-singleton size mismatch), never silently."""
    if node.op_name != "expand" or not node.fake_args or not isinstance(node.fake_args[0], torch.Tensor):
        return False
    src = node.fake_args[0].shape
    lead = len(sizes) - len(src)  # expand may prepend dims
    in_size = (lambda k: src[k - lead] if k >= lead else 1)
    if in_size(d) == 1:
        return False
    return any(k != d and x == sizes[d] and in_size(k) == 1 for k, x in enumerate(sizes))


def _split_attr_needs(node: Node, combo: tuple[AxisOption, ...], axes: tuple[str, ...],
                      resolver) -> list[tuple[str, str]] | None:
    """A blocked split (NOTE [blocked split] in dims.py) with its pieces sharded: the piece size must shrink
    too. A size no attribute holds is computed (``chunk(3)``, ``x.shape[-1] // 3``); one attribute is divided
    by ``shard_attr`` (several: the one named like ``split``); a size held only by the config, or by several
    attributes none of them named so, is refused."""
    if node.op_name != "split" or resolver is None or not combo:
        return []
    v = node.args[1] if len(node.args) > 1 else None
    d = _split_dim(node)
    needs = []
    for axis, o in zip(axes, combo):
        if o.letter is None or not o.outs or o.outs[0] != d or not isinstance(v, int):
            continue
        r = resolver(node.module, v, prefer="split")
        if r in ("forbid", "config"):
            return None
        if isinstance(r, tuple):
            needs.append((r[1], axis))
    return needs


def _split_dim(node: Node) -> int:
    meta = node.fake_args[0] if node.fake_args else None
    rank = meta.dim() if isinstance(meta, torch.Tensor) else 0
    d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return d % rank if rank else 0
