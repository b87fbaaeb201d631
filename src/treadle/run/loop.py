"""The training job of one rank: process group, model + schedule, build with mixed precision, data, AdamW,
checkpoints and metrics. `main` is what ``torchrun ... -m treadle.run`` runs on every rank.

NOTE [mixed precision]: ``--precision bf16`` keeps fp32 parameters, gradients and AdamW states (the master
copy) and computes in bfloat16, the policy the cost model prices (TrainSpec.master_copy). Under FSDP the
schedule's `fully_shard` gets ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (gathers in bf16,
gradients reduced in fp32); without FSDP (DDP, tensor parallel) the forward runs under
``torch.autocast(bfloat16)``, which casts the fp32 weights per matmul and leaves gradients in fp32; a pipeline
is built with ``autocast_dtype=bfloat16`` and its stages run that autocast themselves (NOTE [pipeline autocast]);
bf16 with FSDP2 beside a pipeline is refused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..errors import TreadleError
from ..forms.expert.runtime import expert_loads
from . import checkpoint as ckpt
from . import failure, health, preflight
from .agree import JobError, agree
from .config import RunConfig, RunError
from .data import Sampler, make_tokenizer, pack, split_batch
from .layout import fsdp_unit_axes, layouts as param_layouts, shards_by_name, unwrap
from .metrics import (MetricsLogger, StepMetrics, measured_pipeline_doc, memory_bytes, model_flops_per_step,
                      resolve_peak_flops_per_s, stage_metrics)
from .optim import init_optimizer_state, lr_at, make_optimizer
from .preempt import StopSignals
from .setup import data_parallel_coords, load_run_model, make_schedule, model_inputs, pipeline_batches
from .step import run_step

logger = logging.getLogger(__name__)


def init_distributed(timeout_s: float) -> torch.device:
    """Initialise the process group from torchrun's environment (NCCL + gloo on GPU, gloo on CPU) with a
    collective timeout of `timeout_s`. Returns this rank's device."""
    if dist.is_initialized():
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RunError(f"treadle.run: environment {missing} not set; launch with torchrun "
                       f"(torchrun --nproc-per-node N -m treadle.run ...) or use 'treadle run'")
    timeout = timedelta(seconds=timeout_s)
    bound_subgroup_timeouts(timeout)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)
        return torch.device("cuda", local)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def bound_subgroup_timeouts(timeout: timedelta) -> None:
    """NOTE [sub-group timeout]: `init_process_group(timeout=)` bounds the world's collectives only; the groups
    DeviceMesh makes per mesh axis (tensor-parallel all-reduces, data-parallel gradient reductions) are created
    by `new_group` without a timeout, which then takes torch's default of 30 minutes: a hung rank would keep
    its tensor-parallel peers waiting that long. torch reads that default from `distributed_c10d` when a group
    is made, so the run sets it to ``--timeout-s`` first (this process is the run's alone)."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def build_for(sch, cfg: RunConfig) -> nn.Module:
    """`build` with the FSDP2 MixedPrecisionPolicy of NOTE [mixed precision] when bf16 meets FSDP."""
    from ..runtime.build import build

    dp = sch.view().data_parallel
    pipelined = sch.view().extras.get("pipeline") is not None
    if cfg.precision == "bf16" and dp is not None and dp.shard:  # beside a pipeline too: its capture casts the
        from torch.distributed.fsdp import MixedPrecisionPolicy  # parameters as the policy will (NOTE [pipeline
        # capture under FSDP2's mixed precision])

        return build(sch, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    if cfg.precision == "bf16" and pipelined:  # NOTE [pipeline autocast]: the stages run the autocast themselves
        return build(sch, autocast_dtype=torch.bfloat16)
    return build(sch)


def autocast_for(sch, cfg: RunConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward's autocast under NOTE [mixed precision]: bf16 autocast unless FSDP's policy casts."""
    dp = sch.view().data_parallel
    fsdp = dp is not None and dp.shard
    pipelined = sch.view().extras.get("pipeline") is not None  # its stages run it (NOTE [pipeline autocast])
    if cfg.precision == "bf16" and not fsdp and not pipelined:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _compile_blocks(model: nn.Module, device: torch.device) -> int:
    """torch.compile in place (names unchanged) every block of every ModuleList not inside another such block
    (`treadle.pricing.compiled.compiled_units`: the price of ``execution="compiled"`` reads the same rule);
    returns how many."""
    from ..pricing.compiled import compiled_units

    backend = "inductor" if device.type == "cuda" else "aot_eager"
    base = unwrap(model)
    units = compiled_units(base)
    for path in units:
        base.get_submodule(path).compile(backend=backend)
    return len(units)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, layouts: dict, mesh, micro_batches: list[torch.Tensor], *,
               clip_norm: float | None, autocast: contextlib.AbstractContextManager | None = None) -> tuple[float, float]:
    """One optimizer step (`step.run_step`, which skips the update of a non-finite step). Returns (loss,
    gradient norm before clipping): the loss averaged over micro-batches and over all ranks (tensor-parallel
    replicas hold the same loss)."""
    out = run_step(model, opt, layouts, mesh, micro_batches, clip_norm=clip_norm, autocast=autocast)
    return out.loss, out.grad_norm


class NonFiniteError(JobError):
    """A step's loss or gradient norm was NaN / inf more often than ``--skip-nonfinite`` allows."""


def train(cfg: RunConfig) -> list[float]:
    """Run `cfg` on this rank of the launched job. Returns the logged loss of every step this run did.
    Stops early, after saving, when SIGTERM / SIGUSR1 reaches any rank (`preempt`)."""
    device = init_distributed(cfg.timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.export_hf and not cfg.ckpt_dir:
        raise JobError("treadle.run: --export-hf writes from the final checkpoint; give --ckpt-dir too")
    lock = preflight.check(cfg)
    try:
        return _train(cfg, device, rank, world)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg: RunConfig, device: torch.device, rank: int, world: int) -> list[float]:
    model = load_run_model(cfg.model, seq=cfg.seq, seed=cfg.seed, meta=cfg.init == "meta")
    if device.type == "cuda":  # build slices on the device the weights are on (meta ones: on the mesh's)
        if cfg.init == "meta":
            for m in model.modules():
                m._buffers.update({n: b.to(device) for n, b in m._buffers.items() if b is not None})
        else:
            model.to(device)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    samples = pack(cfg.data, seq=cfg.seq, tokenizer=make_tokenizer(cfg.tokenizer), text_field=cfg.text_field,
                   vocab_size=vocab)
    model_inputs(model, samples[:1])  # the model takes input_ids= and labels= (else a RunError)
    sch = make_schedule(model, cfg, world=world, rank=rank)
    dp_size, dp_rank = data_parallel_coords(sch)
    sampler = Sampler(len(samples), cfg.batch, dp_size, cfg.seed)
    micro, accum = (pipeline_batches(sch, cfg, dp_size)
                    or split_batch(cfg.batch, dp_size, micro_batch=cfg.micro_batch, grad_accum=cfg.grad_accum))
    flops_per_step = per_stage_flops = None
    peak = resolve_peak_flops_per_s(cfg.hardware, precision=cfg.precision, device=device)
    if peak is not None and rank == 0:
        flops_per_step, per_stage_flops = model_flops_per_step(model, model_inputs(model, samples[: cfg.batch].clone()),
                                                               sch.view().extras.get("pipeline_cuts"))
    before = shards_by_name(sch)
    built = build_for(sch, cfg)
    mesh = sch.mesh
    dp = sch.view().data_parallel
    layouts = param_layouts(built, before, mesh, dp.shard_axes if dp is not None and dp.shard else None,
                            fsdp_unit_axes(sch))
    if cfg.compile:
        logger.info("compiled %d blocks", _compile_blocks(built, device))

    opt = make_optimizer(built, layouts, cfg)
    init_optimizer_state(opt)
    start = 0
    checkpointer = ckpt.Checkpointer(cfg.ckpt_dir, async_save=cfg.async_ckpt, keep=cfg.keep,
                                     timeout=timedelta(seconds=cfg.timeout_s)) if cfg.ckpt_dir else None
    source = ckpt.resume_source(cfg.resume, cfg.ckpt_dir)
    if source is not None:
        start = ckpt.load(source, built, opt, layouts, mesh)
    else:
        # the stream dropout draws from, the same on every rank: tensor-parallel replicas must agree on masks
        # (build's fork_rng derives per-shard streams from it); checkpointed from here on
        torch.manual_seed(cfg.seed + 1)

    metrics = MetricsLogger(cfg, enabled=rank == 0, start_step=start)
    metrics.message(f"treadle.run: {cfg.model} on {mesh} ({world} ranks, {device.type}); {len(samples)} samples of "
                    f"{cfg.seq} tokens; batch {cfg.batch} = {dp_size} dp x {accum} accum x {micro}; "
                    f"steps {start}..{cfg.steps}" + (f"; resumed from {source}" if source else ""))
    autocast = autocast_for(sch, cfg, device)
    losses = []
    tokens_per_step = cfg.batch * cfg.seq
    skipped = 0
    # SIGTERM / SIGUSR1 save at the next step boundary only inside the loop: before it there is nothing to save,
    # and a rank torchrun's agent stops (a peer failed during setup) must end at once
    with StopSignals() as signals:
        try:
            for step in range(start, cfg.steps):
                t0 = time.perf_counter()
                lr = lr_at(step, cfg)
                for g in opt.param_groups:
                    g["lr"] = lr
                idx = sampler.indices(step, dp_rank)
                micro_batches = [samples[idx[i * micro : (i + 1) * micro]] for i in range(accum)]
                traced = cfg.trace is not None and step == cfg.steps - 1
                # a pipeline's actions: on the step before the profiled one where there is one (no profiler cost)
                timed = (cfg.trace is not None and hasattr(built, "recording")
                         and step == (cfg.steps - 2 if cfg.steps - 2 >= start else cfg.steps - 1))
                if timed:
                    dist.barrier()
                    t_pipe = time.perf_counter()
                with (_profiled(trace_path(cfg.trace, rank), step) if traced else contextlib.nullcontext()), \
                        (built.recording() if timed else contextlib.nullcontext()):
                    out = run_step(built, opt, layouts, mesh, micro_batches, clip_norm=cfg.clip_norm, autocast=autocast,
                                   stop_signal=signals.signum)
                done = step + 1
                if not out.finite:
                    skipped += 1
                    if skipped > cfg.skip_nonfinite:
                        if checkpointer:
                            checkpointer.wait()
                        kept = ckpt.latest(cfg.ckpt_dir) if cfg.ckpt_dir else None
                        raise NonFiniteError(f"treadle.run: {out.nonfinite_text(done)}: stopped, nothing of this state "
                                             f"saved ({f'the newest checkpoint is {kept}' if kept else 'no checkpoint'}"
                                             f"); --skip-nonfinite {skipped} would skip such steps")
                    logger.warning("%s: optimizer step skipped (%d of --skip-nonfinite %d)", out.nonfinite_text(done),
                                   skipped, cfg.skip_nonfinite)
                step_s = time.perf_counter() - t0
                if timed:  # after the step's time: the gather and the file are not the step's
                    _write_pipeline_trace(built, mesh, t_pipe, t0 + step_s, memory_bytes(device), cfg.trace)
                losses.append(out.loss)
                mfu = flops_per_step / step_s / (world * peak) if flops_per_step and peak else None
                mem = memory_bytes(device)
                stages = stage_metrics(built, mesh, per_stage_flops, step_s, peak, mem) if metrics.logs(done) else None
                loads = expert_loads(built) if metrics.logs(done) else None  # collectives: at the same steps
                experts = [{"module": e.module, "rows": list(e.rows), "imbalance": e.imbalance,
                            "rank_imbalance": e.rank_imbalance(e.ranks)}
                           for e in loads] if loads else None
                metrics.log(StepMetrics(step=done, loss=out.loss, lr=lr, grad_norm=out.grad_norm, step_s=step_s,
                                        tokens=done * tokens_per_step, tokens_per_s=tokens_per_step / step_s,
                                        mfu=mfu, mem_bytes=mem, epoch=sampler.epoch(done), stages=stages,
                                        experts=experts))
                health.mark(done)
                if out.stop_ranks:
                    saved = checkpointer.save(built, opt, layouts, mesh, step=done) if checkpointer else None
                    if checkpointer:
                        checkpointer.close()
                    got = ", ".join(f"{signal.Signals(n).name} on rank {r}" for r, n in sorted(out.stop_ranks.items()))
                    metrics.message(f"treadle.run: stop requested ({got}) at step {done} of {cfg.steps}: "
                                    + (f"saved {saved}; run the same command to resume" if saved else
                                       "no --ckpt-dir, nothing saved"))
                    return losses
                if checkpointer and ((cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == cfg.steps):
                    checkpointer.save(built, opt, layouts, mesh, step=done)
            if checkpointer:
                checkpointer.close()
            if cfg.export_hf:
                dist.barrier()
                problem = None
                if rank == 0:
                    fresh = load_run_model(cfg.model, seq=cfg.seq, seed=cfg.seed)
                    try:
                        ckpt.export_hf(ckpt.step_dir(cfg.ckpt_dir, cfg.steps), fresh, cfg.export_hf)
                        metrics.message(f"exported Hugging Face model to {cfg.export_hf}")
                    except OSError as exc:
                        problem = f"--export-hf {cfg.export_hf}: {exc.strerror or exc}"
                    except TreadleError as exc:  # the others wait in `agree`: tell them
                        problem = str(exc)
                agree(problem)
        finally:
            metrics.close()
    return losses


def _profiled(path: str, step: int) -> contextlib.AbstractContextManager:
    from ..viz.measured import profiled_step  # the trace writer: imported when a step is traced

    return profiled_step(path, step)


def _write_pipeline_trace(built, mesh, t0: float, end: float, mem: int, template: str) -> None:
    """Rank 0 writes the measured pipeline timeline of this step (`trace_path(template, "pipeline")`): a Chrome
    trace with a track per pp rank, its document under otherData.measured_pipeline (`treadle price --measured`
    draws it beside the predicted one). Every rank takes part in the gather."""
    import json

    from ..viz.chrome import chrome_trace
    from ..viz.pipeline_timeline import timeline_from_measured_pipeline

    doc = measured_pipeline_doc(built, mesh, t0, end, mem)
    if doc is None:
        return
    trace = chrome_trace(timeline_from_measured_pipeline(doc), process="treadle measured step")
    trace["otherData"]["measured_pipeline"] = doc
    path = trace_path(template, "pipeline")
    with open(path, "w") as f:
        json.dump(trace, f)
    logger.info("wrote the measured pipeline timeline to %s", path)


def trace_path(template: str, rank: int | str) -> str:
    """The per-rank trace file: ``{rank}`` substituted, else ``-rank<r>`` inserted before the suffix; `rank`
    ``"pipeline"``: the measured pipeline timeline's file (``-pipeline``)."""
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    tag = "pipeline" if rank == "pipeline" else f"rank{rank}"
    stem, dot, suffix = template.rpartition(".")
    return f"{stem}-{tag}.{suffix}" if dot and "/" not in suffix else f"{template}-{tag}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m treadle.run`` on every rank. Exit status (`failure`): 0 done or stopped
    after saving; 2 an error of the user's, said once for the job; 1 a fault (naming the rank that died or
    hung) or a bug (with its traceback)."""
    from .start import settings

    cfg = settings(argv)
    return cfg if isinstance(cfg, int) else run_rank(cfg)


def run_rank(cfg: RunConfig) -> int:
    """This rank's job with settings `cfg` (checked by `start.settings`); its exit status, as `main`'s."""
    beat = None
    try:
        init_distributed(cfg.timeout_s)
        beat = health.Heartbeat(dist.get_rank()).start()
        train(cfg)
    except KeyboardInterrupt:
        print(f"treadle.run: rank {os.environ.get('RANK', '?')}: interrupted", file=sys.stderr, flush=True)
        return 130
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, SystemExit):
            raise
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        with contextlib.suppress(ValueError):  # the agent's SIGTERM to the others must not cut the report short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return failure.report(exc, rank=rank, world=dist.get_world_size() if dist.is_initialized() else 0)
    finally:
        if beat is not None:
            beat.stop()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    return 0
