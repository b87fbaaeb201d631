"""Kernel schedules by data flow, for blocks no named schedule knows (NOTE [kernels by data flow]): the residual +
norm and MLP activation regions found in each block's graph, fused with the compiler, and eager attention cores put
on SDPA (NOTE [attention by data flow]), each skip reported."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ScheduleError
from ..graph.pattern import canonical_op
from ..schedule.core import Schedule
from .regions import _BIAS_ACTS, fuse_residual_norm, geglu, geglu_tanh, probe_activation, probe_norm, swiglu

logger = logging.getLogger(__name__)


# NOTE [kernels by data flow]: for a block no named schedule knows, the regions worth one fused kernel are found in
# its graph, not by module names. The block is traced (its children stay leaves) and each child that computes a
# norm (`probe_norm`: LayerNorm, or an F.rms_norm of its weight, checked numerically) and reads a residual sum
# made in the block gets ``add -> norm`` fused; then each child holding an activation leaf (`probe_activation`)
# is traced and its gated product (``act(gate) * up``) fused, or else each Linear whose output feeds the
# activation is decomposed and ``act(x + bias)`` fused. Attention is not replaced by data flow: a block whose
# graph already calls scaled_dot_product_attention (transformers' default) says so. Everything that does not
# match is reported and left as the model wrote it; every region keeps its numbers (verified).
def data_flow_kernels(sch: Schedule, blocks: str, *, example_inputs: dict[str, Any], compiler: str = "inductor",
                      fuse_mlp: bool = True, fuse_norm: bool = True, attention: bool = True,
                      report: list[str] | None = None) -> Schedule:
    """Fuse what the data flow of each block of `blocks` offers (NOTE [kernels by data flow]) and put its eager
    attention cores on SDPA (NOTE [attention by data flow]); returns `sch`.
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
        attn = [n for n, c in block.named_children() if n not in acts and _attention_like(c)] if attention else []
        if norms and fuse_norm or at_block or attention and not attn:  # the block's own graph
            try:
                sch[b].trace(example_inputs=example_inputs)
            except ScheduleError as e:
                lines.append(f"{b}: skipped (its graph cannot be captured: {str(e)[:160]})")
                continue
            if attention and not attn:  # attention written in the block's own forward
                done.append(_sdpa_attention(sch, b, example_inputs=example_inputs))
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
        for n in attn:
            what = _sdpa_attention(sch, f"{b}.{n}", example_inputs=example_inputs)
            (done if "SDPA" in what else skipped).append(f"{n}: {what}")
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


def _attention_like(m: nn.Module) -> bool:
    """A module whose own children hold two or more Linear-like leaves and no activation (q/k/v/o projections)."""
    from ..forms.tensor.leaf_rules import matmul_dims

    kids = list(m.children())
    return sum(matmul_dims(c) is not None for c in kids) >= 2 and not any(probe_activation(c) for c in kids)


def _traced(sch: Schedule, path: str, example_inputs: dict[str, Any]) -> tuple[Schedule, str]:
    """The sub-schedule at `path`, traced (unless it is); and why not, when its graph cannot be captured."""
    mod = sch[path]
    if not isinstance(mod.mod, torch.fx.GraphModule):
        try:
            mod.trace(example_inputs=example_inputs)
        except ScheduleError as e:
            return mod, f"its graph cannot be captured ({str(e)[:120]})"
    return mod, ""


def _sdpa_attention(sch: Schedule, path: str, *, example_inputs: dict[str, Any]) -> str:
    """Trace the module at `path` (unless it is) and put each eager attention core of its graph on SDPA."""
    mod, why = _traced(sch, path, example_inputs)
    if why:
        return why
    if any(canonical_op(n) == "scaled_dot_product_attention" for n in mod.mod.graph.nodes):
        return "attention already SDPA"
    cores = attention_cores(mod.mod, unread=_unread_outputs(sch, path))
    for spec, new in cores:
        mod.replace_match(new, spec)
    return f"{len(cores)} attention core(s) on SDPA" if cores else "no eager attention core in its graph"


def _unread_outputs(sch: Schedule, path: str) -> set:
    """Nodes of the traced module at `path` that its output returns only at positions its traced parent never
    reads (transformers' eager attention returns its probabilities beside its output; the block drops them).
    Empty when the parent is not traced or may read every output."""
    parent, _, name = path.rpartition(".")
    pgm, gm = sch[parent].mod if parent else sch.model, sch[path].mod
    if not isinstance(pgm, torch.fx.GraphModule):
        return set()
    calls = [n for n in pgm.graph.nodes if n.op == "call_module" and n.target == name]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = out.args[0]
    if not isinstance(vals, (tuple, list)) or not calls or not all(isinstance(v, torch.fx.Node) for v in vals):
        return set()
    read: set[int] = set()  # positions in the output tuple (= tensor leaves: every entry is a tensor)
    for c in calls:
        users = list(c.users)
        if len(users) == 1 and "_tensor_leaves" in str(users[0].target):  # the capture's flattening of outputs
            users = list(users[0].users)
        for u in users:
            if u.op == "call_function" and "getitem" in str(u.target) and isinstance(u.args[1], int):
                if u.users:
                    read.add(u.args[1])
            else:
                return set()  # the whole output is read
    return {v for i, v in enumerate(vals) if i not in read} - {v for i, v in enumerate(vals) if i in read}


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
    mod, why = _traced(sch, path, example_inputs)
    if why:
        return why
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


# ------------------------------------------------------------------------------------------ attention
# NOTE [attention by data flow]: the eager attention core, ``matmul(dropout(softmax(matmul(q, k^T) * scale + mask)),
# v)``, is found in a traced module's graph by walking from each softmax over the last dim: backwards through an
# additive mask (``+ mask``) or a filled one (``masked_fill(scores, fill, value)``), a scalar scale (``* c`` or
# ``/ c``) and the scores' ``matmul(q, k.transpose(-2, -1))``; forwards through a dtype cast and a dropout to the
# ``matmul(probs, v)``. It becomes one `SdpaCore` (``F.scaled_dot_product_attention`` with that scale and mask), fed
# the same q, k, v (after any GQA repeat) and mask. A dropout with p > 0 is left alone: SDPA would draw another mask.
class SdpaCore(nn.Module):
    """``softmax(q @ k^T * scale + mask) @ v`` as one ``F.scaled_dot_product_attention``. `filled`: `mask` is a
    boolean "fill here" tensor of ``masked_fill`` (SDPA's boolean mask keeps where True: its negation).
    `returns_probs`: also return None where the eager code returned the probabilities nobody reads."""

    def __init__(self, scale: float, filled: bool = False, returns_probs: bool = False):
        super().__init__()
        self.scale, self.filled, self.returns_probs = float(scale), bool(filled), bool(returns_probs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
        if mask is not None and self.filled:
            mask = ~mask.bool()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return (out, None) if self.returns_probs else out


def _const(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def attention_cores(gm: torch.fx.GraphModule, unread: set = frozenset()) -> list[tuple[dict, SdpaCore]]:
    """(match spec, replacement) for each eager attention core of `gm` (NOTE [attention by data flow]). The
    probabilities may also be returned by `gm` where its caller never reads them (`unread`: such output nodes):
    the replacement then returns None there, as transformers' SDPA attention does."""
    found = []
    for s in gm.graph.nodes:
        if canonical_op(s) != "softmax" or s.args[1] not in (-1, _ndim(s) - 1):
            continue
        nodes = [s] + [u for u in s.users if "assert" in str(u.target)]
        x, mask, filled, scale = s.args[0], None, False, 1.0
        if canonical_op(x) == "add" and len(x.args) == 2:
            a, b = x.args
            scores_side = a if _reaches_matmul(a) else b
            mask = b if scores_side is a else a
            nodes.append(x)
            x = scores_side
        elif canonical_op(x) == "masked_fill" and _const(x.args[2]) is not None and x.args[2] < -1e30:
            nodes.append(x)
            mask, filled, x = x.args[1], True, x.args[0]
        if canonical_op(x) in ("mul", "div") and _const(x.args[1]) is not None:
            c = _const(x.args[1])
            scale = c if canonical_op(x) == "mul" else 1.0 / c
            nodes.append(x)
            x = x.args[0]
        if canonical_op(x) != "matmul" or len(x.users) != 1:
            continue
        q, kt = x.args
        if canonical_op(kt) != "transpose" or sorted(d % _ndim(kt) for d in kt.args[1:3]) != [_ndim(kt) - 2, _ndim(kt) - 1]:
            continue
        nodes += [x, kt] if len(kt.users) == 1 else [x]
        k = kt.args[0]
        cur, ok = s, True
        while True:  # forwards: casts and a dropout, then the value product
            users = [u for u in cur.users if "assert" not in str(u.target)]
            if cur in unread:  # the probabilities, also returned where nobody reads them
                users = [w for w in users if w.op != "output"]
            if len(users) != 1:
                ok = False
                break
            u = users[0]
            op = canonical_op(u)
            if op in ("to", "type_as", "_to_copy") or (op == "dropout" and _const(u.args[1]) == 0.0):
                nodes.append(u)
                cur = u
                continue
            if op == "matmul" and u.args[0] is cur:
                nodes.append(u)
                v, out = u.args[1], u
            else:
                ok = False
            break
        if not ok:
            continue
        escaping = [n for n in nodes if n is not out and any(w not in nodes for w in n.users)]
        if escaping and not (len(escaping) == 1 and escaping[0] in unread
                             and all(w.op == "output" or w in nodes for w in escaping[0].users)):
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        inputs = {"q": q.name, "k": k.name, "v": v.name, **({"mask": mask.name} if mask is not None else {})}
        spec = {"nodes": [n.name for n in sorted(set(nodes), key=order.__getitem__)], "inputs": inputs,
                "outputs": [out.name] + [n.name for n in escaping], "pattern": "attention core"}
        found.append((spec, SdpaCore(scale, filled, returns_probs=bool(escaping))))
    return found


def _ndim(n: Any) -> int:
    val = n.meta.get("val") if hasattr(n, "meta") else None
    return val.dim() if isinstance(val, torch.Tensor) else 4


def _reaches_matmul(n: Any) -> bool:
    """Whether `n` is the scores' matmul, or a scalar scale of it."""
    if canonical_op(n) in ("mul", "div") and _const(n.args[1]) is not None:
        n = n.args[0]
    return canonical_op(n) == "matmul"
