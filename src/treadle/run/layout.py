"""Where each parameter of a built model lives: its global shape, its tensor-parallel splits (from the
schedule) and its FSDP split (a DTensor over the data-parallel axis), and the global views built from them.

A built model holds tensor-parallel shards as plain local tensors and FSDP shards as DTensors over one mesh
axis. To save a checkpoint any other schedule can load, and to compute a gradient norm over all placements,
each parameter is described here once by name:

- `global_view(local)`: the local shard as a DTensor of the *global* shape on the full mesh, when its splits
  are DTensor placements (at most one split per tensor dim, no interleaved ``blocks``); else None.
- `gather_full(local)` / `local_from_full(full, like)`: all-gather to the global tensor and slice it back, the
  fallback for the splits a DTensor cannot state (fused q|k|v ``blocks=3``, two axes on one dim).
- `replicas`: how many ranks hold each element (world size / distinct shards; in a pipeline, only the ranks
  whose stages read it), for the gradient norm.

A pipelined model (`treadle.forms.pipeline.runtime.PipelineModel`) holds only its local stages' parameters; they
are named as in the unbuilt model (`named_params`), so a checkpoint any schedule can load holds the whole model
in global shapes whatever the pipeline's cuts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from ..forms.data.facts import shard_units
from ..mesh import Mesh
from ..runtime.params import local_slice, unchunk_dim
from ..schedule.core import Schedule
from ..schedule.state import ParamShard
from .config import RunError


@dataclass(frozen=True)
class ParamLayout:
    """One parameter: `name`, `global_shape`, tensor-parallel `shards` in applied order, and `fsdp_axes` /
    `fsdp_dim` when FSDP splits the (tensor-parallel local) parameter over the flattened group of those
    data-parallel axes (mesh order, row-major; HSDP: its shard axes)."""

    name: str
    global_shape: tuple[int, ...]
    shards: tuple[ParamShard, ...]
    fsdp_axes: tuple[str, ...] = ()
    fsdp_dim: int = 0
    pp_axis: str | None = None  # a pipeline's axis: only `pp_holders` of its ranks hold the parameter
    pp_holders: int = 1

    def n_pieces(self, mesh: Mesh) -> int:
        n = 1
        for s in self.shards:
            n *= mesh.size(s.axis)
        for a in self.fsdp_axes:
            n *= mesh.size(a)
        return n

    def replicas(self, mesh: Mesh) -> int:
        holding = mesh.world_size
        if self.pp_axis is not None:
            holding = mesh.world_size // mesh.size(self.pp_axis) * self.pp_holders
        return holding // self.n_pieces(mesh)

    def placements(self, mesh: Mesh) -> list[Placement] | None:
        """Placements on the full mesh, or None when the splits are not DTensor placements."""
        out: list[Placement] = [Replicate()] * mesh.ndim
        dims = [s.dim for s in self.shards] + [self.fsdp_dim] * len(self.fsdp_axes)
        if any(s.blocks != 1 for s in self.shards) or len(set(dims)) != len(dims):
            return None
        for s in self.shards:
            out[mesh.axis_index(s.axis)] = Shard(s.dim)
        for a in self.fsdp_axes:  # one axis here: two would share a dim, refused above
            out[mesh.axis_index(a)] = Shard(self.fsdp_dim)
        return out

    # ------------------------------------------------------------------ views
    def global_view(self, local: torch.Tensor, mesh: Mesh) -> DTensor | None:
        """`local` (this rank's shard: a plain tensor, or the FSDP DTensor) as a DTensor of global shape."""
        pl = self.placements(mesh)
        if pl is None:
            return None
        t = local.to_local() if isinstance(local, DTensor) else local
        return DTensor.from_local(t.detach(), mesh.device_mesh, pl, run_check=False, shape=torch.Size(self.global_shape),
                                  stride=_contiguous_strides(self.global_shape))

    def gather_full(self, local: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        """The global tensor on every rank, a new tensor (all-gathers over the FSDP axis, then over each split
        in reverse)."""
        t = local.detach()
        t = t.full_tensor() if isinstance(t, DTensor) else t.clone()
        for s in reversed(self.shards):
            g = mesh.group(s.axis)
            pieces = [torch.empty_like(t) for _ in range(mesh.size(s.axis))]
            dist.all_gather(pieces, t.contiguous(), group=g)
            t = unchunk_dim(pieces, s.dim, s.blocks)
        if tuple(t.shape) != self.global_shape:
            raise RunError(f"treadle.run: gathering {self.name!r} gave shape {tuple(t.shape)}, expected "
                           f"{self.global_shape}")
        return t

    def local_from_full(self, full: torch.Tensor, like: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        """This rank's shard of the global tensor `full`, as the plain local tensor inside `like`."""
        coords = {ax: mesh.local_rank(ax) for ax in mesh.names}
        t = local_slice(full, list(self.shards), coords, dict(zip(mesh.names, mesh.shape)))
        if self.fsdp_axes:  # FSDP2's chunks over the flattened group, row-major over the axes in mesh order
            n, i = 1, 0
            for a in self.fsdp_axes:
                n, i = n * mesh.size(a), i * mesh.size(a) + coords[a]
            rows = list(t.shape)
            rows[self.fsdp_dim] = 0  # a rank past the last chunk holds none of the dim, the other dims whole
            t = t.chunk(n, dim=self.fsdp_dim)
            t = t[i] if i < len(t) else full.new_empty(rows)
        return t


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (names without the ``module.`` prefix)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def named_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """This rank's parameters of a built model by the unbuilt model's names, each once: a pipeline's local stages'
    (`PipelineModel.canonical_parameters`), else the model's own (inside a DDP wrapper)."""
    inner = unwrap(model)
    canonical = getattr(inner, "canonical_parameters", None)
    return list(canonical().items()) if canonical is not None else list(inner.named_parameters())


def shards_by_name(sch: Schedule) -> dict[str, tuple[tuple[int, ...], tuple[ParamShard, ...]]]:
    """Before build: name -> (global shape, tensor-parallel splits) of every parameter of the schedule's model."""
    st = sch.view()
    return {n: (tuple(p.shape), st.shards_of(p)) for n, p in st.model.named_parameters()}


def fsdp_unit_axes(sch: Schedule) -> dict[str, tuple[str, ...]]:
    """Module path -> FSDP2 shard axes of the modules a form has FSDP2 shard on axes of their own
    (`treadle.forms.data.facts.shard_units`: the local experts, NOTE [experts under FSDP2])."""
    st = sch.view()
    return {u.path: u.shard_axes for u in shard_units(st.model, st)}


def layouts(model: nn.Module, before: dict[str, tuple[tuple[int, ...], tuple[ParamShard, ...]]],
            mesh: Mesh, fsdp_axes: tuple[str, ...] | None = None,
            unit_axes: dict[str, tuple[str, ...]] | None = None) -> dict[str, ParamLayout]:
    """After build: the ParamLayout of every parameter of the built `model`, by name. `fsdp_axes`: the
    schedule's FSDP2 shard axes (``sch.view().data_parallel.shard_axes``); None reads the one axis from the
    DTensor's mesh (a single-axis FSDP). `unit_axes`: module path -> shard axes of the modules FSDP2 shards on
    axes of their own (`fsdp_unit_axes`: the local experts), for the parameters inside them.

    Raises RunError naming a parameter whose name did not exist before build, or whose local shape does not
    match its global shape under its splits (a layout this module cannot describe; never guessed)."""
    out: dict[str, ParamLayout] = {}
    sizes = dict(zip(mesh.names, mesh.shape))
    inner = unwrap(model)
    pp_axis, holders = getattr(inner, "pp_axis", None), getattr(inner, "pp_holders", {})
    for name, p in named_params(model):
        if name not in before:
            raise RunError(f"treadle.run: built parameter {name!r} has no counterpart in the unbuilt model; "
                           f"checkpointing needs stable parameter names")
        shape, shards = before[name]
        axes, fsdp_dim = (), 0
        local_shape = list(shape)
        for s in shards:
            local_shape[s.dim] //= sizes[s.axis]
        if isinstance(p, DTensor):
            # FSDP2: Shard on the last mesh dim (HSDP: Replicate before it) over the flattened shard axes
            *reps, pl = p.placements
            names = p.device_mesh.mesh_dim_names or ()
            axes = tuple(fsdp_axes) if fsdp_axes is not None else tuple(names[-1:])
            owner = name.rpartition(".")[0]
            axes = next((a for u, a in (unit_axes or {}).items() if owner == u or owner.startswith(u + ".")), axes)
            ok = (isinstance(pl, Shard) and all(isinstance(r, Replicate) for r in reps) and axes
                  and all(a in mesh.names for a in axes) and tuple(p.shape) == tuple(local_shape)
                  and p.device_mesh.size(p.device_mesh.ndim - 1) == math.prod(sizes[a] for a in axes))
            if not ok:
                raise RunError(f"treadle.run: parameter {name!r} is a DTensor {p.placements} of shape "
                               f"{tuple(p.shape)} over {p.device_mesh}; expected FSDP Shard over the flattened "
                               f"axes {axes} of {mesh} with shape {tuple(local_shape)}")
            fsdp_dim = pl.dim
        elif tuple(p.shape) != tuple(local_shape):
            raise RunError(f"treadle.run: parameter {name!r} has local shape {tuple(p.shape)}, but its global "
                           f"shape {shape} split by {list(shards)} gives {tuple(local_shape)}")
        out[name] = ParamLayout(name, shape, shards, axes, fsdp_dim, pp_axis, holders.get(name, 1))
    return out
