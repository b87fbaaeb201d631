"""Live metrics of a run on rank 0: a progress line (a rich bar on a terminal), a JSONL file, TensorBoard
events when installed. Throughput in tokens/s, MFU from the profiler's FLOPs per step and the device peak,
memory as CUDA max allocated bytes or the process RSS on CPU."""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .config import RunConfig, RunError
from .step import sum_over_mesh

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step, as logged. `loss` is the mean over data-parallel ranks; `step_s` wall seconds of
    this rank; `mfu` None when no device peak is known; `experts` per expert-parallel experts module, the rows
    each expert computed since the last logged step and the busiest over the mean (`treadle.forms.expert.runtime.
    expert_loads`), None without one."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    step_s: float
    tokens: int
    tokens_per_s: float
    mfu: float | None
    mem_bytes: int
    epoch: float
    stages: list[StageMetrics] | None = None
    experts: list[dict] | None = None


def memory_bytes(device: torch.device) -> int:
    """CUDA max allocated bytes on a GPU; the resident set size of this process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak RSS (kilobytes on Linux/BSD, bytes on macOS)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)


def resolve_peak_flops_per_s(hardware: str, *, precision: str, device: torch.device) -> float | None:
    """Peak FLOP/s of one device for MFU: ``none`` -> None; ``auto`` -> the preset whose name matches the CUDA
    device (None on CPU or an unknown GPU); else a preset name, ``cpu`` (calibrated) or a HardwareSpec JSON."""
    from ..profile.hardware import HARDWARE_PRESETS, hardware_preset

    dtype = "bfloat16" if precision == "bf16" else "float32"
    if hardware == "none":
        return None
    if hardware == "auto":
        if device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(device).lower()
        keys = [k for k in HARDWARE_PRESETS if k.split("-")[0] in name]
        if not keys:
            logger.info("no hardware preset matches %r; MFU not reported (give --hardware)", name)
            return None
        hw = HARDWARE_PRESETS[sorted(keys)[0]]
    else:
        from ..errors import TreadleError

        try:
            hw = hardware_preset(hardware)
        except TreadleError as exc:
            raise RunError(f"treadle.run: --hardware {hardware!r}: {exc}") from exc
    return hw.peak_for(dtype) if dtype in hw.peak_flops_per_s else hw.peak_for("float32")


def model_flops_per_step(model: nn.Module, inputs: dict[str, torch.Tensor],
                         cuts: list[str] | None = None) -> tuple[int, list[int] | None]:
    """Forward + backward FLOPs of one step of the whole (global) batch `inputs`: `treadle.profile.model_flops`,
    the numerator the price's MFU uses too; with pipeline `cuts`, also each stage's part of them
    (`forms.pipeline.facts.stage_flops`), from the same profile. Inputs move to the parameters' device (meta for
    a meta model)."""
    from ..profile.profiler import profile

    device = next(model.parameters()).device
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    prof = profile(model, inputs, hardware="cpu", optimizer="sgd")
    if not cuts:
        return int(prof.model_flops), None
    from ..forms.pipeline.facts import stage_flops

    return int(prof.model_flops), stage_flops(prof.ops, cuts)


@dataclass(frozen=True)
class StageMetrics:
    """One pipeline rank's part of a step (the ranks of one pp coordinate, every replica and tensor shard):
    its stages, their useful FLOPs per rank of it, its MFU (None without a device peak) and the largest memory
    of its ranks. A rank's MFU shows its stages' share of the work: the step is the same wall time on all."""

    pp: int
    stages: list[int]
    flops: int | None
    mfu: float | None
    mem_bytes: int


def stage_metrics(model: nn.Module, mesh, stage_flops_: list[int] | None, step_s: float, peak: float | None,
                  mem: int) -> list[StageMetrics] | None:
    """Per pp rank of a pipelined `model` (`PipelineModel`), gathered from every rank (a collective: every rank
    calls it at the same steps); None when `model` is not a pipeline. A stage's FLOPs split evenly over the
    ranks that compute it (its replicas and tensor-parallel shards)."""
    axis = getattr(model, "pp_axis", None)
    if axis is None:
        return None
    import torch.distributed as dist

    from ..forms.pipeline.conflicts import stage_rank

    world, pp_size = dist.get_world_size(), mesh.size(axis)
    every = torch.zeros(world, dtype=torch.int64, device=mesh.device)
    every[dist.get_rank()] = mem
    sum_over_mesh(every, mesh)  # gathers one int64 per rank, the memory; the stages follow from the schedule
    per_pp = world // pp_size
    out = []
    for pp in range(pp_size):
        stages = [s for s in range(model.n_stages) if stage_rank(model.schedule_kind, s, pp_size) == pp]
        flops = sum(stage_flops_[s] for s in stages) // per_pp if stage_flops_ is not None else None
        mfu = flops / step_s / peak if flops is not None and peak else None
        mem_pp = max(int(every[r]) for r in range(world) if mesh.coordinate(r)[axis] == pp)
        out.append(StageMetrics(pp, stages, flops, mfu, mem_pp))
    return out


def measured_pipeline_doc(model: nn.Module, mesh, t0: float, end: float, mem_bytes: int) -> dict | None:
    """This step of a pipelined `model` as measured (`PipelineModel.recording()` around it, started at perf_counter
    `t0` after a barrier, ended at `end`), gathered from every rank (a collective): per pp coordinate, the rank of
    the first replica and tensor shard — its stages, actions in seconds from `t0`, step end and memory. What
    `treadle.viz.pipeline_timeline.timeline_from_measured_pipeline` draws; None on ranks other than 0."""
    import torch.distributed as dist

    axis = model.pp_axis
    coord = mesh.coordinate(dist.get_rank())
    mine = {"pp": coord[axis], "first": all(c == 0 for a, c in coord.items() if a != axis),
            "stages": list(model.local_stage_indices), "end_s": end - t0, "mem_bytes": mem_bytes,
            "actions": [(s, k, mb, a - t0, b - t0) for s, k, mb, a, b in model.log.actions]}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() != 0:
        return None
    return {"axis": axis, "n_stages": model.n_stages, "schedule": model.schedule_kind,
            "n_microbatches": model.n_microbatches, "world_size": len(every),
            "ranks": [{k: v for k, v in e.items() if k != "first"} for e in every if e["first"]]}


class MetricsLogger:
    """Rank 0's sink for StepMetrics: console (rich progress bar on a terminal, a line per `log_every` steps
    otherwise), JSONL file, TensorBoard. Other ranks get a logger that writes nothing."""

    def __init__(self, cfg: RunConfig, *, enabled: bool, start_step: int):
        self.enabled = enabled
        self.cfg = cfg
        self._jsonl = None
        self._tb = None
        self._progress = None
        if not enabled:
            return
        if cfg.metrics:
            Path(cfg.metrics).parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(cfg.metrics, "a", buffering=1)
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise RunError("treadle.run: --tensorboard needs the tensorboard package (pip install tensorboard)") from None
            self._tb = SummaryWriter(cfg.tensorboard)
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                      TextColumn("{task.fields[info]}"))
            self._task = self._progress.add_task("train", total=cfg.steps, completed=start_step, info="")
            self._progress.start()

    def log(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        mfu = f" mfu {m.mfu * 100:.3g}%" if m.mfu is not None else ""
        info = (f"loss {m.loss:.4f} lr {m.lr:.2e} |g| {m.grad_norm:.3f} {m.tokens_per_s:,.0f} tok/s "
                f"{m.step_s * 1e3:.0f} ms{mfu} mem {m.mem_bytes / 2**20:.0f} MiB")
        if self._progress is not None:
            self._progress.update(self._task, completed=m.step, info=info)
        elif self.logs(m.step):
            print(f"step {m.step}/{self.cfg.steps} {info}", flush=True)
        if m.experts and self.logs(m.step):
            worst = max(m.experts, key=lambda e: e["imbalance"])
            rank = max(m.experts, key=lambda e: e["rank_imbalance"])
            self.message(f"  experts: busiest / mean rows {worst['imbalance']:.2f} ({worst['module']}; "
                         f"{len(m.experts)} expert-parallel modules); busiest / mean rank "
                         f"{rank['rank_imbalance']:.2f} ({rank['module']}: what expert_parallel(load_imbalance=) "
                         f"states for the price)")
        for st in m.stages or ():
            self.message(f"  pp {st.pp} stages {st.stages}: " + (f"mfu {st.mfu * 100:.3g}% " if st.mfu is not None
                                                                   else "") + f"mem {st.mem_bytes / 2**20:.0f} MiB")
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({**asdict(m), "time": time.time()}) + "\n")
        if self._tb is not None:
            for k in ("loss", "lr", "grad_norm", "tokens_per_s", "step_s", "mem_bytes"):
                self._tb.add_scalar(f"train/{k}", getattr(m, k), m.step)
            if m.mfu is not None:
                self._tb.add_scalar("train/mfu", m.mfu, m.step)
            if m.experts:
                self._tb.add_scalar("train/expert_imbalance", max(e["imbalance"] for e in m.experts), m.step)
                self._tb.add_scalar("train/expert_rank_imbalance", max(e["rank_imbalance"] for e in m.experts),
                                    m.step)
            for st in m.stages or ():
                self._tb.add_scalar(f"train/pp{st.pp}_mem_bytes", st.mem_bytes, m.step)
                if st.mfu is not None:
                    self._tb.add_scalar(f"train/pp{st.pp}_mfu", st.mfu, m.step)

    def logs(self, step: int) -> bool:
        """Whether step `step` is one the console shows (every `log_every`-th and the last)."""
        return step % self.cfg.log_every == 0 or step == self.cfg.steps

    def message(self, text: str) -> None:
        if self.enabled:
            (self._progress.console.print if self._progress is not None else print)(text)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
