"""Sequence-parallel row shards in the planner: the layouts a module's exit may publish besides the dimension
algebra's (`extra_publishes`), the reshapes that may not see them (`fixed_row_view`), and the two-step
conversion where the residual stream enters the blocks (`conversion`).

NOTE [sequence parallel]: besides its raw layout and Replicate, a module's single exit may publish a (B, T, E)
activation split on its batch or sequence dim over a tensor axis: a pending sum by a reduce-scatter (the
row-parallel linear of Megatron's sequence parallelism), a replicated value by a local slice (forward free,
an all-gather of the gradient in backward; `treadle.cost.convert`). Norms, dropout and residual adds then
work on the shard, their replicated parameters' gradients reduced (`reduce_grads`), and a norm's exit
gathers its output back (all-gather forward, a local split of the complete gradient in backward; the
column-parallel consumer sums its input gradient, as without sequence parallelism). Such shards are made
at module exits only inside the repeated blocks; where the residual stream enters the blocks it is sliced at
the first block's input (``sync("fwd_pre", to=Shard(1))`` on that block, as the Megatron recipe does for
LLaMA; `entry_block`), never at an embedding's exit: the model's code between its embedding and its blocks
(positions, masks) reads the embedding's batch and sequence sizes, which the graph does not show. A pending
sum there (a vocab-parallel embedding) is all-reduced at its module's exit first, then sliced (two syncs; a
reduce-scatter at the exit would show the code in between a sliced sequence; `conversion`). The slice
takes the block's first positional input, which must be the value entering it. A reshape with a
literal batch or sequence size never sees such a shard (`fixed_row_view`): that size may be the global one.
"""

from __future__ import annotations

from ...placement import P, R
from ...planner.capture import CapturedGraph, Node, TensorMeta
from ...planner.views import SHAPE_ARG_OPS
from ...planner.dims import AxisOption


def entry_block(graph: CapturedGraph, node: Node) -> str | None:
    """The path of the repeated block instance that every user of `node` (itself outside the blocks) runs in,
    or None: where the residual stream enters the blocks (NOTE [sequence parallel])."""
    if node.block is not None or not node.users:
        return None
    blocks = {graph.nodes[u].block for u in node.users}
    if len(blocks) != 1 or None in blocks:
        return None
    return graph.blocks[blocks.pop()].path


def extra_publishes(b, n: Node, raw: tuple[int, ...], exitable: bool) -> list[tuple[int, ...]]:
    """NOTE [sequence parallel]: Shard(batch or sequence dim) layouts `n` may publish besides its raw layout
    and Replicate: at a module's exit inside the repeated blocks (a reduce-scatter of a pending sum, a local
    slice of a replicated value), or a local slice at the input of the block a value enters."""
    meta = n.out
    if (not isinstance(meta, TensorMeta) or len(meta.shape) != 3 or not meta.dtype.is_floating_point
            or not b.carry[n.index] or not b.tp_axes):
        return []
    if n.block is None:
        if entry_block(b.g, n) is None or any(p not in (R, P) for p in raw):
            return []  # a pending sum (a vocab-parallel embedding's) is reduced at the exit, then sliced
    elif not exitable:
        return []
    shape = list(b.local_dp_shape(n.index, meta.shape))
    for p, size in zip(raw, b.tp_sizes):
        if p >= 0:
            shape[p] //= size
    out = []
    for k, (p, size) in enumerate(zip(raw, b.tp_sizes)):
        if p == P or p == R:
            for d in (0, 1):
                if d not in raw and shape[d] % size == 0 and shape[d] >= size:
                    out.append(raw[:k] + (d,) + raw[k + 1:])
    return out


def fixed_row_view(b, n: Node, combo: tuple[AxisOption, ...]) -> bool:
    """A reshape with a literal size on a batch or sequence dim of a (B, T, E) activation split on a tensor
    axis: eager code may compute that size from another tensor (the global sequence length), so the shard
    cannot be expressed safely (NOTE [sequence parallel])."""
    if n.op_name not in SHAPE_ARG_OPS or not n.inputs:
        return False
    x = b.nodes[n.inputs[0]].out
    sizes = n.args[1] if len(n.args) > 1 else None
    if not isinstance(x, TensorMeta) or len(x.shape) != 3 or not isinstance(sizes, (list, tuple)):
        return False
    for o in combo:
        d = o.outs[0] if o.outs else R
        if o.ins[0] in (0, 1) and 0 <= d < len(sizes) and isinstance(sizes[d], int) and sizes[d] > 0:
            return True
    return False


def conversion(b, i: int, raw: tuple[int, ...], pub: tuple[int, ...]) -> tuple[float, float] | None:
    """A pending sum entering the blocks sharded (outside the blocks: the value a block's input slices) is reduced
    at its module's exit, then sliced at the first block's input: two syncs, priced as build runs them
    (forward, backward seconds); None for every other change of layout."""
    if b.nodes[i].block is not None or P not in raw or not any(p >= 0 for p in pub):
        return None
    meta = b.nodes[i].out
    shape = b.local_dp_shape(i, meta.shape)
    mid = tuple(R if r == P else r for r in raw)
    (f1, b1), (f2, b2) = (b.layout_change_s(shape, meta.dtype.itemsize, x, y) for x, y in ((raw, mid), (mid, pub)))
    return f1 + f2, b1 + b2
