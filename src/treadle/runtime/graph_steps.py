"""Build steps for graph-level primitives: sharded decomposed leaves and selective checkpointing.

* pre_materialize: a decomposed leaf no longer runs its module, so the input-gradient reduction a column-sharded
  weight needs (the leaf rule's pre-hook) is inserted into the graph where the leaf's input was marked
  (`rewrite.leaf_input`); a row-sharded weight would need its output reduction too, which a graph of loose
  ops cannot place safely, so it is a BuildError.
* post_hooks: modules with ``checkpoint_selective`` run under non-reentrant checkpoint with a
  save-these-ops policy, or a named one (NOTE [checkpoint policies as peers define them]).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from ..errors import BuildError
from ..graph.rewrite import decomposition_dims, leaf_input
from ..schedule.checkpoint_policies import CheckpointPolicy, PolicyRun, checkpoint_policy, resolve_ops
from . import collectives as C
from .recompute import checkpointed_forward
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


_SDPA_FUNCS = frozenset({F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention})


class NamedPolicy(PolicyRun):
    """A checkpoint policy (`treadle.schedule.checkpoint_policies`: a named one, or a schedule's save list) as
    `torch.utils.checkpoint` asks it, one instance per run of the module's forward (`PolicyRun.keeps`: the
    alternate ops counted within that run, apart in the forward and in its recomputation)."""

    def __call__(self, ctx, func, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy as Decision

        return Decision.MUST_SAVE if self.keeps(func, recompute=ctx.is_recompute) else Decision.PREFER_RECOMPUTE


class AttentionCore(nn.Module):
    """`F.scaled_dot_product_attention` as a module, so that its recomputation runs its forward hooks (the
    price's recorder names it "recompute"). Build adds one to a module with the "attention-core" policy."""

    def forward(self, *args, **kwargs):
        return F.scaled_dot_product_attention(*args, **kwargs)


ATTENTION_CORE = "_treadle_attention_core"  # the submodule name build gives it
_warned_no_core: set[str] = set()


class _AttentionCalls(TorchFunctionMode):
    """While a module with the "attention-core" policy runs forward with gradients: each SDPA call goes through
    its `AttentionCore` under a checkpoint of its own (NOTE [checkpoint policies as peers define them])."""

    def __init__(self, core: nn.Module) -> None:
        super().__init__()
        self.core = core
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SDPA_FUNCS and torch.is_grad_enabled():
            self.calls += 1
            return checkpoint(self.core, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


def _attention_calls(m: nn.Module, path: str):
    core = AttentionCore()
    m.add_module(ATTENTION_CORE, core)

    def wrap(orig):
        def forward(*a, **k):
            if not (m.training and torch.is_grad_enabled()):
                return orig(*a, **k)
            mode = _AttentionCalls(core)
            with mode:
                out = orig(*a, **k)
            if mode.calls == 0 and path not in _warned_no_core:
                _warned_no_core.add(path)
                logger.warning("checkpoint %s: policy 'attention-core' found no scaled_dot_product_attention call "
                               "in its forward, so nothing is recomputed; put an eager attention core on SDPA "
                               "first (treadle.models.kernel_schedule)", path)
            return out
        return forward

    wrap_forward(m, wrap)


def _policy_contexts(spec):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(NamedPolicy(spec))


def _selective(builder) -> None:
    for path, save in builder.v.extras.get("selective", []):
        m = builder.module(path)
        if isinstance(save, str):  # a named policy (NOTE [checkpoint policies as peers define them])
            spec = checkpoint_policy(save, f"sch[{path!r}]")
            if spec.how == "attention-calls":
                _attention_calls(m, path)
                continue
            ctx = functools.partial(_policy_contexts, spec)
        else:  # a save list: keep those ops' outputs, recompute the rest
            resolve_ops(save, f"sch[{path!r}]")
            spec = CheckpointPolicy("save", "selective", keep=tuple(save), alternate=(), recompute=(),
                                    default="recompute", source="the schedule's save list")
            ctx = functools.partial(_policy_contexts, spec)
        wrap_forward(m, lambda orig, m=m, path=path, ctx=ctx: checkpointed_forward(m, orig, path, ctx))


register_build_extension("pre_materialize", _sync_decomposed)  # rewrites graphs, reads no value
register_build_extension("post_hooks", _selective)
