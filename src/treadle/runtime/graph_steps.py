"""Build steps for graph-level primitives: sharded decomposed leaves and selective checkpointing.

* pre_shard: a decomposed leaf no longer runs its module, so the input-gradient reduction a column-sharded
  weight needs (the leaf rule's pre-hook) is inserted into the graph where the leaf's input was marked
  (`rewrite.leaf_input`); a row-sharded weight would need its output reduction too, which a graph of loose
  ops cannot place safely, so it is a BuildError.
* post_hooks: modules with ``checkpoint_selective`` run under non-reentrant checkpoint with a
  save-these-ops policy.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.fx as fx
from torch import nn

from ..errors import BuildError
from ..graph.rewrite import decomposition_dims, leaf_input
from ..schedule.graph_primitives import resolve_ops
from . import collectives as C
from .steps import register_build_extension, wrap_forward

logger = logging.getLogger(__name__)


class GradAllReduce(nn.Module):
    """Identity forward, all-reduce of the gradient in backward over `group` (a column-parallel input)."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return C.grad_all_reduce(x, self.group)


def _sync_decomposed(builder) -> None:
    for gpath, gm in list(builder.model.named_modules()):
        if not isinstance(gm, fx.GraphModule):
            continue
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target is not leaf_input:
                continue
            path = node.kwargs["path"]
            leaf = builder.module(path)
            out_dim, in_dim = decomposition_dims(leaf)
            axes = []
            for s in builder.param_shards.get(id(leaf.weight), []):
                if s.dim == out_dim:
                    axes.append(s.axis)
                elif s.dim == in_dim:
                    raise BuildError(f"build: {path!r} was decomposed but its weight is split on its input dim over "
                                     f"axis {s.axis!r} (row parallel); decompose only column-parallel leaves")
            for s in builder.v.syncs:
                reduces = s.mode == "bwd_post" and (s.op == "all_reduce" and s.axis in axes or s.op is None and all(
                    ax in axes for ax, _ in s.to))
                if s.path == path and not reduces:
                    raise BuildError(f"build: {path!r} was decomposed, so its sync {s.mode} "
                                     f"{'op=%r' % s.op if s.op else 'to=%s' % [p for _, p in s.to]} has no module call "
                                     f"to run on; record it on the parent module")
            x = node.args[0]
            for ax in axes:
                name = f"_grad_sync_{node.name}_{ax}"
                gm.add_submodule(name, GradAllReduce(builder.group(ax)))
                with gm.graph.inserting_before(node):
                    x = gm.graph.call_module(name, (x,))
            node.replace_all_uses_with(x)
            gm.graph.erase_node(node)
            changed = True
        if changed:
            gm.recompile()
            logger.debug("build: decomposed leaves in %r synchronised", gpath)


class SavePolicy:
    """Selective-checkpoint policy: save outputs of the listed ops, recompute everything else."""

    def __init__(self, packets):
        self.packets = set(packets)

    def __call__(self, ctx, func, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy

        packet = getattr(func, "overloadpacket", func)
        return CheckpointPolicy.MUST_SAVE if packet in self.packets else CheckpointPolicy.PREFER_RECOMPUTE


def _selective(builder) -> None:
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    for path, save in builder.v.extras.get("selective", []):
        m = builder.module(path)
        policy = SavePolicy(resolve_ops(save, f"sch[{path!r}]"))
        ctx = functools.partial(create_selective_checkpoint_contexts, policy)
        wrap_forward(m, lambda orig, ctx=ctx: (lambda *a, **k: checkpoint(orig, *a, use_reentrant=False,
                                                                           context_fn=ctx, **k)))


register_build_extension("pre_shard", _sync_decomposed)
register_build_extension("post_hooks", _selective)
