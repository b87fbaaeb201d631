"""Kernel schedules by data flow, for blocks no named schedule knows (NOTE [kernels by data flow]): the residual +
norm and MLP activation regions found in each block's graph, fused with the compiler, each skip reported."""

from __future__ import annotations

import logging
from typing import Any

import torch
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
