"""A logical N-d device mesh with named axes: pure data when planning, a `DeviceMesh` inside a launched job."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .errors import MeshError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mesh:
    """A logical grid of devices, e.g. ``Mesh((2, 4), ("dp", "tp"))``: 2 data-parallel groups of 4 tensor-parallel ranks.

    Ranks are laid out row-major: the last axis varies fastest, so on ``(2, 4)`` ranks 0-3 form the
    first ``tp`` group. Planning uses the mesh as data; `bind` turns it into a
    `torch.distributed.device_mesh.DeviceMesh` inside a launched job.

    Raises: MeshError when sizes are not positive, names repeat, or the counts differ.
    """

    shape: tuple[int, ...]
    names: tuple[str, ...]
    _device_mesh: Any = field(default=None, compare=False, repr=False)  # DeviceMesh once bound

    def __init__(self, shape: tuple[int, ...] | list[int] | int, names: tuple[str, ...] | list[str] | str):
        shape_t = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        names_t = (names,) if isinstance(names, str) else tuple(names)
        if len(shape_t) != len(names_t):
            raise MeshError(f"Mesh: {len(shape_t)} sizes {shape_t} but {len(names_t)} axis names {names_t}")
        if any(s < 1 for s in shape_t):
            raise MeshError(f"Mesh: every axis size must be >= 1; got {dict(zip(names_t, shape_t))}")
        if len(set(names_t)) != len(names_t):
            raise MeshError(f"Mesh: axis names must be unique; got {names_t}")
        object.__setattr__(self, "shape", shape_t)
        object.__setattr__(self, "names", names_t)
        object.__setattr__(self, "_device_mesh", None)

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape)) + ")"

    def __reduce__(self):  # pickles as data; a bound DeviceMesh never crosses processes
        return (Mesh, (self.shape, self.names))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def axis_index(self, axis: str) -> int:
        """Position of the named axis. Raises MeshError listing the axes that exist."""
        if axis not in self.names:
            raise MeshError(f"mesh axis {axis!r} does not exist; this mesh has axes {list(self.names)} ({self})")
        return self.names.index(axis)

    def size(self, axis: str) -> int:
        """Number of ranks along `axis`."""
        return self.shape[self.axis_index(axis)]

    def coordinate(self, rank: int) -> dict[str, int]:
        """Coordinate of a global rank on each named axis (row-major layout)."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside {self} of world size {self.world_size}")
        coord: dict[str, int] = {}
        rest = rank
        for name, size in zip(reversed(self.names), reversed(self.shape)):
            coord[name] = rest % size
            rest //= size
        return {n: coord[n] for n in self.names}

    def ranks_along(self, axis: str, rank: int) -> list[int]:
        """Global ranks of the group along `axis` that contains `rank`."""
        i = self.axis_index(axis)
        stride = math.prod(self.shape[i + 1 :])
        coord = self.coordinate(rank)[axis]
        base = rank - coord * stride
        return [base + k * stride for k in range(self.shape[i])]

    # ------------------------------------------------------------------ binding to a launched job
    @property
    def is_bound(self) -> bool:
        return self._device_mesh is not None

    def bind(self) -> "Mesh":
        """Bind to the running process group and return self (idempotent).

        Requires `torch.distributed` initialised (gloo on CPU, NCCL on CUDA) with world size equal to
        the product of the mesh shape. Raises MeshError otherwise.
        """
        if self._device_mesh is not None:
            return self
        if not dist.is_available() or not dist.is_initialized():
            raise MeshError(f"{self} cannot bind: torch.distributed is not initialised "
                            f"(launch with torchrun or treadle.testing.spawn)")
        world = dist.get_world_size()
        if world != self.world_size:
            raise MeshError(f"{self} needs world size {self.world_size} "
                            f"({' x '.join(map(str, self.shape))}), but the launched world size is {world}")
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if dist.get_backend() == "nccl" and torch.cuda.is_available() else "cpu"
        dm = init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)
        object.__setattr__(self, "_device_mesh", dm)
        logger.info("bound %s on %s", self, device_type)
        return self

    @property
    def device_mesh(self):  # -> DeviceMesh
        if self._device_mesh is None:
            self.bind()
        return self._device_mesh

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank along `axis` (binds first)."""
        self.axis_index(axis)
        return self.device_mesh.get_group(axis)

    def flat_device_mesh(self, axes: tuple[str, ...]):  # -> DeviceMesh (1-D)
        """The 1-D DeviceMesh over the flattened group of mesh `axes`, named in mesh order (binds first): the
        axis's own sub-mesh for one axis, else the sub-mesh flattened row-major and named by the axes joined with
        "_" (made once per mesh; group rank i is the i-th coordinate in that order). Raises MeshError for an axis
        not of this mesh, named twice, or out of mesh order."""
        idx = [self.axis_index(a) for a in axes]
        if not idx or idx != sorted(set(idx)):
            raise MeshError(f"{self}: a flattened group names distinct axes in mesh order {list(self.names)}, got "
                            f"{list(axes)}")
        dm = self.device_mesh
        if len(axes) == 1:
            return dm[axes[0]]
        return dm[tuple(axes)]._flatten("_".join(axes))

    def flat_group(self, axes: tuple[str, ...]) -> dist.ProcessGroup:
        """The process group of the flattened mesh `axes` (`flat_device_mesh`)."""
        return self.flat_device_mesh(tuple(axes)).get_group()

    def flat_rank(self, axes: tuple[str, ...]) -> int:
        """This rank's index in the flattened group of mesh `axes` (row-major over them, in mesh order)."""
        i = 0
        for a in axes:
            i = i * self.size(a) + self.local_rank(a)
        return i

    def local_rank(self, axis: str) -> int:
        """This rank's coordinate along `axis` (binds first)."""
        self.axis_index(axis)
        return self.device_mesh.get_local_rank(axis)

    @property
    def device(self) -> torch.device:
        dm = self.device_mesh
        if dm.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
