"""Spawn a CPU process group (gloo) with a timeout, run a function on every rank, return each rank's result.

The harness behind `verify` and the multi-process tests: a failing rank raises `SpawnError` carrying its
traceback, and a stuck rank is killed after `timeout_s`, so no test can hang.
"""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

from .errors import SpawnError

logger = logging.getLogger(__name__)

_CTX: Any = None


def _context():
    """A forkserver context with torch preloaded, so each spawned rank starts in well under a second."""
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "transformers", "treadle"])
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


def _rank_main(fn, rank: int, world_size: int, port: int, timeout_s: float, args: tuple, kwargs: dict, q) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        out = fn(rank, world_size, *args, **kwargs)
        q.put((rank, "ok", _dumps(out)))
    except BaseException as exc:  # report every failure to the parent, whatever it is
        q.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on `world_size` gloo ranks; return results by rank.

    `fn` must be importable by name (module level). Results travel back through `torch.save`, so tensors
    and plain data are fine. Raises SpawnError naming the rank and its traceback when a rank fails, or the
    ranks still running when `timeout_s` elapses (those are killed).
    """
    if world_size < 1:
        raise SpawnError(f"spawn: world_size must be >= 1, got {world_size}")
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(world_size):
        p = ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, timeout_s, args, kwargs, q), daemon=True)
        p.start()
        procs.append(p)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise SpawnError(f"spawn: ranks {missing} of {world_size} still running after {timeout_s:.0f} s; killed"
                                 + (f"; rank {next(iter(errors))} failed first:\n{errors[next(iter(errors))]}" if errors else ""))
            try:
                rank, status, payload = q.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                        and i not in results and i not in errors]
                if dead:
                    # a rank died without reporting (e.g. SIGABRT inside a collective): fail now, not at timeout
                    time.sleep(0.5)
                    while not q.empty():
                        r, s, pl = q.get()
                        (results if s == "ok" else errors)[r] = _loads(pl) if s == "ok" else pl
                    dead = [i for i in dead if i not in results and i not in errors]
                    if dead:
                        errors.update({i: f"process exited with code {procs[i].exitcode} without reporting" for i in dead})
                        break
                continue
            if status == "ok":
                results[rank] = _loads(payload)
            else:
                errors[rank] = payload
                # the other ranks are likely blocked in a collective with the failed one: stop waiting long
                deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        for p in procs:
            p.join(timeout=0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        first = next(iter(errors))  # the first to report is the root cause; the others are usually its echo
        also = sorted(set(errors) - {first})
        raise SpawnError(f"spawn: rank {first} of {world_size} failed:\n{errors[first]}"
                         + (f"\n(ranks {also} failed after it)" if also else ""))
    return [results[r] for r in range(world_size)]
