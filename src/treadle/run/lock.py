"""One job per checkpoint directory: ``<ckpt_dir>/treadle.lock``, created exclusively by rank 0 of the job that
writes there and removed when it ends. A second job is refused; a lock whose owner is gone (its pid is dead on
this host, or reused by another process) is stale and taken over, with a log line.

The lock file is JSON::

    {"host": "node-3", "pid": 41234, "started": "2025-01-01T12:00:00+00:00", "proc_start": "8812345",
     "job": "<TORCHELASTIC_RUN_ID or ''>"}

`proc_start` is the owner's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), which tells a
live owner from a later process that got the same pid. A lock held on another host cannot be checked from here:
it is refused, naming that host and pid.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from .config import RunError

logger = logging.getLogger(__name__)

LOCK = "treadle.lock"


@dataclass(frozen=True)
class LockOwner:
    """Who holds a checkpoint directory (the lock file's content)."""

    host: str
    pid: int
    started: str
    proc_start: str = ""
    job: str = ""

    def __str__(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"


def proc_state(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in ticks) of a process on this host from /proc; None when there is no such
    process (or no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
    return fields[0], fields[19]


def alive_on_this_host(pid: int, proc_start: str = "") -> bool:
    """True when `pid` is a live (not zombie) process here and, if `proc_start` is given, the same one."""
    st = proc_state(pid)
    if st is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True  # no /proc: the pid exists
    state, start = st
    return state not in ("Z", "X") and (not proc_start or start == proc_start)


def me() -> LockOwner:
    st = proc_state(os.getpid())
    return LockOwner(host=socket.gethostname(), pid=os.getpid(),
                     started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     proc_start=st[1] if st else "", job=os.environ.get("TORCHELASTIC_RUN_ID", ""))


def read_owner(path: Path) -> LockOwner | None:
    """The owner a lock file names; None when it cannot be parsed (a torn write: treated as stale)."""
    try:
        doc = json.loads(path.read_text())
        return LockOwner(host=str(doc["host"]), pid=int(doc["pid"]), started=str(doc.get("started", "?")),
                         proc_start=str(doc.get("proc_start", "")), job=str(doc.get("job", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _is_stale(owner: LockOwner | None, mine: LockOwner) -> bool:
    if owner is None:
        return True
    if owner.host != mine.host:
        return False
    if owner.pid == mine.pid:  # an earlier run in this very process that did not release it
        return True
    return not alive_on_this_host(owner.pid, owner.proc_start)


class DirLock:
    """The lock of one checkpoint directory, held by this process once `acquire` returned."""

    def __init__(self, ckpt_dir: str | Path):
        self.path = Path(ckpt_dir) / LOCK
        self.owner = me()
        self.held = False

    def acquire(self) -> None:
        """Create the lock file exclusively, taking over a stale one (logged). Raises RunError naming the live
        owner when another job holds the directory; OSError when the directory cannot be written."""
        text = json.dumps(asdict(self.owner))
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                owner = read_owner(self.path)
                if not _is_stale(owner, self.owner):
                    raise RunError(f"treadle.run: --ckpt-dir {self.path.parent} is in use by another job ({owner}; "
                                   f"lock {self.path}); wait for it to end, give another --ckpt-dir, or delete "
                                   f"the lock file if that job is gone") from None
                # move it aside first: of two jobs taking over at once, only one rename succeeds
                aside = self.path.with_name(f"{LOCK}.stale-{self.owner.host}-{self.owner.pid}")
                try:
                    os.rename(self.path, aside)
                except FileNotFoundError:
                    continue
                os.unlink(aside)
                logger.warning("took over the stale lock %s of %s (%s)", self.path,
                               owner or "an unreadable owner",
                               "that process is gone" if owner else "its content could not be read")
                continue
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return
        raise RunError(f"treadle.run: could not take the lock {self.path}: other jobs keep taking it")

    def release(self) -> None:
        """Remove the lock file if this process still holds it."""
        if not self.held:
            return
        self.held = False
        owner = read_owner(self.path)
        if owner is not None and (owner.host, owner.pid, owner.proc_start) == (
                self.owner.host, self.owner.pid, self.owner.proc_start):
            try:
                self.path.unlink()
            except OSError as exc:
                logger.warning("could not remove the lock %s: %s", self.path, exc)
