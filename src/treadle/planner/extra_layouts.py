"""Layouts beyond the dimension algebra that the runtime can still execute: sequence-parallel row shards (NOTE
[sequence parallel]). A mixin of the
cost-graph builder (`cost_graph._Builder`, which provides the attributes its methods read) plus the plain
functions it shares with `to_schedule`.
"""

from __future__ import annotations

from .capture import CapturedGraph, Node, TensorMeta
from ..placement import P, R
from .dims import AxisOption

_SHAPE_ARG_OPS = {"view", "reshape", "_unsafe_view", "expand"}


# NOTE [sequence parallel]: besides its raw layout and Replicate, a module's single exit may publish a (B, T, E)
# activation split on its batch or sequence dim over a tensor axis: a pending sum by a reduce-scatter (the
# row-parallel linear of Megatron's sequence parallelism), a replicated value by a local slice (forward free,
# an all-gather of the gradient in backward; `treadle.cost.convert`). Norms, dropout and residual adds then
# work on the shard, their replicated parameters' gradients reduced (`reduce_grads`), and a norm's exit
# gathers its output back (all-gather forward, a local split of the complete gradient in backward; the
# column-parallel consumer sums its input gradient, as without sequence parallelism). Such shards are made
# at module exits only inside the repeated blocks; where the residual stream enters the blocks it is sliced at
# the first block's input (``sync("fwd_pre", to=Shard(1))`` on that block, as the Megatron recipe does for
# LLaMA; `entry_block`), never at an embedding's exit: the model's code between its embedding and its blocks
# (positions, masks) reads the embedding's batch and sequence sizes, which the graph does not show. A pending
# sum there (a vocab-parallel embedding) is all-reduced at its module's exit first, then sliced (two syncs; a
# reduce-scatter at the exit would show the code in between a sliced sequence; `_conversion`). The slice
# takes the block's first positional input, which must be the value entering it. A reshape with a
# literal batch or sequence size never sees such a shard (`_fixed_row_view`): that size may be the global one.


def entry_block(graph: CapturedGraph, node: Node) -> str | None:
    """The path of the repeated block instance that every user of `node` (itself outside the blocks) runs in,
    or None: where the residual stream enters the blocks (NOTE [sequence parallel])."""
    if node.block is not None or not node.users:
        return None
    blocks = {graph.nodes[u].block for u in node.users}
    if len(blocks) != 1 or None in blocks:
        return None
    return graph.blocks[blocks.pop()].path


def noop_cast(graph: CapturedGraph, n: Node) -> bool:
    """A cast to the dtype its input has (``x.to(torch.float32)`` of a float32 `x`, as an RMSNorm does): eager
    returns `x` itself, so a user outside the module (the residual add) reads the module's input, not an exit."""
    if n.op_name not in ("to", "type_as") or not n.inputs or not isinstance(n.out, TensorMeta):
        return False
    x = graph.nodes[n.inputs[0]].out
    return isinstance(x, TensorMeta) and x == n.out


class ExtraLayouts:
    """Methods of `cost_graph._Builder` for the layouts of this module."""

    def _row_publishes(self, n: Node, raw: tuple[int, ...], exitable: bool) -> list[tuple[int, ...]]:
        """NOTE [sequence parallel]: Shard(batch or sequence dim) layouts `n` may publish besides its raw layout
        and Replicate: at a module's exit inside the repeated blocks (a reduce-scatter of a pending sum, a local
        slice of a replicated value), or a local slice at the input of the block a value enters."""
        meta = n.out
        if (not isinstance(meta, TensorMeta) or len(meta.shape) != 3 or not meta.dtype.is_floating_point
                or not self.carry[n.index] or not self.tp_axes):
            return []
        if n.block is None:
            if entry_block(self.g, n) is None or any(p not in (R, P) for p in raw):
                return []  # a pending sum (a vocab-parallel embedding's) is reduced at the exit, then sliced
        elif not exitable:
            return []
        shape = list(self.local_dp_shape(n.index, meta.shape))
        for p, size in zip(raw, self.tp_sizes):
            if p >= 0:
                shape[p] //= size
        out = []
        for k, (p, size) in enumerate(zip(raw, self.tp_sizes)):
            if p == P or p == R:
                for d in (0, 1):
                    if d not in raw and shape[d] % size == 0 and shape[d] >= size:
                        out.append(raw[:k] + (d,) + raw[k + 1:])
        return out

    def _fixed_row_view(self, n: Node, combo: tuple[AxisOption, ...]) -> bool:
        """A reshape with a literal size on a batch or sequence dim of a (B, T, E) activation split on a tensor
        axis: eager code may compute that size from another tensor (the global sequence length), so the shard
        cannot be expressed safely (NOTE [sequence parallel])."""
        if n.op_name not in _SHAPE_ARG_OPS or not n.inputs:
            return False
        x = self.nodes[n.inputs[0]].out
        sizes = n.args[1] if len(n.args) > 1 else None
        if not isinstance(x, TensorMeta) or len(x.shape) != 3 or not isinstance(sizes, (list, tuple)):
            return False
        for o in combo:
            d = o.outs[0] if o.outs else R
            if o.ins[0] in (0, 1) and 0 <= d < len(sizes) and isinstance(sizes[d], int) and sizes[d] > 0:
                return True
        return False


__all__ = ["ExtraLayouts", "entry_block", "noop_cast"]
