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


def test_a_rendezvous_port_taken_meanwhile_is_retried_on_another(monkeypatch):
    """The port `free_port` returned is taken by another process before rank 0 binds it (a test beside this one,
    say): rank 0's init_process_group fails with EADDRINUSE before any rank ran `fn`, and spawn launches again on
    a new port. With one try the same error is raised."""
    import socket

    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    ports = []
    real = testing.free_port

    def first_taken() -> int:
        ports.append(taken if not ports else real())
        return ports[-1]

    monkeypatch.setattr(testing, "free_port", first_taken)
    try:
        out = testing.spawn(_allreduce, 2, timeout_s=60)
        assert [t.item() for t in out] == [3.0, 3.0] and len(ports) == 2 and ports[0] == taken
        ports.clear()
        monkeypatch.setattr(testing, "_PORT_TRIES", 1)
        with pytest.raises(SpawnError, match="EADDRINUSE|address already in use"):
            testing.spawn(_allreduce, 2, timeout_s=60)
    finally:
        held.close()


def test_a_torchrun_launch_is_repeated_on_another_port_only_when_its_port_was_taken(tmp_path):
    import sys

    from run_job import run_on_a_free_port

    count = tmp_path / "launches"

    def cmd(fail: str):
        code = (f"import pathlib, sys; p = pathlib.Path({str(count)!r}); n = int(p.read_text()) if p.exists() else 0;"
                f" p.write_text(str(n + 1)); sys.exit({fail!r} if n == 0 else 0)")
        return lambda port: [sys.executable, "-c", code, str(port)]

    res = run_on_a_free_port(cmd("torch.distributed.DistNetworkError: The server socket has failed to listen on any "
                                 "local network address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE"))
    assert res.returncode == 0 and count.read_text() == "2"  # launched again, on another port
    count.unlink()
    res = run_on_a_free_port(cmd("RuntimeError: a rank failed (EADDRINUSE connecting to a peer)"))
    assert res.returncode == 1 and "a rank failed" in res.stderr and count.read_text() == "1"  # not repeated
