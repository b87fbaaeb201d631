"""Layouts beyond the dimension algebra that the runtime can still execute: the vocab-parallel loss
(NOTE [vocab-parallel loss]) and sequence-parallel row shards (NOTE [sequence parallel]). A mixin of the
cost-graph builder (`cost_graph._Builder`, which provides the attributes its methods read) plus the plain
functions it shares with `to_schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .capture import CapturedGraph, Node, TensorMeta
from ..placement import P, R
from .dims import AxisOption, dim_spec

_SHAPE_ARG_OPS = {"view", "reshape", "_unsafe_view", "expand"}


@dataclass(frozen=True, slots=True)
class VocabCE:
    """A cross-entropy node the runtime can run vocab-parallel (NOTE [vocab-parallel loss]): the loss function
    `loss` (causal: labels shifted) of the model's output embedding `head`, replaced by
    `treadle.runtime.losses.VocabParallelLoss` when the node's class letter `letter` is sharded."""

    node: int
    letter: int
    head: str
    causal: bool
    chain: tuple[int, ...] = ()  # the loss function's ops between the head and the cross-entropy (cast, view)


# NOTE [vocab-parallel loss]: the logits (N, V) may stay sharded over the vocab on one tensor axis only when the
# model's loss is its ``loss_function`` applied to its output embedding (NOTE [loss head] in capture.py): the
# schedule then sets ``loss_function`` to `VocabParallelLoss`, which needs three all-reduces of (N,) fp32
# per-row scalars (max, sum of exp, target logit) in forward and none in backward (the gradient is local).
# The cross-entropy node is offered that option (`dims.DimSpec.vocab_letters`) only when its logits come from the
# head through ops outside every module (the loss function's own ops: cast, view) and its value is the
# graph's output; on the other tensor axes it stays replicated (the loss reads whole rows and global labels).


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

    def _find_vocab_ce(self) -> dict[int, VocabCE]:
        """NOTE [vocab-parallel loss]: the cross-entropy nodes whose class dim may stay sharded."""
        head = self.g.loss_head
        if head is None or not self.tp_axes:
            return {}
        out: dict[int, VocabCE] = {}
        for n in self.nodes:
            if n.kind != "op" or n.op_name != "cross_entropy_loss" or n.index not in self.g.outputs:
                continue
            if (_ce_arg(n, 2, "weight", None) is not None or _ce_arg(n, 3, "reduction", 1) != 1
                    or _ce_arg(n, 4, "ignore_index", -100) != -100 or _ce_arg(n, 5, "label_smoothing", 0.0) != 0.0):
                continue  # class weights, a sum, another ignore index or smoothing: not what VocabParallelLoss does
            j, chain = n.inputs[0], []
            while self.nodes[j].kind == "op" and self.nodes[j].module == "" and len(self.nodes[j].inputs) == 1:
                chain.append(j)
                j = self.nodes[j].inputs[0]
            if self.nodes[j].kind != "op" or self.nodes[j].module != head.head:
                continue
            spec = dim_spec(n, self.nodes)
            if spec is not None and spec.vocab_letters:
                out[n.index] = VocabCE(n.index, min(spec.vocab_letters), head.head, head.causal, tuple(chain))
        return out

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


def _ce_arg(n: Node, pos: int, name: str, default):
    return n.args[pos] if len(n.args) > pos else n.kwargs.get(name, default)


__all__ = ["VocabCE", "ExtraLayouts", "entry_block", "noop_cast"]
