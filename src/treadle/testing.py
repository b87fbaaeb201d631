"""Spawn a CPU process group (gloo) with a timeout, run a function on every rank, return each rank's result.

The harness behind `verify` and the multi-process tests: a failing rank raises `SpawnError` leading with the
root cause (the rank that died, with its exit code or signal, or the one that raised, with its traceback), and
a stuck rank is killed after `timeout_s` and named by its heartbeat, so no test can hang.
"""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

from .transport import restore_after_load, sendable
from .errors import SpawnError

logger = logging.getLogger(__name__)

_CTX: Any = None


def _context():
    """A forkserver context with torch preloaded, so each spawned rank starts in well under a second."""
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        # treadle's layers by name (importing treadle alone loads none: NOTE [registrations on first use])
        # (transformers.modeling_utils imports torchao where it is installed: once here, not once per rank)
        ctx.set_forkserver_preload(["torch", "torch.distributed", "transformers", "transformers.modeling_utils",
                                    "treadle", "treadle.forms", "treadle.models.kernels", "treadle.verify",
                                    "treadle.runtime.train"])
        _CTX = ctx
    return _CTX


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


# NOTE [root cause]: when one rank fails, the others usually fail *because* of it (a peer's socket closes:
# "Connection reset by peer", "Connection closed by peer", a collective timeout). `spawn` therefore ranks what it
# saw: a rank that died without reporting (exit code or signal), then a rank that raised an error that is not
# such an echo, then the first error reported; a hang names the ranks whose heartbeat shows them outside any
# collective (the others wait for them).
_ECHO = ("connection reset", "connection closed", "connectfullmesh", "broken pipe", "timed out", "timeout",
         "gloo", "socket", "ncclremoteerror", "remote worker", "peer")
HEARTBEAT_S = 0.5


def is_echo(message: str) -> bool:
    """True when `message` reads like a consequence of another rank's failure (a closed peer connection or a
    collective timeout), not a cause of its own."""
    head = message.split("\n", 1)[0].lower()
    return any(k in head for k in _ECHO)


def root_cause(errors: dict[int, str]) -> int:
    """The rank of the error to show first among `errors` (rank -> message, in arrival order): the first
    that is not an echo of another rank's failure, else the first."""
    for rank, msg in errors.items():
        if not is_echo(msg):
            return rank
    return next(iter(errors))


def _where(frame: Any) -> tuple[str, bool]:
    """(innermost frame and innermost frame outside torch, whether the stack is inside torch.distributed)."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    in_dist = any(os.sep + os.path.join("torch", "distributed") in f.f_code.co_filename for f in stack)

    def fmt(f: Any) -> str:
        return f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)}:{f.f_lineno})"

    if not stack:
        return "?", in_dist
    inner = stack[0]
    user = next((f for f in stack if os.sep + "torch" + os.sep not in f.f_code.co_filename
                 and "threading" not in f.f_code.co_filename), None)
    text = fmt(inner) + (f" called from {fmt(user)}" if user is not None and user is not inner else "")
    del stack, inner, user
    return text, in_dist


def _heartbeat(rank: int, beats: Any, stop: threading.Event) -> None:
    main = threading.main_thread().ident
    while not stop.wait(HEARTBEAT_S):
        # only strings leave _where: holding a frame of the main thread past this line would keep its locals
        # (tensors) alive, which torch.export notices as stray fake tensors
        where, in_dist = _where(sys._current_frames().get(main))
        try:
            beats.put((rank, time.monotonic(), where, in_dist))
        except Exception:  # the parent has gone: nothing to tell
            return


def _rank_main(fn, rank: int, world_size: int, port: int, timeout_s: float, args: tuple, kwargs: dict, q,
               beats, nodes=None) -> None:
    import torch.distributed as dist

    addr = "127.0.0.1"
    if nodes is not None:  # first: the namespace holds for every socket and thread made from here on
        from .emulated_nodes import enter

        try:
            addr = enter(nodes, rank)
        except BaseException as exc:  # reported like any rank's failure, not as an exit without a result
            q.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            return
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    stop = threading.Event()
    beats.cancel_join_thread()  # heartbeats left unread must never keep this process from exiting
    threading.Thread(target=_heartbeat, args=(rank, beats, stop), daemon=True).start()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        restore_after_load(list(args) + list(kwargs.values()))  # NOTE [registrations lost in transport]
        out = fn(rank, world_size, *args, **kwargs)
        q.put((rank, "ok", _dumps(out)))
    except BaseException as exc:  # report every failure to the parent, whatever it is
        q.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        stop.set()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} ({-code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


GRACE_S = 3.0  # after a first failure: time for the other ranks to report their own errors

# NOTE [process count]: a mesh is data, and a schedule file can ask for any size; one CPU rank costs a process
# with torch imported (a few hundred MiB) and a share of the cores. Before anything starts, a process count on
# this host is refused above `process_limit()`: 8 per core (at least 16), and no more than the available memory
# at RANK_MEMORY_BYTES each. TREADLE_MAX_PROCS=N replaces the limit (the explicit override).
MAX_PROCS_ENV = "TREADLE_MAX_PROCS"
PROCS_PER_CORE = 8
MIN_PROCS_LIMIT = 16
RANK_MEMORY_BYTES = 256 * 2**20


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_limit() -> tuple[int, str]:
    """(the most processes this host may start for one job, the rule that set it): NOTE [process count]."""
    override = os.environ.get(MAX_PROCS_ENV, "").strip()
    if override:
        try:
            return max(1, int(override)), f"{MAX_PROCS_ENV}={override}"
        except ValueError:
            raise SpawnError(f"{MAX_PROCS_ENV}={override!r} is not a number of processes") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit, rule = max(MIN_PROCS_LIMIT, PROCS_PER_CORE * cores), f"{PROCS_PER_CORE} per core on {cores} cores"
    avail = _available_memory_bytes()
    if avail is not None and avail // RANK_MEMORY_BYTES < limit:
        limit = max(1, avail // RANK_MEMORY_BYTES)
        rule = f"{RANK_MEMORY_BYTES // 2**20} MiB each in {avail / 2**30:.1f} GiB available memory"
    return limit, rule


def check_process_count(n: int, *, where: str) -> None:
    """Raise SpawnError (one line, naming `where`) when `n` processes on this host exceed `process_limit()`
    (NOTE [process count]), before anything starts."""
    limit, rule = process_limit()
    if n > limit:
        raise SpawnError(f"{where}: {n:,} processes on this host exceed the limit of {limit:,} ({rule}); use a "
                         f"smaller mesh, or set {MAX_PROCS_ENV}=N to allow N processes")


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0, nodes: Any = None,
          **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on `world_size` gloo ranks; return results by rank.

    `fn` must be importable by name (module level). Results travel back through `torch.save`, so tensors
    and plain data are fine. Raises SpawnError leading with the root cause (NOTE [root cause]): the rank that
    died first with its exit code or signal, a rank that exited without reporting, the exception and
    traceback of a rank that raised (then the error has `root_rank` and `rank_errors`, rank -> "Type: message
    + traceback"); or, after `timeout_s` (counted from the call; the whole call ends within about 10% more),
    the ranks still running, each with where its heartbeat last saw it, the hung ones first. Every rank is
    killed before spawn returns or raises. Raises SpawnError before starting any when `world_size` exceeds
    this host's NOTE [process count]. `nodes`: a running `treadle.emulated_nodes.EmulatedNodes` of `world_size`
    ranks; each rank then runs in its node's network namespace (the slow link between nodes). A rendezvous port
    that another process took between `free_port` and rank 0's bind (EADDRINUSE at `init_process_group`, before
    `fn` ran anywhere) is retried on a new port, up to `_PORT_TRIES` times within `timeout_s`.
    """
    return _spawn(fn, world_size, args, kwargs, timeout_s, nodes, _PORT_TRIES)


_PORT_TRIES = 3


def _port_taken(errors: dict[int, str]) -> bool:
    """Whether a rank failed because the rendezvous port was taken (rank 0's store could not bind it), so that no
    rank got past `init_process_group` and the launch can be repeated on another port."""
    return any(("EADDRINUSE" in e or "address already in use" in e) and "init_process_group" in e
               for e in errors.values())


def _spawn(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout_s: float, nodes: Any,
           tries: int) -> list[Any]:
    if world_size < 1:
        raise SpawnError(f"spawn: world_size must be >= 1, got {world_size}")
    if nodes is not None and nodes.world_size != world_size:
        raise SpawnError(f"spawn: {world_size} ranks on {nodes} ({nodes.world_size} ranks)")
    check_process_count(world_size, where="spawn")
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    ctx = _context()
    sent = tuple(sendable(a) if isinstance(a, torch.nn.Module) else a for a in args)  # NOTE [registrations lost ...]
    q = ctx.Queue()
    beats = ctx.Queue()
    port = free_port()
    procs = []
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}  # arrival order
    deaths: dict[int, str] = {}  # rank -> how it ended without reporting, in the order seen
    last_beat: dict[int, tuple[float, str, bool]] = {}
    stop_at: float | None = None

    def drain_beats() -> None:
        while True:
            try:
                r, t, where, in_dist = beats.get_nowait()
            except (queue.Empty, OSError, EOFError):
                return
            last_beat[r] = (t, where, in_dist)

    def take(item: tuple) -> None:
        r, status, payload = item
        if status == "ok":
            results[r] = _loads(payload)
        else:
            errors[r] = payload

    try:
        for rank in range(world_size):
            p = ctx.Process(target=_rank_main, daemon=True,
                            args=(fn, rank, world_size, port, timeout_s, sent, kwargs, q, beats, nodes))
            p.start()
            procs.append(p)
        while len(results) + len(errors) + len(deaths) < world_size:
            now = time.monotonic()
            if now >= deadline or (stop_at is not None and now >= stop_at):
                break
            drain_beats()
            try:
                take(q.get(timeout=min(0.2, max(deadline - now, 0.01))))
                continue
            except queue.Empty:
                pass
            for i, p in enumerate(procs):
                if i in results or i in errors or i in deaths or p.exitcode is None:
                    continue
                # it has ended: its report may still be in the pipe
                try:
                    while True:
                        take(q.get(timeout=0.3))
                except queue.Empty:
                    pass
                if i not in results and i not in errors:
                    deaths[i] = _exit_text(p.exitcode) + " without reporting a result"
            if (errors or deaths) and stop_at is None:
                stop_at = min(deadline, time.monotonic() + GRACE_S)
        drain_beats()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=2)
    elapsed_s = time.monotonic() - t0
    if errors and not results and tries > 1 and _port_taken(errors) and time.monotonic() < deadline - 1.0:
        return _spawn(fn, world_size, args, kwargs, deadline - time.monotonic(), nodes, tries - 1)
    if deaths:
        first = next(iter(deaths))
        others = _others(errors, {r: d for r, d in deaths.items() if r != first})
        raise SpawnError(f"spawn: rank {first} of {world_size} {deaths[first]} (root cause){others}")
    if errors:
        first = root_cause(errors)
        also = sorted(set(errors) - {first})
        err = SpawnError(f"spawn: rank {first} of {world_size} failed:\n{errors[first]}"
                         + (f"\n(ranks {also} failed after it)" if also else ""))
        err.root_rank, err.rank_errors = first, dict(errors)  # for callers that word it their way (verify)
        raise err
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise SpawnError(_hang_message(missing, world_size, timeout_s, elapsed_s, last_beat, results))
    return [results[r] for r in range(world_size)]


def _others(errors: dict[int, str], deaths: dict[int, str]) -> str:
    parts = [f"rank {r}: {d}" for r, d in deaths.items()]
    parts += [f"rank {r}: {m.splitlines()[0][:160]}" for r, m in errors.items()]
    return ("; then " + "; ".join(parts)) if parts else ""


def _hang_message(missing: list[int], world_size: int, timeout_s: float, elapsed_s: float,
                  last_beat: dict[int, tuple[float, str, bool]], results: dict[int, Any]) -> str:
    now = time.monotonic()
    hung = [r for r in missing if r not in last_beat or not last_beat[r][2] or now - last_beat[r][0] > 5.0]
    waiting = [r for r in missing if r not in hung]
    lines = []
    for r in hung + waiting:
        if r not in last_beat:
            lines.append(f"  rank {r}: no heartbeat (never started)")
        else:
            t, where, in_dist = last_beat[r]
            state = "waiting in a collective" if in_dist else "busy outside any collective"
            lines.append(f"  rank {r}: {state}, at {where} (heartbeat {now - t:.1f} s ago)")
    head = (f"spawn: rank {hung[0]} of {world_size} hung" if hung else
            f"spawn: ranks {missing} of {world_size} all wait in collectives")
    done = sorted(results)
    return (f"{head}: ranks {missing} still running after {timeout_s:.0f} s (timeout; {elapsed_s:.1f} s "
            f"elapsed), killed" + (f"; ranks {done} had returned" if done else "") + "\n" + "\n".join(lines))
