"""Checks before the first step, so that a run never trains for hours to find it cannot keep the result: the
checkpoint directory can be created and written on every rank, no other job holds it (`lock`), and the
``--export-hf`` and ``--metrics`` destinations can be written. Every rank agrees on the outcome (`agree`)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import torch.distributed as dist

from .agree import JobError, agree
from .config import RunConfig, RunError
from .lock import DirLock
from .manifest import remove_partials

logger = logging.getLogger(__name__)


def _writable_dir(path: Path, flag: str) -> str | None:
    """None when directory `path` exists or can be made and a file can be written in it; else the problem."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".treadle-probe-{socket.gethostname()}-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        what = exc.strerror or str(exc)
        if isinstance(exc, (FileExistsError, NotADirectoryError)):
            what = "it, or a directory above it, is a file"
        return f"{flag} {str(path)!r} cannot be used: {what}; give a directory this job can write"
    return None


def check(cfg: RunConfig) -> DirLock | None:
    """Collective: every rank checks that it can write `cfg`'s checkpoint, export and metrics destinations;
    rank 0 then takes the checkpoint directory's lock and clears unfinished saves. Returns the lock on rank 0
    (release it when the run ends), None elsewhere. Raises agree.JobError on every rank with the first
    problem any rank found."""
    problem = None
    if cfg.ckpt_dir:
        problem = _writable_dir(Path(cfg.ckpt_dir), "--ckpt-dir")
    if problem is None and cfg.export_hf:
        problem = _writable_dir(Path(cfg.export_hf), "--export-hf")
    if problem is None and cfg.metrics and dist.get_rank() == 0:
        problem = _writable_dir(Path(cfg.metrics).parent, "--metrics (its directory)")
    agree(problem)
    lock = None
    if cfg.ckpt_dir and dist.get_rank() == 0:
        lock = DirLock(cfg.ckpt_dir)
        try:
            lock.acquire()
            remove_partials(cfg.ckpt_dir)
        except OSError as exc:
            problem = f"--ckpt-dir {cfg.ckpt_dir!r}: cannot take the lock {lock.path}: {exc.strerror or exc}"
        except RunError as exc:  # another job holds it
            problem = str(exc)
    box = [problem]  # the job's lock, held by rank 0: its outcome is every rank's
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise JobError(f"treadle.run: {box[0].removeprefix('treadle.run: ')}")
    return lock
