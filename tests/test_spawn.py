import pytest
import torch
import torch.distributed as dist

from treadle import testing
from treadle.errors import SpawnError


def _allreduce(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()
    return rank


def _hang(rank, world):
    import time
    time.sleep(60)


def test_spawn_returns_results_by_rank():
    out = testing.spawn(_allreduce, 2)
    assert [t.item() for t in out] == [3.0, 3.0]


def test_spawn_reports_failing_rank():
    with pytest.raises(SpawnError, match=r"rank 1 of 2 failed:\nValueError: rank one is broken"):
        testing.spawn(_fail_on_one, 2, timeout_s=60)


def test_spawn_kills_stuck_ranks():
    with pytest.raises(SpawnError, match=r"still running after 3 s"):
        testing.spawn(_hang, 2, timeout_s=3)
