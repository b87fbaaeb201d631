"""AdamW over a built model, the warmup + cosine learning rate, and gradient clipping by the global norm
over every placement (tensor-parallel shards, FSDP shards, replicas counted once)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..mesh import Mesh
from ..runtime.optimizer import adamw
from .config import RunConfig
from .layout import ParamLayout, named_params, unwrap


def lr_at(step: int, cfg: RunConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup from lr / warmup to `lr` over
    `warmup_steps`, then cosine from `lr` to `min_lr` at the last step (Loshchilov & Hutter, SGDR, 2017)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps - 1, 1)
    frac = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * frac))


def make_optimizer(model: nn.Module, layouts: dict[str, ParamLayout], cfg: RunConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (parameters of global rank >= 2), fp32 states. Parameters
    whose global shape is a vector (biases, norms) get no decay. The fused kernel, or the foreach form, unless
    plain tensors and DTensors mix (NOTE [fused optimizer] in `treadle.runtime.optimizer`)."""
    named = named_params(model)
    decay = [p for n, p in named if len(layouts[n].global_shape) >= 2]
    no_decay = [p for n, p in named if len(layouts[n].global_shape) < 2]
    return adamw([{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def init_optimizer_state(opt: torch.optim.AdamW) -> None:
    """Create AdamW's state (step 0, zero moments) for every parameter, as its first step would, so that a
    checkpoint can be loaded into it: the step counter on the parameter's device for the fused kernel (NOTE
    [fused optimizer]), on the CPU otherwise, as `torch.optim.AdamW` places it."""
    for group in opt.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            if p not in opt.state or not opt.state[p]:
                opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def local_grad_square_sum(model: nn.Module, layouts: dict[str, ParamLayout], mesh: Mesh) -> torch.Tensor:
    """This rank's share of the squared global gradient norm (float64 scalar): the squares of its local
    gradient pieces, each divided by how many ranks hold that piece (`ParamLayout.replicas`), so that the sum
    over all ranks is the square of the whole (global) gradient's 2-norm."""
    total = torch.zeros((), dtype=torch.float64, device=mesh.device)
    for name, p in named_params(model):
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        total += torch.linalg.vector_norm(g.detach(), dtype=torch.float64).square() / layouts[name].replicas(mesh)
    return total


def grad_norm(model: nn.Module, layouts: dict[str, ParamLayout], mesh: Mesh) -> torch.Tensor:
    """The 2-norm of the whole (global) gradient, the same float on every rank: one all-reduce of
    `local_grad_square_sum` over the world (none when every gradient is replicated, as under DDP, where each
    rank already holds the whole sum). Sums in float64."""
    total = local_grad_square_sum(model, layouts, mesh)
    sharded = any(layouts[n].replicas(mesh) != mesh.world_size
                  for n, p in named_params(model) if p.grad is not None)
    if sharded:
        dist.all_reduce(total)
    else:
        total *= mesh.world_size
    return total.sqrt()


def scale_grads(model: nn.Module, norm: float, max_norm: float | None) -> None:
    """Scale every gradient by min(1, max_norm / norm) (clipping by the global norm `norm`)."""
    if max_norm is not None and math.isfinite(norm) and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in unwrap(model).parameters():
            if p.grad is not None:
                p.grad.mul_(coef)


def clip_grads(model: nn.Module, layouts: dict[str, ParamLayout], mesh: Mesh, max_norm: float | None) -> float:
    """Scale every gradient by min(1, max_norm / norm) and return the norm before clipping."""
    norm = float(grad_norm(model, layouts, mesh))
    scale_grads(model, norm, max_norm)
    return norm
