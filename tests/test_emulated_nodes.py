"""Emulated nodes (treadle.emulated_nodes): ranks in network namespaces with a rate-limited link between nodes.

The link test is the utility's own function, not a performance assertion on treadle: a tbf rate limit is a hard
ceiling, so a transfer across nodes cannot beat bytes / rate (less the bucket), and one inside a node does not
pass it at all."""

from __future__ import annotations

import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from treadle import Mesh
from treadle.emulated_nodes import EmulationError, emulated_nodes, rate_bits_per_s, unavailable
from treadle.testing import spawn

WHY = unavailable()
needs_netns = pytest.mark.skipif(WHY is not None, reason=WHY or "")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_rates_read_as_tc_reads_them():
    assert rate_bits_per_s("100mbit") == 1e8
    assert rate_bits_per_s("1gbit") == 1e9
    assert rate_bits_per_s("50mbps") == 4e8  # tc's bps are bytes
    with pytest.raises(EmulationError, match=r"rate '100 megabits' is not a tc rate like '100mbit'"):
        rate_bits_per_s("100 megabits")
    with pytest.raises(EmulationError, match=r"need >= 2 nodes of >= 1 rank; got 1 x 4"):
        with emulated_nodes(1, 4):
            pass


def _one_way(rank: int, world: int, nbytes: int, reps: int) -> dict[str, float]:
    """Seconds to move `nbytes` one way: rank 0 to rank 1 (inside node 0), rank 0 to rank 2 (across), and rank 0
    to 2 with rank 1 to 3 at the same time (two transfers across), each ended by a barrier."""
    x = torch.zeros(nbytes // 4)
    out = {}
    for name, pairs in (("inside", [(0, 1)]), ("across", [(0, 2)]), ("two across", [(0, 2), (1, 3)])):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            for src, dst in pairs:
                if rank == src:
                    dist.send(x, dst)
                elif rank == dst:
                    dist.recv(x, src)
            dist.barrier()
        out[name] = (time.perf_counter() - t0) / reps
    return out


@needs_netns
def test_a_transfer_across_nodes_runs_at_the_rate_limit_and_inside_one_does_not():
    """One link per node, shared by its ranks: one transfer across takes bytes / rate, two at once twice that;
    inside a node there is no limit."""
    nbytes = 4 << 20
    with emulated_nodes(2, 2, rate="200mbit") as nodes:
        assert nodes.tag in _namespaces()
        assert [nodes.node_of(r) for r in range(4)] == [0, 0, 1, 1]
        t = spawn(_one_way, 4, nbytes, 3, nodes=nodes, timeout_s=120)[0]
        expected = nbytes / nodes.rate_bytes_per_s  # 0.168 s: 4 MiB at 25 MB/s
    assert nodes.tag not in _namespaces()  # removed on exit
    assert 0.8 * expected <= t["across"] <= 2 * expected, (t, expected)
    assert 1.6 * expected <= t["two across"] <= 4 * expected, (t, expected)
    assert t["inside"] < t["across"] / 2, t  # loopback: no limit (loose: a loaded host slows the copy)


@needs_netns
def test_the_namespaces_are_removed_when_the_body_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with emulated_nodes(3, 1, rate="1gbit") as nodes:
            assert _namespaces().count(nodes.tag) == 4  # three nodes and the hub
            raise RuntimeError("boom")
    assert nodes.tag not in _namespaces()


@needs_netns
@pytest.mark.slow
def test_calibrate_measures_the_axis_across_nodes_at_the_rate_limit():
    """treadle calibrate on 2 emulated nodes x 2 ranks: dp (across nodes) is fitted near its share of the rate
    limit (its two groups cross at once: half each), tp (inside a node) on loopback, several times faster; the
    notes say which axes crossed."""
    from treadle.cost.this_host import calibrate_this_host

    with emulated_nodes(2, 2, rate="400mbit") as nodes:
        cal = calibrate_this_host(Mesh((2, 2), ("dp", "tp")), rounds=3, chain=1, cpu=False, nodes=nodes,
                                  timeout_s=300)
    dp, tp = cal.cluster.link("dp"), cal.cluster.link("tp")
    share = nodes.rate_bytes_per_s / 2
    assert 0.5 * share <= dp.bandwidth_bytes_per_s * dp.efficiency <= 1.5 * share, (dp, share)
    assert tp.bandwidth_bytes_per_s * tp.efficiency > 3 * dp.bandwidth_bytes_per_s * dp.efficiency, (tp, dp)
    assert "as 2 emulated nodes x 2 ranks, 400mbit between nodes (axes across nodes: dp)" in cal.notes[0]


def test_calibrate_refuses_a_node_count_that_does_not_divide_the_mesh(capsys):
    from treadle.cli import main

    assert main(["calibrate", "--mesh", "2x2", "--emulate-nodes", "3"]) != 0
    err = capsys.readouterr().err
    assert "calibrate: --emulate-nodes 3 must be >= 2 and divide the 4 ranks of --mesh 2x2" in err


@needs_netns
@pytest.mark.slow
def test_treadle_run_trains_across_emulated_nodes_with_the_losses_of_one_host(tmp_path):
    """`run_torchrun`: a torchrun per node in its namespace; treadle.run's DDP job over 2 nodes x 1 rank logs the
    same losses as the same job on one host (the link changes time, not numbers)."""
    import json
    import os
    import sys
    from pathlib import Path

    from treadle.emulated_nodes import run_torchrun
    from treadle.testing import free_port

    root = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": str(root / "src"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}

    def argv(metrics):
        return ["-m", "treadle.run", "--model", "tiny-llama", "--data", str(root / "examples" / "data" / "village.txt"),
                "--seq", "32", "--batch", "4", "--steps", "2", "--recipe", "ddp", "--hardware", "none",
                "--metrics", str(metrics)]

    with emulated_nodes(2, 1, rate="1gbit") as nodes:
        run_torchrun(nodes, argv(tmp_path / "nodes.jsonl"), env=env, timeout_s=300)
    one = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), *argv(tmp_path / "host.jsonl")], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    losses = [[json.loads(x)["loss"] for x in (tmp_path / f).read_text().splitlines()] for f in ("nodes.jsonl",
                                                                                                 "host.jsonl")]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
