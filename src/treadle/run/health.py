"""Which rank is at fault when a collective fails or times out. Every rank keeps three records in the job's
rendezvous store (hosted by torchrun's agent, so it outlives any worker): its last finished step, its process
(host, pid, torchelastic error file) and a heartbeat (a thread, every HEARTBEAT_S: wall time, and whether the
main thread waits inside torch.distributed). A rank whose collective failed asks `diagnose` who is to blame.

NOTE [hung rank]: a rank stopped (SIGSTOP), dead, or stuck holding the GIL stops beating; one busy outside any
collective while its peers wait in one is hung in its own code. The rank that diagnoses it SIGKILLs such a culprit
when it runs on the same host: torchrun's agent would otherwise SIGTERM a stopped process and wait 30 s before
its SIGKILL, doubling the time a hung job takes to end. It also writes the culprit's torchelastic error file,
stamped with its last heartbeat, so that torchrun's "Root Cause" is the culprit, not the first rank to notice.
Clocks of the hosts are assumed to agree within a second (NTP); the heartbeat is stale after STALE_S.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .lock import alive_on_this_host, proc_state

logger = logging.getLogger(__name__)

_KEY = "treadle/run/last_step/{}"
_BEAT = "treadle/run/beat/{}"
_PROC = "treadle/run/proc/{}"
_FAILED = "treadle/run/failed/{}"
_ECHO = "treadle/run/echo/{}"
HEARTBEAT_S = 1.0
STALE_S = 4.0


def _store() -> Any:  # a torch.distributed Store, or None outside a job
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # no process group, or a store that cannot be reached any more
        return None


def _get(store: Any, key: str) -> str | None:
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # the store's host died with the job
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


# ------------------------------------------------------------------------------------------- heartbeat
def _in_collective(frame: Any) -> tuple[bool, str]:
    """(whether the stack is inside torch.distributed, the innermost frame outside torch) of `frame`."""
    from ..testing import _where

    where, in_dist = _where(frame)
    return in_dist, where


class Heartbeat:
    """This rank's records for `diagnose`: its process at start, then a beat every HEARTBEAT_S from a daemon
    thread. `stop` ends the thread (also safe when it never started)."""

    def __init__(self, rank: int, *, store: Any = None):
        self.rank = rank
        self.store = store if store is not None else _store()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Heartbeat":
        if self.store is None:
            return self
        self.store.set(_PROC.format(self.rank), json.dumps({
            "host": socket.gethostname(), "pid": os.getpid(),
            "error_file": os.environ.get("TORCHELASTIC_ERROR_FILE", "")}))
        self._beat()
        self._thread = threading.Thread(target=self._run, name="treadle-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        import sys

        in_dist, where = _in_collective(sys._current_frames().get(threading.main_thread().ident))
        self.store.set(_BEAT.format(self.rank), json.dumps({"t": time.time(), "in_collective": in_dist,
                                                            "where": where}))

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except Exception:  # the store went away with the job: nothing more to say
                return

    def stop(self) -> None:
        """End the beats; waits for one in flight (so that none is sent to a store already torn down)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * HEARTBEAT_S)


def report_failure(rank: int, message: str, *, echo: bool = False, store: Any = None) -> None:
    """Record that `rank` failed, of its own (for the peers' `diagnose`) or, with `echo`, because a collective
    with a peer failed (then `diagnose` does not blame it for being outside a collective)."""
    store = store if store is not None else _store()
    if store is not None:
        try:
            store.set((_ECHO if echo else _FAILED).format(rank), json.dumps({"t": time.time(), "message": message}))
        except Exception:
            pass


# ------------------------------------------------------------------------------------------- diagnosis
@dataclass(frozen=True)
class Culprit:
    """A rank to blame: `why` is one phrase ("failed: ...", "stopped responding ..."); `since_s` the wall time
    (epoch seconds) it went wrong; host / pid / error_file from its records ('' / 0 when unknown)."""

    rank: int
    why: str
    since_s: float
    host: str = ""
    pid: int = 0
    error_file: str = ""
    own_error: bool = False

    def describe(self) -> str:
        where = f" (pid {self.pid} on {self.host})" if self.pid else ""
        return f"rank {self.rank}{where} {self.why}"


def _records(store: Any, world: int, key: str) -> dict[int, dict]:
    out = {}
    for r in range(world):
        text = _get(store, key.format(r))
        if text is not None:
            try:
                out[r] = json.loads(text)
            except ValueError:
                pass
    return out


def diagnose(world: int, *, me: int, store: Any = None, wait_s: float = 3.0) -> list[Culprit]:
    """The ranks to blame for a failed collective, as seen by rank `me`: ranks that reported an error of their
    own (the first first); else ranks whose process is gone or stopped (this host) or whose heartbeat is stale
    (NOTE [hung rank]); else ranks busy outside any collective while the others wait; else ranks behind the
    others' step. Ranks that reported an echo of a peer's failure (`report_failure(echo=True)`) are never
    blamed: they may have exited already. Waits up to `wait_s` for a culprit to show (a rank that died a moment
    ago still has a fresh beat on another host). Empty when the store cannot be read or nobody is to blame."""
    store = store if store is not None else _store()
    if store is None:
        return []
    host = socket.gethostname()
    deadline = time.monotonic() + wait_s
    while True:
        procs = _records(store, world, _PROC)
        failed = _records(store, world, _FAILED)
        own = [Culprit(r, f"failed: {d.get('message', '?')}", float(d.get("t", 0)), own_error=True,
                       **_proc_fields(procs.get(r)))
               for r, d in sorted(failed.items(), key=lambda kv: kv[1].get("t", 0)) if r != me]
        if own:
            return own
        now = time.time()
        beats = _records(store, world, _BEAT)
        steps = behind(world, store=store)
        echoed = set(_records(store, world, _ECHO)) | {me}  # failing because of a peer, as this rank is
        silent = []
        for r in range(world):
            if r in echoed:
                continue
            p = procs.get(r, {})
            last = float(beats.get(r, {}).get("t", 0.0))
            step = f"; last finished step {steps[r]}" if steps.get(r) is not None else ""
            if p.get("host") == host and p.get("pid"):
                st = proc_state(int(p["pid"]))
                if st is None or not alive_on_this_host(int(p["pid"])):
                    silent.append(Culprit(r, f"died (its process is gone){step}", last, **_proc_fields(p)))
                    continue
                if st[0] == "T":
                    silent.append(Culprit(r, f"is stopped (SIGSTOP or a debugger; no heartbeat for {now - last:.0f} s)"
                                             f"{step}", last, **_proc_fields(p)))
                    continue
            if r not in beats or now - last > STALE_S:
                ago = f"for {now - last:.0f} s" if r in beats else "ever"
                silent.append(Culprit(r, f"stopped responding (no heartbeat {ago}: stopped, dead, or stuck holding "
                                         f"the GIL){step}", last, **_proc_fields(p)))
        if silent:
            return silent
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    waiting = [r for r, b in beats.items() if b.get("in_collective") or r in echoed]
    busy = [Culprit(r, f"is busy outside any collective at {b.get('where', '?')} while the others wait (hung)",
                    float(b.get("t", 0)), **_proc_fields(procs.get(r)))
            for r, b in sorted(beats.items()) if r not in echoed and not b.get("in_collective")]
    if busy and waiting:
        return busy
    return [Culprit(r, f"fell behind (last finished step {s})", 0.0, **_proc_fields(procs.get(r)))
            for r, s in sorted(steps.items()) if r not in echoed]


def _proc_fields(p: dict | None) -> dict[str, Any]:
    p = p or {}
    return {"host": str(p.get("host", "")), "pid": int(p.get("pid", 0) or 0),
            "error_file": str(p.get("error_file", ""))}


def local_and_alive(culprits: list[Culprit]) -> list[Culprit]:
    """The culprits that run on this host and are still there (not those that reported an error of their own)."""
    host = socket.gethostname()
    return [c for c in culprits if c.host == host and c.pid and not c.own_error and alive_on_this_host(c.pid)]


def stop_local(culprits: list[Culprit]) -> list[int]:
    """SIGKILL the culprits that run on this host and are still there (NOTE [hung rank]); returns their ranks.
    Waits up to 2 s for each to be gone (a zombie counts as gone)."""
    killed = []
    for c in local_and_alive(culprits):
        try:
            os.kill(c.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
        killed.append(c.rank)
        end = time.monotonic() + 2.0
        while alive_on_this_host(c.pid) and time.monotonic() < end:
            time.sleep(0.02)
    return killed
