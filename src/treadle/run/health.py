"""Which ranks fell behind: every rank records its last finished step in the job's rendezvous store (hosted
by torchrun's agent, so it outlives any worker), so that a rank whose collective failed or timed out can
name the ranks that stopped, dead or hung."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

_KEY = "treadle/run/last_step/{}"


def _store() -> Any:  # a torch.distributed Store, or None outside a job
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # no process group, or a store that cannot be reached any more
        return None


def mark(step: int, *, rank: int | None = None, store: Any = None) -> None:
    """Record that `rank` (default: this rank) finished optimizer step `step` in `store` (default: the job's)."""
    store = store if store is not None else _store()
    if store is not None:
        store.set(_KEY.format(dist.get_rank() if rank is None else rank), str(step))


def behind(world: int, *, store: Any = None) -> dict[int, int | None]:
    """Ranks whose last finished step is behind the furthest rank's: {rank: last step, None if never}.
    Empty when the store cannot be read (then nothing is known)."""
    store = store if store is not None else _store()
    if store is None:
        return {}
    steps: dict[int, int | None] = {}
    try:
        for r in range(world):
            key = _KEY.format(r)
            steps[r] = int(store.get(key)) if store.check([key]) else None
    except Exception as exc:  # the store's host died with the job
        logger.debug("cannot read the step store: %s", exc)
        return {}
    top = max((s for s in steps.values() if s is not None), default=None)
    return {r: s for r, s in steps.items() if s is None or (top is not None and s < top)}
