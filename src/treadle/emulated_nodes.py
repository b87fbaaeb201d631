"""Emulated nodes on one host: gloo ranks in separate network namespaces, with a slower link between "nodes" than
inside one, so that a measured test or bench can show a plan adapting to the links (tensor parallelism inside a
node, the slow link left to what tolerates it).

Each node is a network namespace with one veth interface (``tdl0``, address ``10.213.0.<node + 1>/24``) whose
peer is attached to a bridge in a hub namespace; a `tbf` rate limit sits on both ends of every node's veth, so
traffic between two nodes passes the limit once each way out of a node and once into the other (both at
`rate`: the path runs at `rate`). A node has one link, shared by its ranks (one NIC per node): two transfers
out of a node at once get half the rate each, as the groups of a data-parallel axis crossing nodes do when they
reduce together. Ranks of one node reach each other at the node's own address, which Linux routes over the
namespace's loopback: no limit. Ranks are laid out as `ClusterSpec` lays out a physical cluster: node-major, the
ranks of one node consecutive, so on a (nodes, ranks_per_node) mesh the last axis stays inside a node and the
first crosses the slow link.

    with emulated_nodes(2, 2, rate="200mbit") as cluster:       # root, `ip` and `tc` needed
        spawn(fn, 4, nodes=cluster)                             # ranks 0, 1 on node 0; 2, 3 on node 1

A spawned rank enters its node's namespace (`enter`) before it opens any socket, and rendezvous at node 0's address. A
launched job runs one torchrun per node inside its namespace (`run_torchrun(cluster, ["-m", "treadle.run", ...])`:
static rendezvous at node 0, gloo on the node's interface). Everything is removed on exit (deleting a namespace deletes
its interfaces), also when the body raises; `unavailable()` says why this host cannot do it (not root, no `ip` / `tc`,
no namespaces), for a test to skip. Only addresses inside namespaces this module creates are used: nothing outside them
is touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from typing import Iterator

from .errors import TreadleError

INTERFACE = "tdl0"  # the node's veth, the same name in every node's namespace
SUBNET = "10.213.0"
_CLONE_NEWNET = 0x40000000
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


class EmulationError(TreadleError):
    """The emulated nodes could not be set up (or this host cannot make them)."""


def rate_bits_per_s(rate: str) -> float:
    """A tc rate (``100mbit``, ``1gbit``, ``50mbps``: bytes, as tc reads them) in bits per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]+)\s*", rate)
    if m is None or m.group(2).lower() not in _RATE_UNITS:
        raise EmulationError(f"emulated nodes: rate {rate!r} is not a tc rate like '100mbit', '1gbit' or '50mbps'")
    bits = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    if bits <= 0:
        raise EmulationError(f"emulated nodes: rate {rate!r} must be positive")
    return bits


@dataclass(frozen=True)
class EmulatedNodes:
    """A running set of emulated nodes (`emulated_nodes` makes one): `nodes` namespaces of `ranks_per_node`
    ranks each, `rate` between nodes (a tc rate). `tag` makes the namespace names unique to this set."""

    nodes: int
    ranks_per_node: int
    rate: str
    tag: str

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def rate_bytes_per_s(self) -> float:
        return rate_bits_per_s(self.rate) / 8

    def namespace(self, node: int) -> str:
        return f"tdl{self.tag}n{node}"

    @property
    def hub(self) -> str:
        return f"tdl{self.tag}hub"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def node_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise EmulationError(f"emulated nodes: rank {rank} outside the {self.world_size} ranks of {self}")
        return rank // self.ranks_per_node

    def __str__(self) -> str:
        return f"{self.nodes} emulated nodes x {self.ranks_per_node} ranks, {self.rate} between nodes"


def unavailable() -> str | None:
    """Why this host cannot make emulated nodes (None: it can): not root, `ip` or `tc` missing, or the kernel
    refuses a network namespace, a veth pair or a tbf queue."""
    if os.geteuid() != 0:
        return "emulated nodes need root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulated nodes need `{tool}` (iproute2)"
    probe = f"tdlprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
        _run("ip", "-n", probe, "link", "add", "pbr", "type", "bridge")
        _run("tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1gbit", "burst", "64kb",
             "latency", "50ms")
    except EmulationError as exc:
        return str(exc)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*cmd: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise EmulationError(f"emulated nodes: `{' '.join(cmd)}` failed: {res.stderr.strip() or res.returncode}")


def _burst_bytes(rate_bytes_per_s: float) -> int:
    """The tbf bucket: at least what the rate sends in 10 ms (a kernel tick at HZ=100), and 64 KiB, so that the
    rate is met without drops of whole segments."""
    return int(max(64 << 10, rate_bytes_per_s / 100))


@contextlib.contextmanager
def emulated_nodes(nodes: int, ranks_per_node: int, *, rate: str = "100mbit") -> Iterator[EmulatedNodes]:
    """Make `nodes` emulated nodes of `ranks_per_node` ranks with `rate` between them (module docstring); yield
    them; remove every namespace on exit. Raises EmulationError when the host cannot (`unavailable`) or a
    command fails (what was made is removed first)."""
    if nodes < 2 or ranks_per_node < 1:
        raise EmulationError(f"emulated nodes: need >= 2 nodes of >= 1 rank; got {nodes} x {ranks_per_node}")
    if nodes > 250:
        raise EmulationError(f"emulated nodes: at most 250 nodes in {SUBNET}.0/24; got {nodes}")
    why = unavailable()
    if why:
        raise EmulationError(why)
    cluster = EmulatedNodes(nodes, ranks_per_node, rate, tag=str(os.getpid()))
    burst = _burst_bytes(cluster.rate_bytes_per_s)
    tbf = ("root", "tbf", "rate", rate, "burst", str(burst), "latency", "100ms")
    made: list[str] = []
    try:
        _run("ip", "netns", "add", cluster.hub)
        made.append(cluster.hub)
        _run("ip", "-n", cluster.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", cluster.hub, "link", "set", "br0", "up")
        for k in range(nodes):
            ns = cluster.namespace(k)
            _run("ip", "netns", "add", ns)
            made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", cluster.hub, "link", "add", f"h{k}", "type", "veth", "peer", "name", INTERFACE,
                 "netns", ns)
            _run("ip", "-n", cluster.hub, "link", "set", f"h{k}", "master", "br0")
            _run("ip", "-n", cluster.hub, "link", "set", f"h{k}", "up")
            _run("ip", "-n", ns, "addr", "add", f"{cluster.address(k)}/24", "dev", INTERFACE)
            _run("ip", "-n", ns, "link", "set", INTERFACE, "up")
            _run("tc", "-n", ns, "qdisc", "add", "dev", INTERFACE, *tbf)  # out of the node
            _run("tc", "-n", cluster.hub, "qdisc", "add", "dev", f"h{k}", *tbf)  # into the node
        yield cluster
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def enter(cluster: EmulatedNodes, rank: int) -> str:
    """Move this process (its calling thread, and every thread and socket it makes after) into the namespace of
    `rank`'s node and point gloo at the node's interface; returns node 0's address, where the ranks rendezvous.
    Call it first thing in a fresh rank process, before any socket or thread exists."""
    ns = cluster.namespace(cluster.node_of(rank))
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise EmulationError(f"emulated nodes: rank {rank} cannot enter namespace {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = INTERFACE
    return cluster.address(0)


def torchrun_commands(cluster: EmulatedNodes, argv: list[str], *, port: int = 29500,
                      python: str | None = None) -> list[list[str]]:
    """One torchrun per node, inside its namespace (``ip netns exec``), rendezvousing at node 0's address (static:
    node 0 hosts the store); `argv` is what follows torchrun's options (``-m treadle.run ...`` or a script)."""
    import sys

    return [["ip", "netns", "exec", cluster.namespace(k), python or sys.executable, "-m", "torch.distributed.run",
             "--nnodes", str(cluster.nodes), "--node-rank", str(k), "--nproc-per-node", str(cluster.ranks_per_node),
             "--master-addr", cluster.address(0), "--master-port", str(port), *argv] for k in range(cluster.nodes)]


def run_torchrun(cluster: EmulatedNodes, argv: list[str], *, env: dict[str, str] | None = None, port: int = 29500,
                 timeout_s: float = 600.0) -> list[str]:
    """Launch `torchrun_commands` (gloo pointed at each node's interface), wait for all; returns each node's
    stdout. Raises EmulationError naming the first node that failed or was stopped at `timeout_s` (its stderr's
    tail); once one node fails, the others are killed too."""
    import tempfile
    import time

    full_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": INTERFACE}
    with tempfile.TemporaryDirectory() as tmp:  # files, not pipes: a node blocked on a full pipe would hang its peers
        files = [(open(os.path.join(tmp, f"{k}.out"), "w+"), open(os.path.join(tmp, f"{k}.err"), "w+"))
                 for k in range(cluster.nodes)]
        procs = [subprocess.Popen(cmd, env=full_env, stdout=o, stderr=e, text=True, start_new_session=True)
                 for cmd, (o, e) in zip(torchrun_commands(cluster, argv, port=port), files)]
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.poll() is None for p in procs):
                failed = [p for p in procs if p.poll()]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            for p in procs:  # the whole session: torchrun and its ranks
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        texts = []
        for o, e in files:
            o.seek(0), e.seek(0)
            texts.append((o.read(), e.read()))
            o.close(), e.close()
    order = sorted(range(cluster.nodes), key=lambda k: procs[k].returncode <= 0)  # a node that failed on its own first
    for k in order:
        p, err = procs[k], texts[k][1]
        if p.returncode:
            why = (f"was killed by signal {-p.returncode} (the {timeout_s:.0f} s limit, or a node that failed "
                   f"first)" if p.returncode < 0 else f"exited with {p.returncode}")
            raise EmulationError(f"emulated nodes: node {k} of {cluster} {why}:\n{err[-3000:]}")
    return [out for out, _ in texts]
