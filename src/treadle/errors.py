"""The one family of treadle errors. Each names the path, parameter, axis or size at fault."""

from __future__ import annotations


class TreadleError(Exception):
    """Base class of every error treadle raises on purpose."""


class MeshError(TreadleError):
    """A mesh that is malformed, or that does not match the launched world."""


class ScheduleError(TreadleError):
    """A schedule primitive applied to something it cannot apply to (path, parameter, axis, size)."""


class BuildError(TreadleError):
    """`build` could not turn a schedule into a distributed model."""


class VerifyError(TreadleError):
    """A scheduled model does not compute what the original computes."""


class ProfileError(TreadleError):
    """The symbolic profiler met an op or module it cannot account for."""


class LayoutError(TreadleError):
    """A layout that is malformed, does not fit a mesh, or does not divide a tensor."""


class PlanError(TreadleError):
    """The planner found no plan (e.g. an infeasible memory budget) or was given bad constraints."""


class SpawnError(TreadleError):
    """A rank of a spawned process group failed or timed out."""
