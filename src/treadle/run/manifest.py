"""Checkpoint directories on disk and their integrity: a manifest of every file's size and SHA-256, put in place
last, so that a checkpoint is complete exactly when its manifest is there; checking a checkpoint against it;
which checkpoints are complete; retention. Pure file operations: the collectives that share the hashing over
the ranks live in `checkpoint`.

Layout of ``--ckpt-dir``::

    step_00000010/              a complete checkpoint (NOTE [atomic checkpoint])
        .metadata               DCP's metadata (read as data: `safe_pickle`)
        __0_0.distcp ...        DCP's shard files, one or more per rank
        manifest.json           {"format": "treadle-checkpoint", "version": 1, "step": 10, "world_size": 4,
                                 "created": "2025-01-01T12:00:00+00:00",
                                 "files": {"__0_0.distcp": {"bytes": 1234, "sha256": "ab12..."}, ...}}
    .partial-step_00000012/     a save in flight, or one that died: never loaded; removed by the next job
    step_00000008.corrupt/      a checkpoint found damaged at resume, moved aside for inspection
    treadle.lock                the job that owns the directory (`lock`)

NOTE [atomic checkpoint]: every rank writes its DCP shards into ``.partial-step_N``; DCP writes ``.metadata``
there once every shard is written; each rank then hashes a share of the files, rank 0 writes
``manifest.json`` (write, fsync, rename), fsyncs the directory and renames it to ``step_N``. A crash, a
SIGKILL or a full disk at any point leaves either no ``step_N`` or a complete one. A ``step_N`` without a
manifest but with ``.metadata`` is a checkpoint of an older treadle (complete, not checksummed).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "treadle-checkpoint"
VERSION = 1
PARTIAL_PREFIX = ".partial-"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK_BYTES = 8 * 2**20

Entry = dict[str, Any]  # {"bytes": int, "sha256": str}


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:08d}"


def partial_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"{PARTIAL_PREFIX}step_{step:08d}"


def is_complete(path: str | Path) -> bool:
    """True for a checkpoint directory whose save finished: its manifest is there (or, written by an older
    treadle, DCP's ``.metadata``)."""
    p = Path(path)
    return (p / MANIFEST).is_file() or (p / ".metadata").is_file()


def complete_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete ``step_N`` directory under `ckpt_dir`, newest first."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_DIR.match(p.name)) and is_complete(p)]
    return sorted(found, reverse=True)


# ------------------------------------------------------------------------------------------- hashing
def file_entry(path: Path) -> Entry:
    """Size and SHA-256 of one file."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
            n += len(chunk)
    return {"bytes": n, "sha256": h.hexdigest()}


def data_files(path: Path) -> list[str]:
    """The files a manifest covers: every regular file of the checkpoint but the manifest, sorted."""
    return sorted(f.name for f in path.iterdir() if f.is_file() and f.name != MANIFEST
                  and not f.name.startswith(MANIFEST))


def hash_share(path: Path, rank: int, world: int) -> dict[str, Entry]:
    """Entries of this rank's share (every `world`-th file from `rank`) of the checkpoint's files."""
    return {name: file_entry(path / name) for name in data_files(path)[rank::world]}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(path: Path, files: dict[str, Entry], *, step: int, world_size: int) -> None:
    """Write ``manifest.json`` into checkpoint directory `path` atomically (a temp file, fsync, rename)."""
    doc = {"format": FORMAT, "version": VERSION, "step": step, "world_size": world_size,
           "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "files": dict(sorted(files.items()))}
    tmp = path / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)
    _fsync_dir(path)


def publish(partial: Path, final: Path) -> None:
    """Rename the finished `partial` directory to `final` (replacing an older `final` of the same step) and
    fsync the parent, the last act of NOTE [atomic checkpoint]."""
    if final.exists():  # e.g. a step saved again after a resume from an older checkpoint
        old = final.with_name(final.name + ".replaced")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        partial.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        partial.rename(final)
    _fsync_dir(final.parent)


# ------------------------------------------------------------------------------------------- checking
def read_manifest(path: Path) -> dict[str, Entry] | None:
    """The manifest's file entries; None for a checkpoint of an older treadle (no manifest). Raises
    ValueError naming what is wrong with a manifest that is not one."""
    f = path / MANIFEST
    if not f.is_file():
        return None
    try:
        doc = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{f}: unreadable manifest ({type(exc).__name__})") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if (not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(files, dict)
            or not all(isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
                       for e in files.values())):
        raise ValueError(f"{f}: not a {FORMAT} manifest")
    if ".metadata" not in files:
        raise ValueError(f"{f}: lists no .metadata")
    return files


def check_share(path: Path, rank: int, world: int) -> list[str]:
    """Problems of this rank's share of checkpoint `path` against its manifest, one line each naming the file
    ("truncated", "checksum differs", "missing"); rank 0 also reports a manifest that cannot be read. Empty
    when intact, or when there is no manifest (a checkpoint of an older treadle: nothing to check)."""
    try:
        files = read_manifest(path)
    except ValueError as exc:
        return [str(exc)] if rank == 0 else []
    if files is None:
        return []
    problems = []
    for name in sorted(files)[rank::world]:
        want = files[name]
        f = path / name
        if not f.is_file():
            problems.append(f"{f}: missing (the manifest lists {want['bytes']} bytes)")
            continue
        size = f.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{f}: {size} bytes, the manifest says {want['bytes']} (truncated or overwritten)")
        elif file_entry(f)["sha256"] != want["sha256"]:
            problems.append(f"{f}: SHA-256 differs from the manifest (the bytes changed after the save)")
    return problems


# ------------------------------------------------------------------------------------------- housekeeping
def prune(ckpt_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints under `ckpt_dir` (keep=0: delete none).
    Returns what was deleted."""
    if keep <= 0:
        return []
    gone = [p for _, p in complete_checkpoints(ckpt_dir)[keep:]]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
        logger.info("checkpoint retention (--keep %d): deleted %s", keep, p)
    return gone


def remove_partials(ckpt_dir: str | Path) -> list[Path]:
    """Delete the ``.partial-*`` directories under `ckpt_dir` (saves that never finished). Only the job that
    holds the directory's lock may call this."""
    d = Path(ckpt_dir)
    gone = [p for p in d.iterdir() if p.is_dir() and p.name.startswith(PARTIAL_PREFIX)] if d.is_dir() else []
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
        logger.info("removed an unfinished save: %s", p)
    return gone


def quarantine(path: Path) -> Path:
    """Move a damaged checkpoint aside (``step_N.corrupt``, numbered if taken) so that no resume tries it again
    and retention does not count it. Returns the new path."""
    dest = path.with_name(path.name + ".corrupt")
    i = 1
    while dest.exists():
        dest = path.with_name(f"{path.name}.corrupt{i}")
        i += 1
    path.rename(dest)
    return dest
