"""How a failed rank says so: one line per distinct error across the job (not once per rank), naming the rank
at fault; its exit status; and the torchelastic error files torchrun reads for its "Root Cause".

Exit status: 0 done (or stopped by SIGTERM / SIGUSR1 after saving); 2 an error of the user's that a retry of the
same command would meet again (settings, data, a damaged or foreign checkpoint, an unwritable or full disk, a
non-finite loss, a directory held by another job); 1 a fault (a rank died, hung or lost its connection) or a
bug (then with its traceback).

NOTE [one line per error]: a rank prints a line only if no other rank printed the same one: the job's store
counts each line (``store.add``); errors every rank meets alike (`agree.JobError`, settings read before the
process group exists) are said by rank 0 alone, without a rank. A rank that fails because a peer did (an echo: a closed
connection, a collective timeout) names the peer `health.diagnose` finds (NOTE [hung rank]); when that peer
reported an error of its own, the echo says nothing. Under ``treadle run`` (TREADLE_RUN_LAUNCHER=1) the ranks
print nothing but bugs: the launcher prints the root cause's line from its error file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import sys
import time
import traceback
from typing import Any

from ..errors import TreadleError
from . import health
from .agree import JobError
from .config import DEBUG_ENV, LAUNCHER_ENV  # noqa: F401  (defined with the settings; read here and by treadle.cli.run)

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAULT, EXIT_USER = 0, 1, 2


def _rest(exc: BaseException) -> str:
    return str(exc).strip().removeprefix("treadle.run: ")


def first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0]


def _short(message: str, limit: int = 160) -> str:
    """A backend's message without its source location ("[.../pair.cc:537] ") and boilerplate advice."""
    message = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", message)
    message = message.split(". This is typically caused", 1)[0]
    return message if len(message) <= limit else message[: limit - 3] + "..."


def is_fault(exc: BaseException) -> bool:
    """True for an error that reads as a consequence of another rank's failure (NOTE [root cause])."""
    import torch.distributed as dist

    from ..testing import is_echo

    return isinstance(exc, (dist.DistBackendError, dist.DistNetworkError)) or is_echo(str(exc))


def write_error_file(message: str, *, timestamp: float, callstack: str, path: str | None = None) -> None:
    """Write a torchelastic error file (the format `torch.distributed.elastic` records and torchrun reads) to
    `path` (default: this rank's, $TORCHELASTIC_ERROR_FILE); nothing without one. Never raises."""
    path = path if path is not None else os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not path:
        return
    doc = {"message": {"message": message, "extraInfo": {"py_callstack": callstack, "timestamp": str(int(timestamp))}}}
    try:
        tmp = f"{path}.treadle-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError as exc:
        logger.debug("cannot write the error file %s: %s", path, exc)


def _say_once(line: str, key: str, store: Any) -> None:
    if os.environ.get(LAUNCHER_ENV) == "1":
        return
    if store is not None:
        try:
            if store.add("treadle/run/said/" + hashlib.sha1(key.encode()).hexdigest(), 1) > 1:
                return
        except Exception:  # the store is gone: say it rather than not at all
            pass
    print(line, file=sys.stderr, flush=True)


def _callstack(line: str, *, say: bool = True) -> str:
    """What a rank's error file keeps as its call stack: the traceback under ``--debug`` (printed too when `say`
    and no launcher reads the file), else the line itself."""
    if os.environ.get(DEBUG_ENV) != "1":
        return line
    tb = traceback.format_exc()
    if say and os.environ.get(LAUNCHER_ENV) != "1":
        print(f"treadle.run: rank {os.environ.get('RANK', '0')} traceback (--debug):\n{tb}", file=sys.stderr,
              flush=True)
    return tb


def report_before_start(exc: TreadleError) -> int:
    """A settings error met before the process group exists (every rank meets it): rank 0 says it."""
    line = f"treadle.run: {_rest(exc)}"
    stack = _callstack(line, say=os.environ.get("RANK", "0") == "0")  # the traceback first (--debug), the line last
    if os.environ.get("RANK", "0") == "0" and os.environ.get(LAUNCHER_ENV) != "1":
        print(line, file=sys.stderr, flush=True)
    write_error_file(line, timestamp=time.time(), callstack=stack)
    return EXIT_USER


def report(exc: BaseException, *, rank: int, world: int) -> int:
    """Say `exc` of this rank once for the job (NOTE [one line per error]), leave the error files for torchrun,
    and return the exit status."""
    store = health._store() if world > 0 else None
    now = time.time()
    if isinstance(exc, TreadleError):
        rest = _rest(exc)
        stack = _callstack(rest)  # the traceback first (--debug), the line last
        if isinstance(exc, JobError):  # every rank raised it after agreeing: rank 0 (alive) says it
            line = f"treadle.run: {rest}"
            if rank == 0:
                _say_once(line, rest, None)
        else:
            line = f"treadle.run: rank {rank}: {rest}" if world > 1 else f"treadle.run: {rest}"
            _say_once(line, line, store)
        health.report_failure(rank, rest, store=store)
        write_error_file(line, timestamp=now, callstack=line if stack == rest else stack)
        return EXIT_USER
    text = f"{type(exc).__name__}: {_short(first_line(str(exc)))}"
    if not is_fault(exc):  # a bug: its traceback, always
        tb = traceback.format_exc()
        print(f"treadle.run: rank {rank} failed:\n{tb}", file=sys.stderr, flush=True)
        health.report_failure(rank, text, store=store)
        write_error_file(f"treadle.run: rank {rank}: {text}", timestamp=now, callstack=tb)
        return EXIT_FAULT
    health.report_failure(rank, text, echo=True, store=store)
    timeout = "timed out" in text.lower() or "timeout" in text.lower()
    culprits = health.diagnose(world, me=rank, store=store, wait_s=0.0 if timeout else health.STALE_S + 0.5)
    own = [c for c in culprits if c.own_error]
    if own:  # that rank said its own error; this one is its echo
        line = f"treadle.run: rank {rank} failed because {own[0].describe()}"
        write_error_file(line, timestamp=now + 1, callstack=line)
        return EXIT_FAULT
    if culprits:
        for c in culprits:  # before the kill: the agent reads the file when it sees the process gone
            if c.error_file and c.host == socket.gethostname():
                why = f"treadle.run: {c.describe()}"
                write_error_file(why, timestamp=min(c.since_s or now, now - 1), callstack=why, path=c.error_file)
        local = health.local_and_alive(culprits)
        more = f"; and {len(culprits) - 3} more" if len(culprits) > 3 else ""
        head = "; ".join(c.describe() for c in culprits[:3]) + more
        line = (f"treadle.run: {head}; the job ends (rank {rank}: {text})"
                + (f"; killing rank {', '.join(str(c.rank) for c in local)} on this host" if local else ""))
        _say_once(line, "culprits " + ",".join(str(c.rank) for c in culprits), store)
        health.stop_local(local)
    else:
        line = (f"treadle.run: rank {rank} failed: {text} (a peer rank died or hung past the collective timeout; "
                f"nothing in the job's store says which)")
        _say_once(line, line, store)
    write_error_file(line, timestamp=now + 1, callstack=line)
    return EXIT_FAULT
