"""Vocab-parallel cross-entropy: the loss of logits whose class dim is sharded over a mesh axis.

Logits (N, V/n) on each rank of the group; labels (N,) global class ids. Two small all-reduces of (N,)
(max and sum of exp) and one of the target logit; no rank ever holds (N, V). The backward is local:
softmax - onehot on the rank's own slice (Megatron-LM, Shoeybi et al. 2019, section 3).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import BuildError


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, ignore_index, divisor):
        n, v_local = logits.shape
        start = dist.get_rank(group) * v_local
        logits = logits.float()
        lmax = logits.max(dim=-1).values
        dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - lmax.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        valid = labels != ignore_index
        local = (labels >= start) & (labels < start + v_local) & valid
        idx = (labels - start).clamp(0, v_local - 1)
        target = torch.where(local, shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros_like(lmax))
        dist.all_reduce(target, group=group)
        per_token = torch.where(valid, sum_exp.log() - target, torch.zeros_like(target))
        ctx.save_for_backward(exp, sum_exp, idx, local, valid)
        ctx.divisor = divisor
        return per_token.sum() / divisor

    @staticmethod
    def backward(ctx, g):
        exp, sum_exp, idx, local, valid = ctx.saved_tensors
        grad = exp / sum_exp.unsqueeze(-1)
        grad.scatter_add_(-1, idx.unsqueeze(-1), -local.to(grad.dtype).unsqueeze(-1))
        grad = grad * valid.to(grad.dtype).unsqueeze(-1) * (g / ctx.divisor)
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group, *,
                                 ignore_index: int = -100, num_items: Any = None) -> torch.Tensor:
    """Mean cross-entropy over non-ignored tokens; `logits` (..., V/n) local, `labels` (...) global ids.
    `num_items` overrides the divisor (HF's num_items_in_batch)."""
    flat = logits.reshape(-1, logits.shape[-1])
    lab = labels.reshape(-1).to(flat.device)
    if flat.shape[0] != lab.shape[0]:
        raise BuildError(f"vocab_parallel_cross_entropy: {flat.shape[0]} logit rows but {lab.shape[0]} labels")
    if num_items is None:
        divisor = (lab != ignore_index).sum().clamp(min=1).item()
    else:
        divisor = float(num_items.item() if torch.is_tensor(num_items) else num_items)
    return _VocabParallelCE.apply(flat, lab, group, ignore_index, divisor)


class VocabParallelLoss:
    """A Hugging Face style ``loss_function`` over vocab-sharded logits (set by the ready-made schedules).

    ``causal=True`` shifts labels left by one (next-token loss), as HF's ForCausalLMLoss does;
    ``causal=False`` is the masked-LM loss. Bound to a mesh at build (`bind`).
    """

    def __init__(self, *, axis: str = "tp", causal: bool = True):
        self.axis = axis
        self.causal = causal
        self._group = None

    def bind(self, mesh) -> "VocabParallelLoss":
        self._group = mesh.group(self.axis)
        return self

    def __call__(self, logits, labels, vocab_size: int | None = None, num_items_in_batch=None,
                 ignore_index: int = -100, shift_labels=None, **kwargs) -> torch.Tensor:
        if self._group is None:
            raise BuildError("VocabParallelLoss used before build bound it to a mesh")
        if self.causal:
            if shift_labels is None:
                labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
                shift_labels = labels[..., 1:].contiguous()
            labels = shift_labels
        return vocab_parallel_cross_entropy(logits, labels, self._group, ignore_index=ignore_index,
                                            num_items=num_items_in_batch)
