"""treadle: optimise the training of a stock PyTorch model with a separate, progressive schedule, or let
the planner write that schedule; build it on torch.distributed and verify it against the original.

Importing treadle is cheap: the names below (``treadle.build``, ``treadle.Schedule``, ...) and every layer's
registrations load together the first time one of them is used or a registry is read (NOTE [registrations on
first use] in `treadle.lazy`), so the command line checks its arguments before torch.distributed, transformers
or the solver are imported.
"""

from . import lazy as _lazy
from . import quiet as _quiet
from .errors import (BuildError, LayoutError, MeshError, PlanError, ProfileError, ScheduleError, SpawnError,
                     TreadleError, VerifyError)

_quiet.install()  # NOTE [torchao's import noise]

_PLACEMENTS = "torch.distributed.tensor.placement_types"
_PUBLIC = {
    "Shard": f"{_PLACEMENTS}:Shard", "Replicate": f"{_PLACEMENTS}:Replicate", "Partial": f"{_PLACEMENTS}:Partial",
    "Mesh": "treadle.mesh:Mesh", "annotations": "treadle.runtime.build:annotations",
    "build": "treadle.runtime.build:build", "TrainResult": "treadle.runtime.train:TrainResult",
    "train": "treadle.runtime.train:train", "Schedule": "treadle.schedule.core:Schedule",
    "create_schedule": "treadle.schedule.core:create_schedule", "load_schedule": "treadle.schedule.replay:load_schedule",
    "Ref": "treadle.schedule.log:Ref", "register_ref": "treadle.schedule.log:register_ref",
    "VerifyReport": "treadle.verify:VerifyReport", "verify": "treadle.verify:verify", "price": "treadle.pricing:price",
    "models": "treadle.models",
}


def _load_layers() -> None:
    """Import every module the facade once imported eagerly, in its order: those that register with a lower layer
    (the graph-level and pipeline build steps, the graph layer, kernel forms, the parallel forms) and those whose
    classes a file may name as already imported (`treadle.schedule.gate.resolve_class`)."""
    from .runtime import build, graph_steps, train  # noqa: F401
    from .schedule import core, log, replay  # noqa: F401
    from . import verify  # noqa: F401
    from . import graph  # noqa: F401  (registers the graph layer with the schedule's graph primitives)
    from .models import kernels  # noqa: F401  (op forms and decompositions of transformers' classes, by name)
    from . import pricing  # noqa: F401  (one price for every schedule)
    from . import forms  # noqa: F401  (the parallel forms register themselves with the core layers)
    from .models import megatron  # noqa: F401  (ready-made schedules, after the core)


_lazy.set_loader(_load_layers)
_lazy.export_lazily(__name__, _PUBLIC, before=_lazy.load_registrations)

__all__ = [
    "Mesh", "Schedule", "create_schedule", "load_schedule", "build", "annotations", "Ref", "register_ref", "verify",
    "VerifyReport", "train", "TrainResult", "price",
    "Shard", "Replicate", "Partial",
    "TreadleError", "MeshError", "ScheduleError", "BuildError", "VerifyError", "ProfileError", "LayoutError",
    "PlanError", "SpawnError", "models",
]
