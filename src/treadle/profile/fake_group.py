"""A fake process group for the span of one rehearsal or probe, leaving the calling process as it was.

NOTE [a fake group leaves no trace]: `torch.distributed.init_process_group` wraps `sys.excepthook` (to prefix
uncaught tracebacks with the rank) and `destroy_process_group` does not unwrap it. treadle builds rank 0 on a fake
group for every price (and the DTensor / FSDP2 probes of `calibrate_cpu`), so a session that priced a few hundred
schedules printed each later traceback line behind as many ``[rank0]:`` prefixes, each a closure kept alive. The
context below restores the hook it found, whatever the group did to it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A fake (nothing sent) default process group of `world_size` ranks, this process rank 0, destroyed on exit;
    `sys.excepthook` as it was before (NOTE [a fake group leaves no trace])."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        try:
            dist.destroy_process_group()
        finally:
            sys.excepthook = hook


__all__ = ["fake_process_group"]
