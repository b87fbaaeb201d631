"""Injected faults: `spawn` (and `verify` on top of it) names the root cause, not an echo, within the timeout.

Each fault puts rank 1 in trouble while rank 0 waits in a collective for it; the error must name rank 1 and
what happened to it, and the call must end within its timeout plus 10%."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import treadle
from treadle import Mesh, Shard, testing
from treadle.errors import SpawnError, VerifyError


def _ok(rank, world):
    return rank


@pytest.fixture(scope="module", autouse=True)
def warm_forkserver():
    """The first spawn starts the forkserver (imports torch and transformers once); time the faults after it."""
    testing.spawn(_ok, 2, timeout_s=120)


def _killed(rank, world):
    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def _raises_after_peer_echo(rank, world):
    if rank == 1:  # close our end first, so rank 0's "connection closed" reaches the parent before our error
        dist.destroy_process_group()
        time.sleep(1.0)
        raise ValueError("rank one is broken")
    dist.all_reduce(torch.ones(1))


def _exits_zero(rank, world):
    if rank == 1:
        os._exit(0)
    dist.all_reduce(torch.ones(1))


def _hangs(rank, world):
    if rank == 1:
        time.sleep(120)
    dist.all_reduce(torch.ones(1))


def _timed(fn, timeout_s):
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as info:
        testing.spawn(fn, 2, timeout_s=timeout_s)
    return str(info.value), time.monotonic() - t0


def test_rank_killed_by_a_signal_is_the_root_cause():
    msg, took = _timed(_killed, 30)
    assert msg.startswith("spawn: rank 1 of 2 killed by signal SIGKILL (9) without reporting a result (root cause)")
    assert took < 30 * 1.1


def test_raising_rank_leads_over_the_peers_connection_errors():
    msg, took = _timed(_raises_after_peer_echo, 30)
    assert msg.startswith("spawn: rank 1 of 2 failed:\nValueError: rank one is broken"), msg
    assert "Traceback" in msg and "_raises_after_peer_echo" in msg
    assert "(ranks [0] failed after it)" in msg
    assert took < 30 * 1.1


def test_rank_that_exits_zero_without_reporting_is_named_at_once():
    msg, took = _timed(_exits_zero, 30)
    assert msg.startswith("spawn: rank 1 of 2 exited with code 0 without reporting a result (root cause)"), msg
    assert took < 15  # not the timeout


def test_hung_rank_is_named_by_its_heartbeat_within_the_timeout():
    msg, took = _timed(_hangs, 8)
    assert msg.startswith("spawn: rank 1 of 2 hung: ranks [0, 1] still running after 8 s"), msg
    assert "rank 1: busy outside any collective, at sleep" in msg or "rank 1: busy outside any collective" in msg
    assert "rank 0: waiting in a collective" in msg
    assert 8 <= took < 8 * 1.1


class _FailsOnRank1(nn.Module):
    """A sharded Linear whose forward raises on rank 1 only (after the shard, before the reduction)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("injected failure on rank 1")
        return self.out(h)


def test_verify_reports_the_rank_whose_forward_raised():
    torch.manual_seed(0)
    sch = treadle.create_schedule(_FailsOnRank1(), mesh=Mesh((2,), ("tp",)))
    sch["fc"].shard(["weight", "bias"], dim=0, axis="tp")
    sch["out"].shard("weight", dim=1, axis="tp").sync("fwd_post", to=treadle.Replicate(), axis="tp")
    with pytest.raises(VerifyError, match=r"rank 1: forward failed in module '<model>': RuntimeError: injected "
                                          r"failure on rank 1"):
        treadle.verify(sch, {"x": torch.randn(4, 8)}, timeout_s=60)


class _NanLaterOnRank1(nn.Module):
    """Correct at step 0; from the second forward on, rank 1 (not the representative of its replica) turns NaN."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        y = self.fc(x)
        self.calls += 1
        if self.calls > 1 and dist.is_initialized() and dist.get_rank() == 1:
            y = y * float("nan")
        return y


def test_verify_compares_every_rank_at_every_step():
    torch.manual_seed(0)
    sch = treadle.create_schedule(_NanLaterOnRank1(), mesh=Mesh((2,), ("tp",)))
    sch["fc"].shard(["weight", "bias"], dim=0, axis="tp").sync("fwd_post", to=treadle.Replicate(), axis="tp")
    report = treadle.verify(sch, {"x": torch.randn(4, 8)}, steps=2, timeout_s=60, raise_on_mismatch=False)
    bad = {c.name for c in report.failures()}
    assert bad == {"step 1 rank 1 vs rank 0", "<model> after step 1"}, report.summary()


class _RaisesBeforeAnyCollectiveOnRank1(nn.Module):
    """Under DDP the forward has no collective: rank 1 raises while rank 0 goes on to the backward's
    all-reduce and fails there with a closed connection, an echo that must not hide rank 1's error."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("injected failure on rank 1")
        return self.fc(x)


def test_verify_reports_the_raising_rank_not_the_peer_that_failed_after_it():
    torch.manual_seed(0)
    sch = treadle.create_schedule(_RaisesBeforeAnyCollectiveOnRank1(), mesh=Mesh((2,), ("dp",)))
    sch.data_parallel(axis="dp")
    with pytest.raises(VerifyError) as info:
        treadle.verify(sch, {"x": torch.randn(4, 8)}, timeout_s=60)
    assert str(info.value) == ("verify FAILED: rank 1: forward failed in module '<model>': RuntimeError: injected "
                               "failure on rank 1")
