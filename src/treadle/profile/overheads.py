"""Measure the host-side framework overheads of NOTE [framework overheads] (treadle.profile.hardware) on this core.

Each probe runs a tiny workload twice, with and without the machinery in question, and attributes the
difference per unit of that machinery; sizes are tiny so the arithmetic itself is negligible. Times are the
calling thread's CPU time (`time.thread_time`), best of `reps`: a busy machine preempts the probe but does not
inflate it, which wall-clock timing would. All probes run on the calling thread with torch's thread count as
the caller set it (`calibrate_cpu` sets 1).

- `op_overhead_s`: one op of an eager training step on tiny tensors (forward and backward of a stack of small
  norm / linear / GELU blocks over the ATen ops counted): dispatcher, module calls and autograd included.
- `subclass_op_overhead_s`: the same op on two DTensors of a 1-rank mesh, minus the plain op.
- `checkpoint_region_s`, `checkpoint_op_s`: fwd+bwd of a block of k tiny Linear layers under
  `torch.utils.checkpoint` (non-reentrant) minus without, minus one forward of the block (the recomputation
  `treadle.price` already prices), fitted as ``region + ops(k) * op`` over k in (2, 12); ops(k) counted.
- `selective_region_s`, `selective_op_s`: fwd+bwd of the same blocks under selective checkpointing whose policy
  recomputes every op (so the recomputation is full checkpointing's) minus under full checkpointing, fitted as
  ``region + (forward ops + recomputed ops)(k) * op``: the dispatch modes' cost per region and per op they see.
- `split_backward_op_s`: a zero-bubble schedule's split stage backward (input, then weight gradients) minus
  the whole one, per backward op, on a stack of tiny blocks.
- `fsdp_kept_unit_s`: fwd+bwd of such units kept gathered without gradient sync (after a first step), minus
  without FSDP2, per unit: the hooks alone, as a pipeline drives a stage between its gathers.
- `fsdp_unit_s`, `fsdp_param_s`: fwd+bwd of U units of m tiny Linear layers each under FSDP2 `fully_shard`
  on a 2-rank mesh minus without, fitted as ``U * unit + U * 2m * param`` over m in (1, 6). Two ranks, not
  one: on one rank FSDP2 shards nothing and its hooks take shortcuts (measured here: 1.0 ms per unit and
  31 us per parameter on one rank, 1.9 ms and 120 us on two), while every data-parallel run has two or more.

The DTensor and FSDP2 probes need a process group of their own: they run only when torch.distributed is not
initialised (a fake group — collectives return at once, nothing is sent — is created and destroyed);
otherwise they return None for those fields. A fake group misses what the launched one costs the calling
thread (gloo's issue and completion path: ~2.6-3.8 ms per unit measured on 2-4 gloo ranks of this host,
against 1-1.9 ms on the fake group), so `treadle.cost.calibrate.calibrate_cluster` measures the FSDP2 figures
again with `fsdp_overheads_s` on the launched group.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def best_thread_time_s(fn: Callable[[], object], *, reps: int, inner: int = 1) -> float:
    """Best of `reps` runs of `inner` calls of `fn`, per call, in the calling thread's CPU seconds (after one
    warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        for _ in range(inner):
            fn()
        best = min(best, (time.thread_time() - t0) / inner)
    return best


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _fit_line(x0: float, y0: float, x1: float, y1: float) -> tuple[float, float]:
    """(intercept, slope) through two points, both clamped at >= 0."""
    slope = max(0.0, (y1 - y0) / (x1 - x0))
    return max(0.0, y0 - slope * x0), slope


class _TinyBlock(nn.Module):
    """A pre-norm transformer-like block on tiny tensors: what one training step's ops cost apart from arithmetic."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        h = torch.nn.functional.gelu(h).view(x.shape[0], -1)
        return x + self.down(h).view_as(x) * 0.5


def op_overhead_s(*, reps: int = 7) -> float:
    """Seconds per ATen op of a training step whose arithmetic is negligible: forward + backward of a stack of
    tiny blocks (module calls, autograd's graph and engine, dispatch) over the ops it runs, counted."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_TinyBlock() for _ in range(4)])
    x = torch.randn(2, 4, requires_grad=True)

    def step() -> None:
        model(x).sum().backward()

    counter = _CountOps()
    with counter:
        step()
    return best_thread_time_s(step, reps=reps, inner=20) / max(counter.n, 1)


def split_backward_op_s(*, reps: int = 7, blocks: int = 8) -> float:
    """Extra seconds per backward op when a pipeline stage's backward is split into input and weight gradients
    as torch.distributed.pipelining's zero-bubble schedules run it (`stage_backward_input`, then
    `stage_backward_weight`) instead of one `stage_backward`: forward + split backward minus forward + whole
    backward of a stack of `blocks` tiny blocks, over the ops its backward dispatches, counted. The walk over the
    autograd graph grows a little faster than the ops (measured here: 8 us an op at 2 blocks, 11 at 12): a
    stack the size of a stage of a few transformer blocks."""
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    model = nn.Sequential(*[_TinyBlock() for _ in range(blocks)])
    params = list(model.parameters())
    x = torch.randn(2, 4, requires_grad=True)
    g = torch.ones(2, 4)

    def whole() -> None:
        stage_backward(model(x), g, [x])

    def split() -> None:
        _, groups = stage_backward_input([model(x)], [g], [x], iter(params))
        stage_backward_weight(iter(params), groups)

    out = model(x)
    counter = _CountOps()
    with counter:
        torch.autograd.backward(out, g)
    extra = best_thread_time_s(split, reps=reps, inner=10) - best_thread_time_s(whole, reps=reps, inner=10)
    return max(0.0, extra) / max(counter.n, 1)


def checkpoint_overheads_s(*, reps: int = 7) -> tuple[float, float]:
    """(per region, per recomputed op) of non-reentrant activation checkpointing."""
    from torch.utils.checkpoint import checkpoint

    points = []
    for k in (2, 12):
        torch.manual_seed(0)
        block = nn.Sequential(*[nn.Linear(4, 4) for _ in range(k)])
        x = torch.randn(2, 4, requires_grad=True)

        def plain() -> None:
            block(x).sum().backward()

        def ckpt() -> None:
            checkpoint(block, x, use_reentrant=False).sum().backward()

        def fwd() -> None:
            block(x)

        counter = _CountOps()
        with counter:
            block(x)
        extra = (best_thread_time_s(ckpt, reps=reps, inner=20) - best_thread_time_s(plain, reps=reps, inner=20)
                 - best_thread_time_s(fwd, reps=reps, inner=20))
        points.append((counter.n, extra))
    (x0, y0), (x1, y1) = points
    return _fit_line(x0, y0, x1, y1)


def selective_overheads_s(*, reps: int = 7) -> tuple[float, float]:
    """(per region, per op seen forward and in the recompute) of selective checkpointing's dispatch modes."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def recompute_all(ctx, func, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    context = functools.partial(create_selective_checkpoint_contexts, recompute_all)
    points = []
    for k in (2, 12):
        torch.manual_seed(0)
        block = nn.Sequential(*[nn.Linear(4, 4) for _ in range(k)])
        x = torch.randn(2, 4, requires_grad=True)

        def full() -> None:
            checkpoint(block, x, use_reentrant=False).sum().backward()

        def selective() -> None:
            checkpoint(block, x, use_reentrant=False, context_fn=context).sum().backward()

        counter = _CountOps()
        with counter:
            block(x)
        extra = best_thread_time_s(selective, reps=reps, inner=20) - best_thread_time_s(full, reps=reps, inner=20)
        points.append((2 * counter.n, extra))
    (x0, y0), (x1, y1) = points
    return _fit_line(x0, y0, x1, y1)


def fsdp_overheads_s(mesh, *, reps: int = 7) -> tuple[float, float]:
    """(per FSDP2 unit, per parameter of a unit) host seconds of one forward+backward on `mesh` (a 1-D
    DeviceMesh of a running process group: a fake one, or the launched gloo group, whose collectives the
    calling thread issues and waits on without spending CPU time). U units of m tiny Linear layers each under
    `fully_shard`, minus the same without, fitted as ``U * unit + U * 2m * param`` over m in (1, 6)."""
    from torch.distributed.fsdp import fully_shard

    units = 4
    points = []
    for m in (1, 6):
        def make(wrap: bool) -> Callable[[], None]:
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Sequential(*[nn.Linear(4, 4) for _ in range(m)]) for _ in range(units)])
            if wrap:
                for unit in model:
                    fully_shard(unit, mesh=mesh)
            x = torch.randn(2, 4)
            return lambda: model(x).sum().backward()

        extra = best_thread_time_s(make(True), reps=reps, inner=5) - best_thread_time_s(make(False), reps=reps,
                                                                                      inner=5)
        points.append((2 * m, extra / units))  # per unit: fixed + 2m parameters
    (x0, y0), (x1, y1) = points
    return _fit_line(x0, y0, x1, y1)


def fsdp_kept_unit_s(mesh, *, reps: int = 7) -> float:
    """Host seconds per FSDP2 unit of one forward+backward while the units stay gathered and do not sync their
    gradients (``reshard_after_forward=False``, no reshard after backward, no gradient sync: a pipeline stage
    between its first gather and its one reduction, NOTE [pipeline FSDP2]): U units of two tiny Linear layers and
    a root, gathered by a first step, minus the same without FSDP2."""
    from torch.distributed.fsdp import fully_shard

    units = 4

    def make(wrap: bool) -> Callable[[], None]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(units)])
        if wrap:
            for unit in model:
                fully_shard(unit, mesh=mesh, reshard_after_forward=False)
            fully_shard(model, mesh=mesh, reshard_after_forward=False)
            model.set_requires_gradient_sync(False)
            model.set_reshard_after_backward(False)
        x = torch.randn(2, 4)
        step = lambda: model(x).sum().backward()  # noqa: E731
        step()  # the first gather; the units stay gathered after it
        return step

    extra = best_thread_time_s(make(True), reps=reps, inner=5) - best_thread_time_s(make(False), reps=reps, inner=5)
    return max(0.0, extra / (units + 1))


def distributed_overheads_s(*, reps: int = 7) -> tuple[float, float, float, float] | None:
    """(subclass op, FSDP2 unit, FSDP2 parameter, FSDP2 unit kept gathered), or None when torch.distributed is
    already initialised."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from .fake_group import fake_process_group

    with fake_process_group(2):  # NOTE [a fake group leaves no trace]
        mesh = init_device_mesh("cpu", (2,))
        a, b = torch.ones(2), torch.ones(2)
        da, db = (distribute_tensor(t, mesh, [Shard(0)]) for t in (a, b))
        plain = best_thread_time_s(lambda: torch.add(a, b), reps=reps, inner=200)
        sub = max(0.0, best_thread_time_s(lambda: torch.add(da, db), reps=reps, inner=200) - plain)
        unit_s, param_s = fsdp_overheads_s(mesh, reps=reps)
        return sub, unit_s, param_s, fsdp_kept_unit_s(mesh, reps=reps)


__all__ = ["best_thread_time_s", "op_overhead_s", "checkpoint_overheads_s", "selective_overheads_s", "distributed_overheads_s", "fsdp_overheads_s"]
