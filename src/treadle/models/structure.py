"""Find the Megatron layout of a transformer block by data flow, for architectures no recipe names.

One block (the first of the model's stack) is captured with torch.export, its Linear-like leaves (nn.Linear,
transformers' Conv1D) kept as calls. Each leaf gets a *level*: 1 + the highest level among the leaves its
input depends on (the block's inputs are level 0). Megatron's split alternates: odd levels are
column-parallel (they read a replicated activation: q/k/v or a fused qkv, gate/up), even levels row-parallel
(they read what the level below produced, sharded: the attention output projection, the MLP down projection).
A sequential block (attention, then MLP) has levels 1-4; a parallel-residual block (GPT-J, NeoX, Phi) 1-2.

Heads shard with the projections: the attention module's integer attributes that count heads
(``num_heads``, ``num_attention_heads``, ``n_head``, ``num_key_value_heads``) are divided by the tp size
(`shard_attr`); modules that reshape with ``-1`` need nothing. A fused projection is split per head when its
output is first reshaped (heads outermost: NeoX, BLOOM), or in equal concatenated blocks when it is first
split along its last dim (GPT-2 style). Anything else is a ScheduleError naming what could not be recognised.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from ..errors import ScheduleError
from ..forms.tensor.leaf_rules import matmul_dims
from ..schedule.core import Schedule

logger = logging.getLogger(__name__)

HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "num_key_value_heads")


def linear_dims(mod: nn.Module) -> tuple[int, int, int, int] | None:
    """(out_features, in_features, weight dim of outputs, weight dim of inputs) of a Linear-like leaf: the tensor
    form's `matmul_dims`, the one statement of those dims."""
    return matmul_dims(mod)


@dataclass
class BlockLayout:
    """The tensor-parallel layout found for one block (paths relative to the block)."""

    levels: dict[str, int]
    columns: dict[str, int] = field(default_factory=dict)  # path -> blocks (1, or 3 for a concatenated q|k|v)
    rows: list[str] = field(default_factory=list)
    head_attrs: list[tuple[str, str]] = field(default_factory=list)  # (module path, attribute)
    attention: list[str] = field(default_factory=list)  # modules holding level-1 column leaves (dropout forks)
    # inputs of the block with one entry per head (ALiBi biases): (input name, dim, inner) for a split sync
    per_head_inputs: list[tuple[str, int, int]] = field(default_factory=list)


def _levels(gm: fx.GraphModule, leaves: set[str]) -> dict[str, int]:
    lvl: dict[fx.Node, int] = {}
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        base = max((lvl.get(i, 0) for i in n.all_input_nodes), default=0)
        if n.op == "call_module" and n.target in leaves:
            lvl[n] = base + 1
            out[n.target] = max(out.get(n.target, 0), base + 1)
        else:
            lvl[n] = base
    return out


def _first_consumer(gm: fx.GraphModule, target: str) -> str:
    """How the output of leaf `target` is first used: 'view' (reshape / view), 'split' (split / chunk / slice)."""
    for n in gm.graph.nodes:
        if n.op == "call_module" and n.target == target:
            todo = list(n.users)
            while todo:
                u = todo.pop(0)
                name = str(getattr(u.target, "__name__", u.target))
                if any(k in name for k in ("view", "reshape", "unflatten")):
                    return "view"
                if any(k in name for k in ("split", "chunk", "slice", "narrow")):
                    return "split"
                if "getitem" in name or "_tensor_leaves" in name:
                    todo.extend(u.users)
    return "other"


def find_block_layout(sch: Schedule, blocks: str, example_inputs: dict, tp_size: int) -> BlockLayout:
    """Capture block 0 of `blocks` on `example_inputs` (keyword inputs of the model) and find its layout.
    Raises ScheduleError naming what it could not recognise."""
    from ..graph.capture import capture_export, record_call

    block = sch[f"{blocks}.0"].mod
    where = f"megatron at sch[{blocks + '.0'!r}] ({type(block).__name__})"
    dims = {p: linear_dims(m) for p, m in block.named_modules() if p}
    leaves = {p for p, d in dims.items() if d is not None}
    if not leaves:
        raise ScheduleError(f"{where}: no Linear or Conv1D leaves in the block; nothing to shard")
    if any(p.is_meta for p in sch.model.parameters()):
        raise ScheduleError(f"{where}: finding the layout by data flow runs the model once; the model is on the "
                            f"meta device (use a recipe by name, or materialise it)")
    args, kwargs = record_call(sch.model, f"{blocks}.0", example_inputs)
    per_head = _per_head_inputs(sch, block, args, kwargs, where)
    gm = capture_export(block, sorted(leaves), args, kwargs, where=where, dynamic=False)
    levels = _levels(gm, leaves)
    unused = sorted(leaves - set(levels))
    if unused:
        raise ScheduleError(f"{where}: Linear leaves {unused} are not called on the block's data path")
    seen = sorted(set(levels.values()))
    if seen not in ([1, 2], [1, 2, 3, 4]):
        raise ScheduleError(f"{where}: could not recognise attention and MLP: the Linear leaves form levels {seen} "
                            f"of data flow ({ {p: levels[p] for p in sorted(levels)} }); Megatron needs column/row "
                            f"pairs (levels 1-2 for a parallel block, 1-4 for attention then MLP)")
    lay = BlockLayout(levels, per_head_inputs=per_head)
    cfg = getattr(sch.model, "config", None)
    hidden = getattr(cfg, "hidden_size", None)
    for p, lv in sorted(levels.items(), key=lambda kv: (kv[1], kv[0])):
        out_f, in_f, _, _ = dims[p]
        if lv % 2:
            blocks_n = 1
            if hidden and out_f == 3 * hidden and lv == 1:  # a fused q|k|v
                first = _first_consumer(gm, p)
                if first == "split":
                    blocks_n = 3
                elif first != "view":
                    raise ScheduleError(f"{where}: cannot tell how the fused projection {p!r} (out {out_f} = 3 x "
                                        f"hidden) is laid out: its output is neither reshaped into heads nor split")
            if out_f % (tp_size * blocks_n):
                raise ScheduleError(f"{where}: column-parallel {p!r} has {out_f} outputs, not divisible by tp size "
                                    f"{tp_size}" + (f" x {blocks_n} blocks" if blocks_n > 1 else ""))
            lay.columns[p] = blocks_n
        else:
            if in_f % tp_size:
                raise ScheduleError(f"{where}: row-parallel {p!r} has {in_f} inputs, not divisible by tp size {tp_size}")
            lay.rows.append(p)
    # the attention: parents of level-1 column leaves whose outputs meet again before a row (q and k at least)
    parents = sorted({p.rpartition(".")[0] for p, lv in levels.items() if lv == 1})
    for parent in parents:
        mod = block.get_submodule(parent) if parent else block
        kids = [p for p, lv in levels.items() if lv == 1 and p.rpartition(".")[0] == parent]
        attrs = [a for a in HEAD_ATTRS if isinstance(getattr(mod, a, None), int)]
        if len(kids) >= 2 or attrs or any(lay.columns[k] > 1 for k in kids) or any(
                dims[k][0] == 3 * (hidden or -1) for k in kids):
            lay.attention.append(parent)
            for a in attrs:
                v = getattr(mod, a)
                if v % tp_size:
                    raise ScheduleError(f"{where}: attribute {a} = {v} of {parent or '<block>'!r} does not divide by "
                                        f"tp size {tp_size}")
                lay.head_attrs.append((parent, a))
    for name in ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v % tp_size:
            raise ScheduleError(f"{where}: config.{name} = {v} does not divide by tp size {tp_size}")
    logger.info("megatron by structure: columns %s, rows %s, head attributes %s", lay.columns, lay.rows,
                lay.head_attrs)
    return lay


def _per_head_inputs(sch: Schedule, block: nn.Module, args: tuple, kwargs: dict, where: str
                     ) -> list[tuple[str, int, int]]:
    """Inputs of the block made outside it with one entry per attention head (BLOOM's ALiBi biases, batch x
    heads flattened in dim 0; or a (batch, heads, ...) tensor): each rank must see only its heads. Found on the
    one-sample example batch, by shape: dim 0 of size heads (flattened batch x heads) or dim 1 of size heads in
    a 4-d tensor, neither being the sequence. Returns (input name, dim, inner) for a ``split`` sync (inner =
    heads for the flattened form). A per-head tensor nested in a container input is a ScheduleError."""
    import inspect

    import torch.utils._pytree as pytree

    cfg = getattr(sch.model, "config", None)
    heads = next((getattr(cfg, n) for n in ("num_attention_heads", "n_head", "num_heads")
                  if isinstance(getattr(cfg, n, None), int)), None)
    if not heads or heads == 1:
        return []
    hidden = next((t for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t) and t.is_floating_point()
                   and t.dim() == 3), None)
    seq = hidden.shape[1] if hidden is not None else None
    if heads == seq:
        return []
    names = [p.name for p in inspect.signature(block.forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    top = [(names[i] if i < len(names) else i, a) for i, a in enumerate(args)] + list(kwargs.items())
    out = []
    for name, t in top:
        if torch.is_tensor(t) and t.dim() >= 2:
            if t.dim() == 4 and t.shape[1] == heads and t.shape[0] == 1:
                out.append((name, 1, 1))
            elif t.dim() == 3 and t.shape[0] == heads:
                out.append((name, 0, heads))
        elif not torch.is_tensor(t):
            for x in pytree.tree_leaves(t):
                if torch.is_tensor(x) and x.dim() >= 2 and x.shape[0] * (x.shape[1] if x.dim() > 3 else 1) == heads:
                    raise ScheduleError(f"{where}: input {name!r} holds a tensor of shape {tuple(x.shape)} with one "
                                        f"entry per attention head ({heads}) inside a container; it cannot be split "
                                        f"to the local heads, so this architecture needs a schedule written by hand")
    return out


def default_example_inputs(sch: Schedule) -> dict:
    """A small batch of token ids for models that take ``input_ids`` (zeros are valid ids), without a KV cache
    (a graph cannot hold one)."""
    import inspect

    out: dict = {"input_ids": torch.zeros(1, 7, dtype=torch.long)}  # 7: a sequence unlike a head count
    try:
        params = inspect.signature(sch.model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "use_cache" in params or any(q.kind == q.VAR_KEYWORD for q in params.values()):
        out["use_cache"] = False
    return out
