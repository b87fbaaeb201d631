"""What the runtime does for data parallelism, stated once: the DDP buckets and buffer broadcast, the FSDP2 units,
and the host-side and copy costs of FSDP2. `build` wraps by these facts (`runtime.py`), the price rehearses them
(`price.py`) and the planner's cost graph charges them (`plan.py`).

NOTE [DDP buckets]: `ddp_buckets` groups gradients as `torch.nn.parallel.DistributedDataParallel` does after its
first iteration (the reducer's rebuild, `torch/csrc/distributed/c10d/reducer.cpp`): parameters in the order their
gradients become ready, one dtype per bucket, a bucket closed once it holds at least its limit — 1 MiB for the
first (``dist._DEFAULT_FIRST_BUCKET_BYTES``), 25 MiB (``bucket_cap_mb``) for the rest.

NOTE [DDP buffers]: DistributedDataParallel (broadcast_buffers=True, as `build` makes it) broadcasts the
module's buffers from rank 0 at the start of every forward — one coalesced broadcast over the data-parallel
group, on the critical path (the forward needs them). A model with buffers (LLaMA's rotary `inv_freq`, a
BatchNorm's running statistics) pays one collective's latency per step; one without (GPT-2) pays nothing.
The price and the planner's cost graph both charge `buffer_broadcast_s` for the bytes of
`treadle.profile.memory.buffer_bytes`.

NOTE [FSDP2 units]: `build` calls ``fully_shard`` on every entry of every ``nn.ModuleList`` or ``nn.ModuleDict`` that
is not inside such an entry already (T5's blocks, not the list of layers each block holds: wrapping the block first
and then a list inside it would shard its parameters twice, which FSDP2 refuses), then on the root (`fsdp_units`); a parameter belongs to the first unit holding its module (`fsdp_param_units`). Per unit per
step FSDP2's hooks cost ``fsdp_unit_s + n_params * fsdp_param_s`` on the host (NOTE [framework overheads] in
`treadle.profile.hardware`; `fsdp_host_s`), and around each of its collectives it copies the shard or gradient in and
the gathered parameter or reduced shard out: 2 (full + shard) bytes moved (`fsdp_copy_s`). A unit that is already
gathered and does not sync its gradients (a pipeline stage between its gathers and its one reduction: NOTE [pipeline
FSDP2]) runs only the hooks' bookkeeping, ``fsdp_kept_unit_s`` a forward and backward (`fsdp_kept_host_s`; measured on
this host 0.1-0.2 ms a unit, against 0.8-1.1 ms with its gather, reshard and reduce-scatter).

NOTE [nested prefetch]: in backward FSDP2 by default prefetches one unit ahead, in the reverse of the order the
units' forwards ended. With a unit nested in a block (another form's, the experts: NOTE [experts under FSDP2])
that order interleaves ..., block i-1, experts i-1, block i, experts i (a nested unit's forward ends first):
block i's backward would prefetch experts i, needed almost at once (the MLP is the end of a block), so that gather
would wait in the open. `build` instead has the last unit of each block to start its backward (the nested unit
whose forward started first) prefetch the next block and every unit nested in it, at once
(`backward_prefetch`, FSDP2's ``set_modules_to_backward_prefetch``): the next block's gathers overlap this
block's remaining backward. Blocks without nested units keep FSDP2's default. The price issues the gathers so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...cost import collective_cost as cc
from ...profile.roofline import op_time_s
from ...runtime.optimizer import trainable_params
from ...schedule.tree import within  # noqa: F401  (read here by the forms: one definition)

DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * 1024 * 1024  # DistributedDataParallel(bucket_cap_mb=25)


def ddp_buckets(grads: list[tuple[str, int, str]], *, first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
                bucket_bytes: int = DDP_BUCKET_BYTES) -> list[list[str]]:
    """Bucket gradients as DDP's reducer does (NOTE [DDP buckets]). `grads`: (name, bytes, dtype) in the order the
    gradients become ready. Returns buckets in the order they are reduced; each holds one dtype."""
    out: list[list[str]] = []
    open_: dict[str, tuple[list[str], int]] = {}
    limit_used: dict[str, int] = {}
    for name, nbytes, dtype in grads:
        names, size = open_.get(dtype, ([], 0))
        names.append(name)
        size += nbytes
        limit = first_bucket_bytes if limit_used.get(dtype, 0) == 0 else bucket_bytes
        if size >= limit:
            out.append(names)
            limit_used[dtype] = limit_used.get(dtype, 0) + 1
            open_.pop(dtype, None)
        else:
            open_[dtype] = (names, size)
    out.extend(names for names, _ in open_.values())
    return out



def buffer_broadcast_s(buffer_bytes: float, n: int, link: Any) -> float:
    """DDP's broadcast of the model's buffers at the start of every forward (NOTE [DDP buffers]); 0 without
    buffers."""
    return cc.broadcast_time_s(buffer_bytes, n, link) if buffer_bytes and n > 1 else 0.0


def foreign_params(model: nn.Module, view: Any) -> set[str]:
    """Names of the parameters of `model` that another form reduces itself (`Form.own_params`: the local
    experts of expert parallelism), which DDP and FSDP2 leave alone, at build and in the price alike."""
    from ...form import forms

    out: set[str] = set()
    for f in forms():
        out |= f.own_params(model, view)
    return out


def shard_units(model: nn.Module, view: Any) -> list:
    """The modules another form has FSDP2 shard as units of their own, on their own axes (`Form.shard_units`: the
    local experts, NOTE [experts under FSDP2]), wrapped before the blocks at build and priced per unit."""
    from ...form import forms

    return [u for f in forms() for u in f.shard_units(model, view)]


def gather_itemsizes(view: Any) -> dict[str, int]:
    """Parameter name -> the bytes per element FSDP2 all-gathers it in, where a form changes it
    (`Form.gather_itemsize`: float8 weights, 1); a parameter not named gathers in its own dtype."""
    from ...form import forms

    out: dict[str, int] = {}
    for name, _ in view.model.named_parameters():
        for f in forms():
            size = f.gather_itemsize(view, name)
            if size is not None:
                out[name] = size
                break
    return out


def fsdp_units(model: nn.Module) -> list[str]:
    """FSDP2 units as `build` wraps them (NOTE [FSDP2 units]): every entry of every ModuleList or ModuleDict not
    inside another unit (the blocks, as torchtitan holds them), then the root."""
    units: list[str] = []
    for path, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and not any(within(path, u) for u in units):
            units += [f"{path}.{k}" if path else k for k, c in m.named_children()]
    return units + [""]


def backward_prefetch(module: nn.Module, blocks: list[str], nested: list[str]) -> dict[str, list[str]]:
    """Unit -> the units it prefetches when its backward starts, where that is not FSDP2's default (NOTE [nested
    prefetch]). `blocks`: the block units of `module` in forward order (the root excluded); `nested`: units
    nested in them (paths in `module`), taken in `module`'s order."""
    index = {p: i for i, (p, _) in enumerate(module.named_modules())}
    nested = sorted(nested, key=index.__getitem__)
    inner = {b: [u for u in nested if u != b and within(u, b)] for b in blocks}
    out: dict[str, list[str]] = {}
    for prev, cur in zip(blocks, blocks[1:]):
        if inner[cur] or inner[prev]:
            out[inner[cur][0] if inner[cur] else cur] = [prev, *reversed(inner[prev])]
    return out


def fsdp_param_units(model: nn.Module, units: list[str] | None = None) -> list[str]:
    """The FSDP2 unit (of `fsdp_units`) of each trainable parameter, in `named_parameters` order: the first unit
    holding its module (the root "" comes last)."""
    units = fsdp_units(model) if units is None else units
    return [next(u for u in units if within(name.rpartition(".")[0], u)) for name, _ in trainable_params(model)]


def fsdp_host_s(n_units: int, n_params: int, hw: Any) -> float:
    """FSDP2's host cost per step of `n_units` units holding `n_params` parameters (NOTE [FSDP2 units])."""
    return n_units * hw.fsdp_unit_s + n_params * hw.fsdp_param_s


def fsdp_kept_host_s(n_units: int, hw: Any) -> float:
    """FSDP2's host cost of a forward and backward of `n_units` units already gathered, without gradient sync
    (NOTE [FSDP2 units]: a pipeline stage kept gathered between micro-batches)."""
    return n_units * hw.fsdp_kept_unit_s


def fsdp_copy_s(full_bytes: float, n: int, hw: Any, dtype: torch.dtype = torch.float32) -> float:
    """FSDP2's local copies around one collective of a `full_bytes` unit over `n` ranks: 2 (full + shard) bytes
    moved, at the device's memory rate (NOTE [FSDP2 units])."""
    return op_time_s(0, int(2 * (full_bytes + full_bytes / n)), hw, dtype)


# NOTE [batch statistics]: a batch norm in training mode (BatchNorm1d/2d/3d), or one without running statistics in any
# mode, normalises by the mean and variance of the batch it sees. Data parallelism splits the batch, so under DDP /
# FSDP2 / HSDP each replica would normalise by its own shard's statistics and update its running statistics from them:
# other numbers than the model as written (and replicas whose buffers drift apart until DDP's next broadcast). torch's
# SyncBatchNorm computes the whole batch's statistics across ranks (GPU only); it is exact and allowed. `build` refuses
# data parallelism over a model with any other (`batch_statistics_modules`), and the planner does not propose it for one
# (the data form's role options); sharding channels (tensor parallelism of the convolutions and norms) stays exact.
def batch_statistics_modules(model: nn.Module) -> list[str]:
    """Paths of the modules of `model` that normalise over the batch (in training mode, or always without running
    statistics, as `_BatchNorm.forward` decides), SyncBatchNorm excepted (NOTE [batch statistics])."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return [p for p, m in model.named_modules()
            if isinstance(m, _BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
            and (m.training or (m.running_mean is None and m.running_var is None))]
