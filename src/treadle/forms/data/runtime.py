"""What `build` installs for data parallelism (the "wrap" build step): DDP on the flattened group of the data-parallel
axes, or FSDP2 `fully_shard` on its units (NOTE [FSDP2 units] in `facts.py`) over the flattened shard axes —
on a 2-D (replicate, shard) mesh for HSDP."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...errors import BuildError
from .facts import backward_prefetch, batch_statistics_modules, foreign_params, fsdp_units, shard_units

logger = logging.getLogger(__name__)


def wrap_data_parallel(builder) -> nn.Module | None:
    """The "wrap" build step of the recorded data parallelism (`treadle.schedule.data_parallel`): DDP on the
    flattened group of its axes; FSDP2 `fully_shard` (every ModuleList entry, then the root) on the flattened
    shard axes, or on a 2-D (replicate, shard) mesh for HSDP. None (nothing to wrap) without data parallelism
    over more than one rank."""
    if builder.v.data_parallel is None:
        return None
    return wrap_module(builder, builder.model, fsdp_units(builder.model)[:-1])


def _refuse_batch_statistics(builder, module: nn.Module) -> None:
    """NOTE [batch statistics]: data parallelism over more than one replica of a module with a training-mode
    batch norm is refused."""
    dp = builder.v.data_parallel
    norms = batch_statistics_modules(module) if dp.size(builder.mesh) > 1 else []
    if norms:
        m = module.get_submodule(norms[0])
        more = f" (and {len(norms) - 1} more)" if len(norms) > 1 else ""
        raise BuildError(f"data_parallel over {dp.label()} ({dp.size(builder.mesh)} replicas): {norms[0]!r} "
                         f"({type(m).__name__}){more} normalises over the batch in training mode, and data "
                         f"parallelism splits the batch: each replica would use its own shard's statistics, not "
                         f"the model's. Convert the norms to torch.nn.SyncBatchNorm (GPU), put them in eval mode, "
                         f"or shard channels instead (tensor parallelism of the convolutions and norms)")


def wrap_module(builder, module: nn.Module, units: list[str]) -> nn.Module | None:
    """`module` under the schedule's data parallelism: a DDP wrapper over the flattened group of its axes, or
    `module` itself after FSDP2 `fully_shard` on each of `units` (submodule paths of `module`), then on it. None
    for DDP over a single rank. A pipeline wraps each of its stages so (`treadle.forms.pipeline.runtime`)."""
    dp = builder.v.data_parallel
    _refuse_batch_statistics(builder, module)
    # parameters another form reduces itself (the local experts: NOTE [expert gradients]); by name, looked up after
    # each part is materialised (NOTE [late materialisation] replaces a meta parameter's object)
    names = foreign_params(builder.model, builder.v)

    def foreign_ids() -> set[int]:
        return {id(p) for n, p in builder.model.named_parameters(remove_duplicate=False) if n in names}

    if not dp.shard:
        if dp.size(builder.mesh) == 1:
            return None
        group = builder.mesh.flat_group(dp.axes)
        builder.materialize(within=module)
        ignored = foreign_ids()
        if ignored:
            names = [n for n, p in module.named_parameters() if id(p) in ignored]
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
        return nn.parallel.DistributedDataParallel(module, process_group=group)
    from torch.distributed.fsdp import fully_shard

    base: dict[str, Any] = {"reshard_after_forward": dp.reshard_after_forward}
    if builder.mp_policy is not None:
        base["mp_policy"] = builder.mp_policy

    def shard(part: nn.Module, mesh) -> None:
        builder.materialize(within=part)  # just before it is sharded
        ignored = foreign_ids()
        kw = dict(base)
        if ignored:
            kw["ignored_params"] = {p for p in module.parameters() if id(p) in ignored}
        fully_shard(part, mesh=mesh, **kw)

    # another form's units first (the experts over the axes the expert axis leaves: NOTE [experts under FSDP2])
    inside = {id(m) for m in module.modules()}
    own = [u for u in shard_units(builder.model, builder.v) if id(builder.model.get_submodule(u.path)) in inside]
    for unit in own:
        shard(builder.model.get_submodule(unit.path), fsdp_mesh(builder.mesh, unit.shard_axes, unit.replicate_axes))
    sub = fsdp_mesh(builder.mesh, dp.shard_axes, dp.replicate_axes)
    for path in units:
        shard(module.get_submodule(path), sub)
    shard(module, sub)
    _gather_bytes_on_gloo(module, sub)
    if dp.reshard_after_forward:  # NOTE [nested prefetch]
        nested = [_relative(builder.model, module, u.path) for u in own]
        for u, targets in backward_prefetch(module, units, nested).items():
            module.get_submodule(u).set_modules_to_backward_prefetch([module.get_submodule(t) for t in targets])
    logger.info("data parallel: %s", dp)
    return module


# NOTE [float8 all-gather on gloo]: a parameter that FSDP2 gathers through its own `fsdp_pre_all_gather` (torchao's
# float8 weights: `float8(all_gather=True)`) hands FSDP2 float8 shards, and when every input of a unit is float8
# FSDP2's gather buffer is float8 too; gloo has no float8 type ("Invalid scalar type"). On a gloo group each such
# unit gathers through `_ByteGather`: the same all-gather with a one-byte float buffer viewed as uint8 (the same
# bytes, so the result is bit-identical). NCCL gathers float8 itself and keeps FSDP2's own all-gather.
class _ByteGather:
    """FSDP2's all-gather (`torch.distributed.fsdp` `AllGather` protocol) with one-byte float buffers sent as
    uint8."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if output_tensor.dtype.is_floating_point and output_tensor.dtype.itemsize == 1:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def _gather_bytes_on_gloo(module: nn.Module, mesh) -> None:
    """NOTE [float8 all-gather on gloo]: `_ByteGather` on each FSDP2 unit of `module` that holds a parameter
    gathered through its own hook, when the group is gloo."""
    if dist.get_backend(mesh.get_group(mesh.ndim - 1)) != "gloo":
        return
    for m in module.modules():
        if not hasattr(m, "set_custom_all_gather"):  # not an FSDP2 unit
            continue
        params = [p.to_local() if hasattr(p, "to_local") else p for p in m.parameters()]
        if any(hasattr(type(p), "fsdp_pre_all_gather") for p in params):
            m.set_custom_all_gather(_ByteGather())


def _relative(model: nn.Module, module: nn.Module, path: str) -> str:
    """`path` (in `model`) as a path in `module`, a submodule of it (a pipeline stage) or `model` itself."""
    target = model.get_submodule(path)
    return next(p for p, m in module.named_modules() if m is target)


def fsdp_mesh(mesh, shard_axes: tuple[str, ...], replicate_axes: tuple[str, ...] = ()):  # -> DeviceMesh
    """The mesh FSDP2 shards on: the flattened `shard_axes`, or (replicate, shard) for HSDP."""
    sub = mesh.flat_device_mesh(shard_axes)
    if replicate_axes:  # HSDP: fully_shard's 2-D mesh is (replicate, shard)
        from torch.distributed.device_mesh import DeviceMesh

        sub = DeviceMesh._concatenate([mesh.flat_device_mesh(replicate_axes), sub])
    return sub

