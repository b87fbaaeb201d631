"""treadle: optimise the training of a stock PyTorch model with a separate, progressive schedule, or let
the planner write that schedule; build it on torch.distributed and verify it against the original."""

from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .errors import (BuildError, LayoutError, MeshError, PlanError, ProfileError, ScheduleError, SpawnError,
                     TreadleError, VerifyError)
from .mesh import Mesh
from .runtime.build import annotations, build
from .runtime import graph_steps as _graph_steps  # noqa: F401  (the graph-level and pipeline build steps)
from .runtime.train import TrainResult, train
from .schedule.core import Schedule, create_schedule
from .schedule.replay import load_schedule
from .schedule.log import Ref, register_ref
from .verify import VerifyReport, verify
from . import graph as _graph  # noqa: E402,F401  (registers the graph layer with the schedule's graph primitives)


try:  # model-specific op forms and decompositions for patterns (need transformers)
    from .models import kernels as _kernels  # noqa: F401
except ImportError:  # pragma: no cover - transformers is a dependency
    pass

from .pricing import price  # noqa: E402  (one price for every schedule)
from . import forms  # noqa: E402,F401  (the parallel forms register themselves with the core layers)
from . import models  # noqa: E402  (ready-made schedules: treadle.models.megatron, ...; after the core)

__all__ = [
    "Mesh", "Schedule", "create_schedule", "load_schedule", "build", "annotations", "Ref", "register_ref", "verify",
    "VerifyReport", "train", "TrainResult", "price",
    "Shard", "Replicate", "Partial",
    "TreadleError", "MeshError", "ScheduleError", "BuildError", "VerifyError", "ProfileError", "LayoutError",
    "PlanError", "SpawnError", "models",
]
