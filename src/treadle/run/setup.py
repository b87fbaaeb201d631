"""The model and its schedule for a run: a zoo name, a Hugging Face config or ``package.module:function``;
a schedule or plan file, ``--plan auto`` (rank 0 plans and broadcasts the schedule), or a ready recipe."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import TreadleError
from ..mesh import Mesh
from ..schedule.core import Schedule, create_schedule
from ..schedule.replay import load_schedule
from .config import RunConfig, RunError, recipe_mesh
from .precheck import check_schedule_world, read_schedule_text

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside: every parameter a module registers moves to the meta device (no memory kept, no init done on
    it); buffers stay where they are created. `build` then materialises the parameters on the mesh's device
    with a per-module seeded init, the same global tensors for any schedule."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def load_run_model(spec: str, *, seq: int, seed: int, meta: bool = False) -> nn.Module:
    """The model named by `spec`, with the same random weights on every rank (seeded by `seed`), training mode.

    `spec`: a directory with a Hugging Face ``config.json`` (or the file): ``AutoModelForCausalLM.from_config``;
    ``package.module:function``: its model; else a `treadle.models.zoo` name, built without dropout.
    `meta=True`: parameters on the meta device (`parameters_on_meta`), for `build` to materialise.
    Raises RunError naming the spec when it is none of these."""
    if meta:
        with parameters_on_meta():
            return load_run_model(spec, seq=seq, seed=seed)
    torch.manual_seed(seed)
    p = Path(spec)
    if p.is_dir() or p.name == "config.json":
        cfg_path = p / "config.json" if p.is_dir() else p
        if not cfg_path.is_file():
            raise RunError(f"treadle.run: --model {spec!r}: no config.json there")
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(cfg_path.parent))
        config.use_cache = False
        model = AutoModelForCausalLM.from_config(config)
    else:
        from ..models.zoo import load_model

        try:
            model, _ = load_model(spec, batch=1, seq=seq, dropout=False)
        except TreadleError as exc:
            raise RunError(f"treadle.run: --model {spec!r}: {exc}") from exc
    model.train()
    return model


def model_inputs(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Keyword arguments of one causal-LM step on token ids (B, S): ``input_ids`` and ``labels`` (the model
    shifts them). Raises RunError for a model whose forward takes no ``labels``."""
    import inspect

    params = inspect.signature(model.forward).parameters
    if "input_ids" not in params or "labels" not in params:
        raise RunError(f"treadle.run trains language models called as model(input_ids=, labels=) returning .loss; "
                       f"{type(model).__name__}.forward takes {list(params)}")
    return {"input_ids": ids, "labels": ids}


def _recipe(model: nn.Module, cfg: RunConfig, world: int) -> Schedule:
    from ..models import megatron

    megatron_recipe = cfg.recipe.startswith("megatron")
    dp, tp = recipe_mesh(cfg, world)
    sch = create_schedule(model, mesh=Mesh((dp, tp), ("dp", "tp")))
    shard = cfg.recipe.endswith("fsdp")
    if megatron_recipe:
        megatron(sch, tp="tp", dp="dp" if dp > 1 else None, zero3=shard)
    elif dp > 1 or shard:
        sch.data_parallel(axis="dp", shard=shard)
    return sch


def _auto_clusters(cfg: RunConfig, world: int, rank: int) -> list:
    """Every rank: the clusters ``--plan auto`` plans on. `cfg.cluster` (a spec or file) or the launch's shape
    (NODESxPROCS) on the cpu / h100 preset; on CPU a preset is measured first, on this launched group
    (NOTE [plan for this host] in treadle.cli.plan; every rank takes part), unless it is a file or
    `cfg.nominal`. Rank 0 measures one core before the group's links, the others waiting."""
    from ..cost.cluster import parse_cluster
    from ..cost.this_host import calibrate_group, calibration_mesh, host_clusters, measures_this_host

    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1)
    per_node = world // max(nodes, 1)
    device = "h100" if torch.cuda.is_available() else "cpu"
    spec = cfg.cluster or (f"{nodes}x{per_node}:{device}" if nodes > 1 else f"{world}:{device}")
    cluster = parse_cluster(spec)
    if not measures_this_host(cluster, spec, nominal=cfg.nominal) or world < 2:
        return [cluster]
    from ..profile.hardware import calibrate_cpu

    box: list[Any] = [calibrate_cpu(threads=1) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    mesh = calibration_mesh(world)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)) or world)
    # the links as `treadle plan` measures this host (`calibrate_this_host`: no held-out sizes, which no fit reads)
    measured = calibrate_group(mesh, box[0], threads_per_rank=torch.get_num_threads(), ranks_per_host=local,
                               held_out_bytes=()).cluster
    logger.info("--plan auto: measured this host (%s): %s", mesh, measured.assumptions())
    return host_clusters(measured)


def _plan_auto(model: nn.Module, cfg: RunConfig, clusters: list) -> str:
    """Rank 0: plan on the clusters and return the schedule JSON (the other ranks get it by broadcast)."""
    from ..planner import plan_model

    ids = torch.zeros((cfg.batch, cfg.seq), dtype=torch.int64)
    # price_top=0: `treadle.price` rehearses on a fake process group of its own and cannot run inside this
    # launched one, so the budget binds the solver's memory model here (plan with `treadle plan` beforehand to
    # have it checked as built)
    plan = plan_model(model, model_inputs(model, ids), cluster=clusters if len(clusters) > 1 else clusters[0],
                      memory_budget_bytes=cfg.memory_budget_bytes,
                      model_spec={"name": cfg.model, "batch": cfg.batch, "seq": cfg.seq}, price_top=0)
    logger.info("planned (solver estimate): %s; %s", plan.estimated, plan.cluster.assumptions())
    return plan.schedule.to_json()


def _from_rank0(rank: int, write: Callable[[], str], what: str) -> str:
    """The schedule JSON rank 0 writes (`write`), broadcast to every rank; a treadle error on rank 0 is raised on
    every rank as a RunError naming `what`."""
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = write()
        except TreadleError as exc:
            box[0] = RunError(f"treadle.run: {what} failed on rank 0: {exc}")
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def make_schedule(model: nn.Module, cfg: RunConfig, *, world: int, rank: int) -> Schedule:
    """The run's schedule over a world of `world` ranks (a collective for ``--plan auto`` and the recipes: rank 0
    plans or writes the recipe, then broadcasts it as JSON, so every rank builds the same schedule). Raises
    RunError when the schedule's mesh does not match the world size or the schedule does not fit the model."""
    if cfg.plan == "auto":
        try:
            clusters = _auto_clusters(cfg, world, rank)  # a collective on CPU (every rank measures the links)
        except TreadleError as exc:
            raise RunError(f"treadle.run: --plan auto: {exc}") from exc
        text = _from_rank0(rank, lambda: _plan_auto(model, cfg, clusters), "--plan auto")
    elif cfg.schedule or cfg.plan:
        text = read_schedule_text(cfg.schedule or cfg.plan)
    elif world == 1 or not dist.is_initialized():
        return _recipe(model, cfg, world)
    else:  # a constrained plan (a model no named recipe knows) solved on every rank could differ between ranks
        text = _from_rank0(rank, lambda: _recipe(model, cfg, world).to_json(), f"--recipe {cfg.recipe}")
    check_schedule_world(text, world)
    try:
        sch = load_schedule(model, text)
    except TreadleError as exc:
        raise RunError(f"treadle.run: the schedule does not fit model {cfg.model!r}: {exc}") from exc
    return sch


def pipeline_batches(sch: Schedule, cfg: RunConfig, dp_size: int) -> tuple[int, int] | None:
    """(micro batch, accumulation steps) of a pipelined schedule, None for another: its micro-batches are the
    run's gradient accumulation, and the stages run the shapes the schedule captured (its example inputs), so
    the run's batch and sequence must be those. Raises RunError naming both when they differ."""
    cfg_pp = sch.view().extras.get("pipeline")
    if cfg_pp is None:
        return None
    m = cfg_pp["n_microbatches"]
    shapes = {k: tuple(v["shape"]) for k, v in cfg_pp["example_inputs"].items() if isinstance(v, dict) and "shape" in v}
    want = shapes.get("input_ids")
    if want is None or want != (cfg.batch, cfg.seq):
        raise RunError(f"treadle.run: the pipeline schedule was captured on input_ids of shape {want}; run it with "
                       f"--batch {want[0] if want else '?'} --seq {want[1] if want and len(want) > 1 else '?'} "
                       f"(given --batch {cfg.batch} --seq {cfg.seq}), or write the schedule for this batch")
    if cfg.batch % (dp_size * m):
        raise RunError(f"treadle.run: batch {cfg.batch} does not split over {dp_size} data-parallel replicas x "
                       f"{m} micro-batches of the pipeline")
    micro = cfg.batch // (dp_size * m)
    if (cfg.grad_accum and cfg.grad_accum != m) or (cfg.micro_batch and cfg.micro_batch != micro):
        raise RunError(f"treadle.run: a pipeline's gradient accumulation is its {m} micro-batches of {micro} "
                       f"samples (n_microbatches in the schedule); --grad-accum {cfg.grad_accum} / --micro-batch "
                       f"{cfg.micro_batch} disagree: drop them or change the schedule")
    if cfg.compile:
        raise RunError("treadle.run: --compile does not apply to a pipeline schedule yet (its stages are graphs "
                       "of the captured model); drop --compile")
    return micro, m


def data_parallel_coords(sch: Schedule) -> tuple[int, int]:
    """(dp size, this rank's dp index) over the schedule's data-parallel axes (row-major in mesh order);
    (1, 0) without data parallelism."""
    dp = sch.view().data_parallel
    if dp is None:
        return 1, 0
    return dp.size(sch.mesh), dp.local_index(sch.mesh)
