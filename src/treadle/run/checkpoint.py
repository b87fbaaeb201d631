"""Distributed checkpoints with `torch.distributed.checkpoint` (DCP) in global shapes, so any schedule can
load what any other saved (reshard on load), written atomically with a checksum per file, checked before they
are loaded, and a Hugging Face export of any such checkpoint.

The state of one checkpoint directory ``<ckpt_dir>/step_<N>`` (its files and manifest: `manifest`):

- ``model.<param>``: every parameter in its global shape. Splits a DTensor can state are saved as DTensors
  on the full mesh (each rank writes its own piece, replicas once); the others (interleaved ``blocks``
  splits) are gathered and saved as replicated tensors.
- ``optim.<param>.exp_avg`` / ``.exp_avg_sq`` in the parameter's layout, ``optim.<param>.step``.
- ``train.step``: optimizer steps done (the data sampler's position and the LR schedule follow from it).
- ``rng.cpu`` (world, n) and ``rng.cuda``: every rank's generator state, restored when the world size matches.

Saving follows NOTE [atomic checkpoint] (`manifest`); loading checks the manifest first (`verify`), reads DCP's
pickled metadata as data (NOTE [metadata as data], `safe_pickle`) and refuses a checkpoint of another model.
"""

from __future__ import annotations

import datetime
import logging
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ..mesh import Mesh
from .agree import JobError, agree
from .config import RunError
from .layout import ParamLayout, named_params
from .manifest import (check_share, complete_checkpoints, data_files, file_entry, is_complete, partial_dir, prune,
                       publish, quarantine, step_dir, write_manifest)
from .safe_pickle import SafeReader, load_metadata

logger = logging.getLogger(__name__)

__all__ = ["Checkpointer", "export_hf", "is_complete", "latest", "load", "resume_source", "save_state", "step_dir",
           "verify"]


def latest(ckpt_dir: str | Path) -> Path | None:
    """The complete checkpoint with the most steps under `ckpt_dir`, or None (not checked: see `verify`)."""
    found = complete_checkpoints(ckpt_dir)
    return found[0][1] if found else None


# ------------------------------------------------------------------------------------------- state
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _entries(model: nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor, str]]:
    """(key, local tensor, parameter name) for every parameter and each of its same-shaped optimizer states."""
    out = []
    for name, p in named_params(model):
        out.append((f"model.{name}", p, name))
        st = opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                out.append((f"optim.{name}.{k}", st[k], name))
    return out


def _rng_states(mesh: Mesh) -> dict[str, torch.Tensor]:
    """Every rank's generator states, gathered into (world, n) uint8 tensors (the same on every rank)."""
    out = {}
    local = {"rng.cpu": torch.get_rng_state()}
    if mesh.device.type == "cuda":
        local["rng.cuda"] = torch.cuda.get_rng_state()
    for key, state in local.items():
        t = state.to(mesh.device)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        out[key] = torch.stack(parts).cpu()
    return out


def save_state(model: nn.Module, opt: torch.optim.Optimizer, layouts: dict[str, ParamLayout], mesh: Mesh,
               *, step: int) -> dict[str, Any]:
    """The state dict DCP writes (collective: gathers interleaved splits and the RNG states)."""
    sd: dict[str, Any] = {}
    for key, t, name in _entries(model, opt):
        lay = layouts[name]
        view = lay.global_view(t, mesh)
        sd[key] = view if view is not None else lay.gather_full(t, mesh)
    for name, p in named_params(model):
        st = opt.state.get(p, {})
        if "step" in st:
            sd[f"optim.{name}.step"] = st["step"].detach().clone().cpu()
    sd["train.step"] = torch.tensor(step, dtype=torch.int64)
    sd.update(_rng_states(mesh))
    return sd


def _nonfinite(sd: dict[str, Any]) -> str | None:
    """The first floating entry of a state dict (local pieces) holding NaN or inf, or None."""
    for key, t in sd.items():
        local = t.to_local() if isinstance(t, DTensor) else t
        if torch.is_tensor(local) and local.is_floating_point() and not bool(torch.isfinite(local).all()):
            return key
    return None


LOW_SPACE_BYTES = 64 * 2**20


def _save_failure(exc: CheckpointException, step: int, ckpt_dir: Path) -> str:
    """One line for a failed DCP save: the first rank's OS error (disk full, permission, ...). torch's
    serializer reports a short write as a RuntimeError ("unexpected pos"): with under LOW_SPACE_BYTES free
    (or 1% of the disk) after the failure, it is said as the full disk it is."""
    for rank, (err, _) in sorted(exc.failures.items()):
        if isinstance(err, OSError):
            what = f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
            return f"rank {rank} could not write checkpoint step {step}: {what}"
    rank, (err, _) = sorted(exc.failures.items())[0]
    what = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    try:
        usage = shutil.disk_usage(ckpt_dir)
    except OSError:
        usage = None
    if usage is not None and usage.free < max(LOW_SPACE_BYTES, usage.total // 100):
        what = f"No space left on device ({what})"
    return f"rank {rank} could not write checkpoint step {step}: {what}"


class Checkpointer:
    """Saves under `ckpt_dir` as NOTE [atomic checkpoint] says, keeping the newest `keep` (0: all).
    `async_save` overlaps writing with training (one save in flight at a time, on its own gloo group so its
    collectives never interleave with training's, bounded by `timeout`; its errors are raised by the next `save`
    or `wait`).

    A save raises JobError on every rank (the same line) when any rank cannot write (disk full, permission),
    when the state to save holds NaN / inf, or when the manifest cannot be written; the unfinished directory
    is removed and the checkpoints already complete are kept."""

    def __init__(self, ckpt_dir: str | Path, *, async_save: bool = False, keep: int = 0,
                 timeout: datetime.timedelta | None = None):
        self.ckpt_dir = Path(ckpt_dir)
        self.async_save = async_save
        self.keep = keep
        self._pending: Future | None = None
        self._group = dist.new_group(backend="gloo", timeout=timeout) if async_save else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="treadle-ckpt") if async_save else None

    def save(self, model, opt, layouts, mesh, *, step: int) -> Path:
        final = step_dir(self.ckpt_dir, step)
        partial = partial_dir(self.ckpt_dir, step)
        self.wait()
        sd = save_state(model, opt, layouts, mesh, step=step)
        bad = _nonfinite(sd)
        if dist.get_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)  # a save of this step that died earlier
        agree(None if bad is None else f"step {step}: {bad} holds NaN or inf; not saved (a checkpoint is finite)")
        writer = FileSystemWriter(str(partial), sync_files=True)
        if self.async_save:
            try:
                res = dcp.async_save(sd, storage_writer=writer, process_group=self._group)
            except CheckpointException as exc:
                self._fail(_save_failure(exc, step, self.ckpt_dir), partial)
            upload = getattr(res, "upload_completion", res)
            self._pending = self._pool.submit(self._finish_async, upload, partial, final, step)
        else:
            try:
                dcp.save(sd, storage_writer=writer)
            except CheckpointException as exc:
                self._fail(_save_failure(exc, step, self.ckpt_dir), partial)
            self._finish(partial, final, step, group=None)
        logger.info("checkpoint step %d -> %s%s", step, final, " (async)" if self.async_save else "")
        return final

    def _fail(self, text: str, partial: Path) -> None:
        if dist.get_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        kept = complete_checkpoints(self.ckpt_dir)
        raise JobError(f"treadle.run: {text}; "
                       + (f"the newest complete checkpoint, {kept[0][1]}, is kept" if kept else
                          "no complete checkpoint exists yet") + f" (free space in {self.ckpt_dir}?)") from None

    def _finish_async(self, upload: Future, partial: Path, final: Path, step: int) -> None:
        try:
            upload.result()
        except CheckpointException as exc:
            self._fail(_save_failure(exc, step, self.ckpt_dir), partial)
        self._finish(partial, final, step, group=self._group)

    def _finish(self, partial: Path, final: Path, step: int, *, group: dist.ProcessGroup | None) -> None:
        """Hash the files (each rank a share), then rank 0 writes the manifest and publishes the directory."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        box: list[Any] = [data_files(partial) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        names: list[str] = box[0]
        mine, problem = {}, None
        try:
            mine = {n: file_entry(partial / n) for n in names[rank::world]}
        except OSError as exc:
            problem = f"rank {rank} could not read back checkpoint step {step}: {exc.strerror or exc}"
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, (mine, problem), group=group)
        problem = next((p for _, p in parts if p), None)
        if rank == 0 and problem is None:
            files = {n: e for m, _ in parts for n, e in m.items()}
            try:
                if sorted(files) != names:
                    raise OSError(f"hashed {len(files)} of {len(names)} files")
                write_manifest(partial, files, step=step, world_size=world)
                publish(partial, final)
                prune(self.ckpt_dir, self.keep)
            except OSError as exc:
                problem = f"rank 0 could not finish checkpoint step {step}: {exc.strerror or exc}"
        try:
            agree(problem, group=group)
        except JobError as exc:
            self._fail(str(exc).removeprefix("treadle.run: "), partial)

    def wait(self) -> None:
        """Block until the save in flight is complete; raises its error, if it failed."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        """`wait`, then stop the background writer."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)


# ------------------------------------------------------------------------------------------- load
def _problems_here(path: Path, rank: int, world: int) -> list[str]:
    """This rank's share of `verify`: its files against the manifest; rank 0 also reads the metadata as data."""
    problems = check_share(path, rank, world)
    if rank == 0 and not problems:
        try:
            load_metadata(path / ".metadata")
        except RunError as exc:
            problems.append(str(exc).removeprefix("treadle.run: "))
    return problems


def verify(path: str | Path) -> list[str]:
    """Problems of checkpoint `path`, one line each naming the file (empty: intact). Collective when a process
    group is up (each rank checks a share of the files), else checks every file here."""
    path = Path(path)
    if not is_complete(path):
        return [f"{path} is not a complete checkpoint (no manifest: the save did not finish)"]
    if not dist.is_initialized():
        return _problems_here(path, 0, 1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _problems_here(path, rank, world)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    return [p for ps in every for p in ps]


def _refuse(path: Path, problems: list[str]) -> JobError:
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return JobError(f"treadle.run: checkpoint {path} is damaged: {problems[0]}{more}; resume from another "
                    f"checkpoint (--resume DIR) or start afresh (--resume none)")


def resume_source(resume: str, ckpt_dir: str | None) -> Path | None:
    """The checkpoint a run resumes from (collective): `resume` ``none``; a directory (refused with JobError
    when damaged); or ``auto``: the newest intact checkpoint in `ckpt_dir`, falling back past damaged ones (each
    logged and moved aside by rank 0 as ``step_N.corrupt``)."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not is_complete(path):
            raise JobError(f"treadle.run: --resume {resume!r} is not a complete checkpoint directory")
        problems = verify(path)
        if problems:
            raise _refuse(path, problems)
        return path
    if not ckpt_dir:
        return None
    box: list[Any] = [complete_checkpoints(ckpt_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    for _, path in box[0]:
        problems = verify(path)
        if not problems:
            return path
        if dist.get_rank() == 0:
            try:
                moved = f"moved aside to {quarantine(path).name}"
            except OSError as exc:
                moved = f"could not move it aside: {exc.strerror or exc}"
            logger.warning("checkpoint %s is damaged: %s; %s; falling back to the next older checkpoint",
                           path, problems[0], moved)
    if box[0]:
        logger.warning("no intact checkpoint in %s: starting from step 0", ckpt_dir)
    return None


def _check_metadata(path: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    if not is_complete(path):
        raise RunError(f"treadle.run: {path} is not a complete checkpoint (no manifest: the save did not finish)")
    md = load_metadata(path / ".metadata").state_dict_metadata
    missing = [k for k in expected if k not in md]
    if missing:
        raise RunError(f"treadle.run: checkpoint {path} lacks {len(missing)} entries this model needs, e.g. "
                       f"{missing[:3]}; was it written for another model?")
    for k, shape in expected.items():
        if not isinstance(md[k], TensorStorageMetadata):
            raise RunError(f"treadle.run: checkpoint {path}: {k} is a {type(md[k]).__name__}, not a tensor")
        size = tuple(md[k].size)
        if size != shape:
            raise RunError(f"treadle.run: checkpoint {path}: {k} has shape {size} there but {shape} in this model; "
                           f"was it written for another model?")
    return md


def _dcp_load(sd: dict[str, Any], path: Path, *, no_dist: bool = False) -> None:
    """`dcp.load` through SafeReader; a file that cannot be read (only an older treadle's checkpoint, without a
    manifest, gets this far damaged) raises JobError naming the checkpoint and the rank."""
    try:
        dcp.load(sd, storage_reader=SafeReader(str(path)), no_dist=no_dist)
    except CheckpointException as exc:
        rank, (err, _) = sorted(exc.failures.items())[0]
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise JobError(f"treadle.run: checkpoint {path} could not be read on rank {rank}: {type(err).__name__}: "
                       f"{text}") from None


@torch.no_grad()
def load(path: str | Path, model: nn.Module, opt: torch.optim.Optimizer, layouts: dict[str, ParamLayout],
         mesh: Mesh) -> int:
    """Load a checkpoint saved under any schedule into this built `model` and `opt` (whose state must exist:
    `optim.init_optimizer_state`). Returns the step it was saved at. Restores RNG states when the checkpoint's
    world size equals this one. Raises RunError for an incomplete checkpoint or one of another model."""
    path = Path(path)
    entries = _entries(model, opt)
    expected = {key: layouts[name].global_shape for key, _, name in entries}
    md = _check_metadata(path, expected)
    sd: dict[str, Any] = {}
    fallbacks: dict[str, torch.Tensor] = {}
    for key, t, name in entries:
        lay = layouts[name]
        view = lay.global_view(torch.empty_like(_local(t)), mesh)
        if view is None:
            view = torch.empty(lay.global_shape, dtype=t.dtype, device=_local(t).device)
            fallbacks[key] = view
        sd[key] = view
    for name, p in named_params(model):
        if "step" in opt.state.get(p, {}) and f"optim.{name}.step" in md:
            sd[f"optim.{name}.step"] = torch.zeros((), dtype=torch.float32)
    sd["train.step"] = torch.zeros((), dtype=torch.int64)
    world = dist.get_world_size()
    rng_keys = [k for k in ("rng.cpu", "rng.cuda") if k in md and tuple(md[k].size)[0] == world
                and (k != "rng.cuda" or mesh.device.type == "cuda")]
    for k in rng_keys:
        sd[k] = torch.empty(tuple(md[k].size), dtype=torch.uint8)
    _dcp_load(sd, path)
    for key, t, name in entries:
        dst = _local(t)
        src = layouts[name].local_from_full(sd[key], t, mesh) if key in fallbacks else sd[key].to_local()
        dst.copy_(src)
    for name, p in named_params(model):
        st = opt.state.get(p, {})
        if f"optim.{name}.step" in sd:
            st["step"].copy_(sd[f"optim.{name}.step"])
    rank = dist.get_rank()
    if "rng.cpu" in rng_keys:
        torch.set_rng_state(sd["rng.cpu"][rank].clone())
    if "rng.cuda" in rng_keys:
        torch.cuda.set_rng_state(sd["rng.cuda"][rank].clone())
    if not rng_keys:
        logger.warning("checkpoint %s was saved by another world size: RNG states not restored", path)
    step = int(sd["train.step"])
    logger.info("resumed from %s at step %d", path, step)
    return step


# ------------------------------------------------------------------------------------------- export
@torch.no_grad()
def export_hf(path: str | Path, model: nn.Module, out_dir: str | Path) -> Path:
    """Load the parameters of checkpoint `path` (saved under any schedule) into `model` (the unbuilt model of
    the same configuration, in one process) and write ``model.save_pretrained(out_dir)`` (safetensors).
    Raises RunError for an incomplete checkpoint, one of another model, or a model without save_pretrained."""
    path = Path(path)
    if not hasattr(model, "save_pretrained"):
        raise RunError(f"treadle.run: export needs a Hugging Face model (save_pretrained); got {type(model).__name__}")
    params = dict(model.named_parameters())
    if not is_complete(path):
        raise RunError(f"treadle.run: {path} is not a complete checkpoint (no manifest: the save did not finish)")
    problems = _problems_here(path, 0, 1)
    if problems:
        raise _refuse(path, problems)
    _check_metadata(path, {f"model.{n}": tuple(p.shape) for n, p in params.items()})
    sd = {f"model.{n}": torch.empty_like(p) for n, p in params.items()}
    _dcp_load(sd, path, no_dist=True)
    for n, p in params.items():
        p.copy_(sd[f"model.{n}"])
    model.save_pretrained(str(out_dir), safe_serialization=True)
    logger.info("exported %s -> %s", path, out_dir)
    return Path(out_dir)
