"""Distributed checkpoints with `torch.distributed.checkpoint` (DCP) in global shapes, so any schedule can
load what any other saved (reshard on load), and a Hugging Face export of any such checkpoint.

Layout of one checkpoint directory ``<ckpt_dir>/step_<N>`` (a DCP directory; complete once DCP wrote its
``.metadata``):

- ``model.<param>``: every parameter in its global shape. Splits a DTensor can state are saved as DTensors
  on the full mesh (each rank writes its own piece, replicas once); the others (interleaved ``blocks``
  splits) are gathered and saved as replicated tensors.
- ``optim.<param>.exp_avg`` / ``.exp_avg_sq`` in the parameter's layout, ``optim.<param>.step``.
- ``train.step``: optimizer steps done (the data sampler's position and the LR schedule follow from it).
- ``rng.cpu`` (world, n) and ``rng.cuda``: every rank's generator state, restored when the world size matches.
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from ..mesh import Mesh
from .config import RunError
from .layout import ParamLayout, unwrap

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:08d}"


def is_complete(path: str | Path) -> bool:
    return (Path(path) / ".metadata").is_file()


def latest(ckpt_dir: str | Path) -> Path | None:
    """The complete checkpoint with the most steps under `ckpt_dir`, or None."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_DIR.match(p.name)) and is_complete(p)]
    return max(found)[1] if found else None


# ------------------------------------------------------------------------------------------- state
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _entries(model: nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor, str]]:
    """(key, local tensor, parameter name) for every parameter and each of its same-shaped optimizer states."""
    out = []
    for name, p in unwrap(model).named_parameters():
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
    for name, p in unwrap(model).named_parameters():
        st = opt.state.get(p, {})
        if "step" in st:
            sd[f"optim.{name}.step"] = st["step"].detach().clone().cpu()
    sd["train.step"] = torch.tensor(step, dtype=torch.int64)
    sd.update(_rng_states(mesh))
    return sd


class Checkpointer:
    """Saves every `every` steps and at the end under `ckpt_dir`; `async_save` overlaps writing with training
    (one save in flight at a time, on its own gloo group so its collectives never interleave with training's)."""

    def __init__(self, ckpt_dir: str, *, async_save: bool = False):
        self.ckpt_dir = Path(ckpt_dir)
        self.async_save = async_save
        self._pending: Future | None = None
        self._group = dist.new_group(backend="gloo") if async_save else None

    def save(self, model, opt, layouts, mesh, *, step: int) -> Path:
        path = step_dir(self.ckpt_dir, step)
        self.wait()
        sd = save_state(model, opt, layouts, mesh, step=step)
        if self.async_save:
            res = dcp.async_save(sd, checkpoint_id=str(path), process_group=self._group)
            self._pending = getattr(res, "upload_completion", res)
        else:
            dcp.save(sd, checkpoint_id=str(path))
        logger.info("checkpoint step %d -> %s%s", step, path, " (async)" if self.async_save else "")
        return path

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None


# ------------------------------------------------------------------------------------------- load
def _check_metadata(path: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader

    if not is_complete(path):
        raise RunError(f"treadle.run: {path} is not a complete checkpoint (no .metadata: the save did not finish)")
    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing = [k for k in expected if k not in md]
    if missing:
        raise RunError(f"treadle.run: checkpoint {path} lacks {len(missing)} entries this model needs, e.g. "
                       f"{missing[:3]}; was it written for another model?")
    for k, shape in expected.items():
        size = tuple(getattr(md[k], "size", ()))
        if size != shape:
            raise RunError(f"treadle.run: checkpoint {path}: {k} has shape {size} there but {shape} in this model; "
                           f"was it written for another model?")
    return md


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
    for name, p in unwrap(model).named_parameters():
        if "step" in opt.state.get(p, {}) and f"optim.{name}.step" in md:
            sd[f"optim.{name}.step"] = torch.zeros((), dtype=torch.float32)
    sd["train.step"] = torch.zeros((), dtype=torch.int64)
    world = dist.get_world_size()
    rng_keys = [k for k in ("rng.cpu", "rng.cuda") if k in md and tuple(md[k].size)[0] == world
                and (k != "rng.cuda" or mesh.device.type == "cuda")]
    for k in rng_keys:
        sd[k] = torch.empty(tuple(md[k].size), dtype=torch.uint8)
    dcp.load(sd, checkpoint_id=str(path))
    for key, t, name in entries:
        dst = _local(t)
        src = layouts[name].local_from_full(sd[key], t, mesh) if key in fallbacks else sd[key].to_local()
        dst.copy_(src)
    for name, p in unwrap(model).named_parameters():
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
    _check_metadata(path, {f"model.{n}": tuple(p.shape) for n, p in params.items()})
    sd = {f"model.{n}": torch.empty_like(p) for n, p in params.items()}
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    for n, p in params.items():
        p.copy_(sd[f"model.{n}"])
    model.save_pretrained(str(out_dir), safe_serialization=True)
    logger.info("exported %s -> %s", path, out_dir)
    return Path(out_dir)
