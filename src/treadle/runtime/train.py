"""A few training steps of a schedule on a spawned gloo process group (the demo's and CLI's `train`).

Inside a job you launched yourself (torchrun), call `treadle.build` and write your own loop; this helper
is for trying a schedule from one process: it spawns the mesh's world, replays the schedule on a copy of
the model in each rank, builds it, and runs AdamW steps on the same batch, split over the data-parallel axis.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import TreadleError
from ..mesh import Mesh
from ..schedule.core import Schedule
from ..schedule.replay import load_schedule, trusted_load_args
from ..testing import check_process_count, spawn
from ..transport import restore_after_load, sendable
from .batch import check_batch, split_batch
from ..loss import call_loss, default_loss
from .optimizer import adamw, after_optimizer_step


@dataclass(frozen=True)
class TrainResult:
    """Losses per step (mean over data-parallel ranks) and the measured wall time of each step (seconds,
    slowest rank)."""

    losses: list[float]
    step_s: list[float]


def _train_rank(rank: int, world: int, payload: bytes) -> tuple[list[float], list[float]]:
    from .build import build

    p = torch.load(io.BytesIO(payload), weights_only=False)
    restore_after_load(p["model"])  # NOTE [registrations lost in transport]
    torch.manual_seed(p["seed"])
    mesh = Mesh(tuple(p["mesh_shape"]), tuple(p["mesh_names"]))
    sch = load_schedule(p["model"], p["schedule"], mesh, **p["load_args"])
    model = build(sch)
    dp = sch.view().data_parallel
    inputs = p["inputs"]
    if dp is not None:
        inputs = split_batch(inputs, dp.size(mesh), dp.local_index(mesh), axis=dp.label(), where="train")
    loss_fn = p["loss_fn"] or default_loss
    opt = adamw(model.parameters(), lr=p["lr"])  # NOTE [fused optimizer]
    own_step = callable(getattr(type(model), "step", None))  # a pipeline runs forward and backward itself
    losses, times = [], []
    for _ in range(p["steps"]):
        t0 = time.perf_counter()
        if own_step:
            value = model.step(**inputs)  # the mean micro-batch loss, on every rank
        else:
            loss = call_loss(loss_fn, model(**inputs), "train")
            loss.backward()
            value = float(loss.detach())
        opt.step()
        after_optimizer_step(model)
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(value)
    return losses, times


def train(sch: Schedule, example_inputs: dict[str, Any], *, loss_fn: Callable[[Any], torch.Tensor] | None = None,
          steps: int = 5, lr: float = 1e-3, seed: int = 0, timeout_s: float = 600.0) -> TrainResult:
    """Train `sch` for `steps` AdamW steps on `example_inputs` (keyword arguments of forward, global batch) on
    the mesh's world of gloo ranks (a pipeline schedule by its own step over its micro-batches). Returns a
    TrainResult.

    `loss_fn(output)` defaults to `treadle.loss.default_loss` (``output.loss``, e.g. a Hugging Face
    model given ``labels``, else the mean square of the first floating output), as in verify and profile.
    The schedule must not have been built; it is sent to the ranks as JSON with its original model.
    Raises TreadleError before spawning when the batch does not split over the data-parallel axis, SpawnError
    when the mesh has more ranks than this host may run (NOTE [process count] in `treadle.testing`)."""
    st = sch.view()
    if st.built:
        raise TreadleError("train: this schedule was already built; train an unbuilt schedule")
    check_process_count(sch.mesh.world_size, where=f"train on mesh {sch.mesh}")
    if not isinstance(example_inputs, dict):
        raise TreadleError("train: example_inputs must be a dict of keyword arguments of forward")
    if st.data_parallel is not None:
        check_batch(example_inputs, st.data_parallel.size(sch.mesh), axis=st.data_parallel.label(), where="train")
    if loss_fn is not None and st.extras.get("pipeline") is not None:
        raise TreadleError("train: a pipeline computes the loss it captured (the model's own, on its last stage); "
                           "train it without loss_fn")
    model: nn.Module = st.reference
    buf = io.BytesIO()
    torch.save(dict(model=sendable(model), schedule=sch.to_json(), load_args=trusted_load_args(sch), mesh_shape=sch.mesh.shape, mesh_names=sch.mesh.names,
                    inputs=example_inputs, loss_fn=loss_fn, steps=steps, lr=lr, seed=seed), buf)
    results = spawn(_train_rank, sch.mesh.world_size, buf.getvalue(), timeout_s=timeout_s)
    dp = st.data_parallel
    ranks = range(sch.mesh.world_size)
    if dp is not None:  # one representative per data-parallel replica, averaged
        ranks = [r for r in ranks if all(c == 0 for ax, c in sch.mesh.coordinate(r).items() if ax not in dp.axes)]
    ranks = list(ranks)
    losses = [sum(results[r][0][s] for r in ranks) / len(ranks) for s in range(steps)]
    step_s = [max(res[1][s] for res in results) for s in range(steps)]
    return TrainResult(losses, step_s)
