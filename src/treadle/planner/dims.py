"""Sharding strategies of an op by the algebra of its dimensions (einsum style), one mesh axis at a time.

Each op is described by a `DimSpec`: one *letter* per dim of every tensor input and output (``mm`` is
``mk,kn->mn``; element-wise ops share letters, a broadcast dim of size 1 gets a letter of its own; a view
maps letters through the reshape). One general rule turns a DimSpec into the options on a mesh axis of
size n (NOTE [one-axis options]):

- *replicate*: every tensor whole, every rank does all the work;
- *shard letter L* (L divisible by n, not blocked): tensors holding L are ``Shard(position of L)``, the
  others ``Replicate``; if L is not in the output it is contracted and the output is ``Partial`` (sum),
  allowed only for letters the op sums over (matmul's k, ``sum``'s reduced dims); the work divides by n.
  An input without L whose output has L gets a *pending-sum gradient* (Megatron's "f": all-reduced in
  backward) — for a parameter that is the data-parallel gradient reduction.
- *Partial through*: ops linear in some inputs (add, views, casts, mul by a replicated tensor, matmul in
  one operand) take those inputs ``Partial`` and give a ``Partial`` output.

Placements are the codes of `treadle.placement`: ``R`` (-1) Replicate, ``P`` (-2) Partial (sum), ``d >= 0`` Shard(d).
Rules are registered per op name with `register_dims` in the one registry of sharding rules
(`treadle.sharding_rules`; duplicates rejected); the rules themselves are `dim_rules.py`. An op with no rule gets
replicate-only options and is listed by `unknown_ops`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from ..placement import P, R
from ..sharding_rules import dims_rule, register_dims  # noqa: F401  (register_dims: the rules' decorator)
from .capture import Node, TensorMeta

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DimSpec:
    """Letters per tensor input (aligned with `Node.inputs`) and per output; sizes of letters.

    `blocked`: letters never sharded (normalised, sliced, concatenated, gathered dims). `sum_letters`:
    contracted letters whose sharding yields a Partial output. `partial_in`: groups of input positions
    that may be Partial together (the op is linear in them), giving a Partial output. `vocab_letters`: class
    letters of a cross-entropy that a vocab-parallel loss may shard, leaving a complete (Replicate) output;
    the cost graph keeps that option only where the runtime can replace the loss (NOTE [loss head] in capture).
    """

    ins: list[tuple[int, ...] | None]
    outs: list[tuple[int, ...] | None]
    sizes: dict[int, int]
    blocked: set[int] = field(default_factory=set)
    sum_letters: set[int] = field(default_factory=set)
    partial_in: list[tuple[int, ...]] = field(default_factory=list)
    vocab_letters: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class AxisOption:
    """One way an op runs on one mesh axis: placement of each input and output, and its consequences.

    `letter`: the sharded letter (None for replicate / Partial-through). `work_split`: the op's work
    divides by the axis size. `grad_partial[i]`: input i's gradient is a pending sum on this axis.
    """

    letter: int | None
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    work_split: bool
    grad_partial: tuple[bool, ...]


DimRule = Callable[[Node, list[Node]], "DimSpec | None"]


def has_rule(op_name: str) -> bool:
    return dims_rule(op_name) is not None


# ----------------------------------------------------------------------------- helpers for rules
class _Letters:
    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}

    def new(self, size: int) -> int:
        k = len(self.sizes)
        self.sizes[k] = size
        return k

    def many(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.new(s) for s in shape)


def _meta(n: Node) -> TensorMeta | None:
    return n.out if isinstance(n.out, TensorMeta) else None


def _arg(node: Node, pos: int, name: str, default: Any = None) -> Any:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def _is_ref(a: Any) -> bool:
    return isinstance(a, tuple) and len(a) == 2 and a[0] == "node"


def _dim(d: int, rank: int) -> int:
    return d % rank if rank else 0


def _inputs_meta(node: Node, nodes: list[Node]) -> list[TensorMeta | None]:
    return [_meta(nodes[i]) for i in node.inputs]


def _broadcast(node: Node, nodes: list[Node], out_shape: tuple[int, ...], L: _Letters,
               out_letters: tuple[int, ...] | None = None) -> tuple[list, tuple[int, ...]]:
    """Letters of inputs aligned to the output from the right; size-1 broadcast dims get own letters."""
    ol = out_letters if out_letters is not None else L.many(out_shape)
    ins = []
    for m in _inputs_meta(node, nodes):
        if m is None:
            ins.append(None)
            continue
        r, q = len(out_shape), len(m.shape)
        if q > r:
            return [], ()
        letters = []
        for j, s in enumerate(m.shape):
            o = r - q + j
            letters.append(ol[o] if s == out_shape[o] else L.new(s))
        ins.append(tuple(letters))
    return ins, ol


# NOTE [blocked split]: a fused projection (GPT-2's q|k|v in one Conv1D) is split into k equal pieces along its
# output dim. Sharding that dim plainly would give rank 0 all of q; sharding it as k interleaved blocks
# (``shard(..., blocks=k)`` on the projection's weight and bias) gives every rank its part of q, of k and of v,
# so each piece comes out ``Shard(d)``. The planner keeps the plain placement codes and gives them the blocked
# meaning on the *chain* from the projection to the split: the split's input, back through single-user views
# that keep the dim whole, to the linear / addmm that makes it. `block_chains` lists those nodes; the cost
# graph refuses any layout change on them and a second tensor axis on the fused dim, and `to_schedule` emits
# ``blocks=k`` for the parameters the chain's linear reads. The split's size (``self.split_size``) is divided
# by ``shard_attr`` (NOTE [fixed view sizes] in planner/views.py).
_CHAIN_VIEWS = {"view", "reshape", "_unsafe_view", "alias", "contiguous", "clone", "_to_copy", "to"}
_CHAIN_MAKERS = {"linear", "addmm", "mm"}
_GROUPED_MAKERS = {"grouped_mm_fallback", "_grouped_mm"}


def _param_through_views(nodes: list[Node], j: int) -> bool:
    """Whether value j is a parameter, or a parameter through single-user views (an experts weight's transpose)."""
    while nodes[j].kind == "op" and nodes[j].op_name in _CHAIN_VIEWS | {"transpose", "permute", "t"} \
            and nodes[j].inputs and len(nodes[j].users) == 1:
        j = nodes[j].inputs[0]
    return nodes[j].kind == "param"


def split_blocks(node: Node, nodes: list[Node]) -> int:
    """k when `node` splits its input into k >= 2 equal pieces along the output dim of a linear that feeds it
    through a block chain (NOTE [blocked split]); else 0."""
    chain = block_chain(node, nodes)
    return chain[1] if chain else 0


def block_chain(node: Node, nodes: list[Node]) -> tuple[list[int], int] | None:
    """(chain node indices from the split's input back to the linear, k) for a blocked split, else None."""
    if node.op_name not in ("split", "split_with_sizes", "chunk") or not node.inputs:
        return None
    x = _meta(nodes[node.inputs[0]])
    if x is None or not x.shape:
        return None
    rank = len(x.shape)
    d = _dim(_arg(node, 2, "dim", 0), rank)
    size = _arg(node, 1, "split_size" if node.op_name == "split" else "chunks", None)
    if node.op_name == "chunk":
        k = size if isinstance(size, int) and size >= 2 and x.shape[d] % size == 0 else 0
    elif node.op_name == "split_with_sizes":
        k = len(size) if isinstance(size, (list, tuple)) and len(set(size)) == 1 and len(size) >= 2 else 0
    else:
        k = x.shape[d] // size if isinstance(size, int) and size > 0 and x.shape[d] % size == 0 else 0
    if k < 2 or d != rank - 1:
        return None
    chain: list[int] = []
    j = node.inputs[0]
    while True:
        src = nodes[j]
        m = _meta(src)
        if src.kind != "op" or m is None or not m.shape or m.shape[-1] != x.shape[d] or len(src.users) != 1:
            return None
        chain.append(j)
        if src.op_name in _GROUPED_MAKERS:
            # the experts' grouped product (rows, per-expert weights, offsets): the weights must be a parameter
            # read through views (its transpose), the offsets integers (NOTE [experts in the plan])
            ok = len(src.inputs) >= 2 and _param_through_views(nodes, src.inputs[1]) and all(
                (m := _meta(nodes[i])) is not None and not m.dtype.is_floating_point for i in src.inputs[2:])
            return (chain, k) if ok else None
        if src.op_name in _CHAIN_MAKERS:
            # only a parameter's shard can carry the blocked meaning (``shard(..., blocks=k)``): every operand
            # but the activation must be a parameter (an activation sharded plainly would be misread)
            act = 1 if src.op_name == "addmm" else 0
            ok = all(nodes[i].kind == "param" for pos, i in enumerate(src.inputs) if pos != act)
            return (chain, k) if ok and len(src.inputs) >= 2 else None
        if src.op_name not in _CHAIN_VIEWS or not src.inputs:
            return None
        j = src.inputs[0]


# ----------------------------------------------------------------------------- options
def dim_spec(node: Node, nodes: list[Node]) -> DimSpec | None:
    """The node's DimSpec, or None when no rule applies (replicate only)."""
    rule = dims_rule(node.op_name)
    if rule is None:
        return None
    try:
        return rule(node, nodes)
    except (IndexError, TypeError, KeyError, ValueError, AttributeError) as exc:  # malformed args: replicate only
        logger.debug("dims: rule for %s failed on node %s: %s", node.op_name, node.name, exc)
        return None


def unknown_ops(nodes: list[Node]) -> dict[str, int]:
    """Op names without a dimension rule (they run replicated), with counts."""
    out: dict[str, int] = {}
    for n in nodes:
        if n.kind == "op" and dims_rule(n.op_name) is None and n.op_name not in ("arange", "full", "zeros", "ones",
                                                                             "empty", "scalar_tensor",
                                                                             "new_ones", "new_zeros", "new_empty",
                                                                             "new_full", "randn", "rand"):
            out[n.op_name] = out.get(n.op_name, 0) + 1
    return out


def _n_outs(node: Node) -> int:
    return len(node.out) if isinstance(node.out, tuple) else 1


def replicate_option(node: Node) -> AxisOption:
    return AxisOption(None, tuple(R for _ in node.inputs), tuple(R for _ in range(_n_outs(node))), False,
                      tuple(False for _ in node.inputs))


def axis_options(node: Node, nodes: list[Node], spec: DimSpec | None, size: int,
                 *, used: dict[int, int] | None = None) -> list[AxisOption]:
    """Options of `node` on one mesh axis of `size` ranks (NOTE [one-axis options] in the module doc).

    `used` maps letters already sharded on earlier axes to their divisor, so divisibility is checked on
    the local size. The replicate option is always first.
    """
    opts = [replicate_option(node)]
    if spec is None or size == 1:
        return opts
    used = used or {}
    letters_out = {l for o in spec.outs if o is not None for l in o}
    letters_in = {l for t in spec.ins if t is not None for l in t}
    for letter in sorted(letters_in):  # a letter no input holds cannot be sharded (it would be a split)
        if letter in spec.blocked:
            continue
        local = spec.sizes[letter] // used.get(letter, 1)
        if local < size or local % size:
            continue
        contracted = letter not in letters_out
        if contracted and letter not in spec.sum_letters:
            continue
        ins = tuple(R if t is None or letter not in t else t.index(letter) for t in spec.ins)
        outs = tuple(R if o is None else (o.index(letter) if letter in o else (P if contracted else R))
                     for o in spec.outs)
        if not contracted and any(o is not None and letter not in o for o in spec.outs[:1]):
            continue
        grad_partial = tuple(t is not None and letter not in t and letter in letters_out for t in spec.ins)
        opts.append(AxisOption(letter, ins, outs, True, grad_partial))
    for letter in sorted(spec.vocab_letters):  # one axis only: the vocab-parallel loss reduces over one group
        local = spec.sizes[letter]
        if letter in used or local < size or local % size:
            continue
        ins = tuple(R if t is None or letter not in t else t.index(letter) for t in spec.ins)
        opts.append(AxisOption(letter, ins, tuple(R for _ in spec.outs), True, tuple(False for _ in spec.ins)))
    for group in spec.partial_in:
        ins = tuple(P if i in group else R for i in range(len(spec.ins)))
        outs = tuple(P if o is not None else R for o in spec.outs)
        opts.append(AxisOption(None, ins, outs, False, tuple(False for _ in spec.ins)))
    return opts


def strategies(node: Node, nodes: list[Node], spec: DimSpec | None,
               axis_sizes: tuple[int, ...]) -> list[tuple[AxisOption, ...]]:
    """All combinations of one option per axis (N-d mesh). A letter may be sharded on several axes
    (divisibility on the local size). Partial on one axis and Shard on another compose."""
    if not axis_sizes:
        return [()]
    result: list[tuple[AxisOption, ...]] = []

    def rec(k: int, chosen: tuple[AxisOption, ...], used: dict[int, int]) -> None:
        if k == len(axis_sizes):
            result.append(chosen)
            return
        for opt in axis_options(node, nodes, spec, axis_sizes[k], used=used):
            nxt = dict(used)
            if opt.letter is not None:
                nxt[opt.letter] = nxt.get(opt.letter, 1) * axis_sizes[k]
            rec(k + 1, chosen + (opt,), nxt)

    rec(0, (), {})
    return result


def product_placements(combo: tuple[AxisOption, ...], which: str, pos: int) -> tuple[int, ...]:
    """Placement tuple (one per axis) of input/output `pos` under a combination of axis options."""
    return tuple(getattr(o, which)[pos] for o in combo)


__all__ = ["R", "P", "DimSpec", "AxisOption", "register_dims", "dim_spec", "axis_options", "strategies",
           "unknown_ops", "replicate_option", "product_placements", "block_chain", "split_blocks"]
