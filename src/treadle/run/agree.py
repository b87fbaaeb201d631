"""Ranks agreeing on an outcome before they act on it: each rank brings its own problem (or None) and every
rank raises the same error, so that one rank's bad disk or missing file never leaves the others waiting in a
collective it will not join."""

from __future__ import annotations

import torch.distributed as dist

from .config import RunError


class JobError(RunError):
    """A RunError every rank of the job raises alike (so it is said once, not once per rank)."""


def agree(problem: str | None, *, group: dist.ProcessGroup | None = None) -> None:
    """Collective over `group` (default: the world): raise JobError with the first problem any rank brought
    (naming that rank when it is not the only one), or return when none did."""
    world = dist.get_world_size(group)
    found: list[str | None] = [None] * world
    dist.all_gather_object(found, problem, group=group)
    bad = [(r, p) for r, p in enumerate(found) if p is not None]
    if not bad:
        return
    rank, text = bad[0]
    text = text.removeprefix("treadle.run: ")
    everywhere = len(bad) == world
    others = f" (and on {len(bad) - 1} more rank{'s' if len(bad) > 2 else ''})" if 1 < len(bad) < world else ""
    where = f"rank {rank}: " if not everywhere else ""
    raise JobError(f"treadle.run: {where}{text}{others}")
