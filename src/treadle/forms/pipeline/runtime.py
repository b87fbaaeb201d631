"""What `build` installs for a pipeline (the "wrap" build step of the pipeline form): the stage graphs of
`stages.py` on this rank, each under the schedule's data parallelism, run by `torch.distributed.pipelining`'s
schedule classes (GPipe, 1F1B, interleaved 1F1B, looped BFS, zero bubble, ZBV, DualPipeV) over a ``pp`` mesh axis.

Data parallelism beside a pipeline (PP x DDP / FSDP2 / HSDP): every data-parallel replica runs its own pipeline
on its part of the batch. Under ``shard=True`` each local stage is wrapped as the data-parallel form wraps a
model (`treadle.forms.data.runtime.wrap_module`: ``fully_shard`` on the stage's blocks, then on the stage), and
the pipelining stage defers the reduce-scatter to its REDUCE_GRAD action after the last micro-batch. Under
``shard=False`` the replicas average their gradients after the step, in buckets of DDP's size
(`replica_buckets`), one all-reduce each over the flattened data-parallel group: torch 2.13's DDP reducer
cannot follow a pipeline stage's backward over several micro-batches (its first bucket rebuild counts every
parameter once per micro-batch and fails an internal assert), so no DDP wrapper is used.

A parameter read by stages on several ranks (tied input embedding / output head) gets its gradient summed over
the ``pp`` group after each step, so the copies stay equal (on FSDP2 shards: the ranks of one pp group hold the
same shard). One that two stages of one rank read is refused under data parallelism (each stage's wrapper would
reduce it) and under split-backward schedules (`conflicts.split_backward_conflict`).

Loss semantics (NOTE [pipeline loss]): each micro-batch loss is the model's own loss on that micro-batch
(a mean over its tokens). With ``scale_grads=True`` (pipelining's default) the summed micro-batch gradients
are divided by the micro-batch count, i.e. they are the gradients of the *mean of the micro-batch losses*,
which equals the single-process full-batch mean loss when micro-batches hold equal token counts; data
parallelism averages over replicas, as it does without a pipeline. `PipelineModel.step` returns this replica's
mean loss on every rank of its pipeline.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from ...errors import BuildError
from .conflicts import fsdp_split_conflict, shared_stage_conflict, split_backward_conflict, stage_rank
from .stages import StagePlan, split_stages

logger = logging.getLogger(__name__)


# NOTE [pipeline autocast]: `build(sch, autocast_dtype=torch.bfloat16)` (treadle.run --precision bf16 without
# FSDP) traces the capture under that autocast — the leaves run under it, and the graph's dtype assertions and
# the stand-ins of metadata-only inputs (NOTE [metadata-only inputs]) hold the dtypes the forward will see — and
# the stages' forwards and the loss run under it; the backward runs outside it, as eagerly. A step under an
# ambient autocast other than the captured one is refused: the graph would assert other dtypes, or compute in
# other ones than the caller asked.


def _autocast(dtype: torch.dtype | None, device: torch.device):
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


class ActionLog:
    """Where a pipeline's actions go while `PipelineModel.recording()` is on: (stage, kind, micro-batch, start,
    end) with perf_counter times; kinds are the price's (F, B, I, W) and ``loss`` (the last stage's loss forward),
    ``sync`` (tied gradients, the replicas' average). On a GPU each action is timed between synchronisations."""

    def __init__(self) -> None:
        self.on = False
        self.actions: list[tuple[int, str, int, float, float]] = []

    def timed(self, stage: int, kind: str, mb: int, fn, *args, **kwargs):
        if not self.on:
            return fn(*args, **kwargs)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        self.actions.append((stage, kind, mb, t0, time.perf_counter()))
        return out


@functools.cache
def _timed_stage_class():
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """A PipelineStage whose forward, backward and weight-gradient actions go to its `ActionLog`."""

        log: ActionLog

        autocast_dtype: torch.dtype | None = None

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            with _autocast(self.autocast_dtype, self.device):
                return self.log.timed(self.stage_index, "F", fwd_chunk_id, super().forward_one_chunk, fwd_chunk_id,
                                      *args, **kwargs)

        def _prepare_forward_infra(self, *args, **kwargs):  # shape inference runs a forward: the same autocast
            with _autocast(self.autocast_dtype, self.device):
                return super()._prepare_forward_infra(*args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            return self.log.timed(self.stage_index, "B" if full_backward else "I", bwd_chunk_id,
                                  super().backward_one_chunk, bwd_chunk_id, loss, full_backward, last_backward)

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            return self.log.timed(self.stage_index, "W", bwd_chunk_id, super().backward_weight_one_chunk,
                                  bwd_chunk_id, last_backward)

    return TimedStage


class _LossFn:
    def __init__(self, loss_gm: fx.GraphModule, log: ActionLog | None = None, stage: int = -1,
                 autocast: Any = None):
        self.loss_gm = loss_gm
        self.log = log
        self.stage = stage
        self.calls = 0
        self.autocast = autocast or contextlib.nullcontext  # () -> the forward's autocast context

    def __call__(self, output, target):
        outs = output if isinstance(output, tuple) else (output,)
        with self.autocast():
            if self.log is None or not self.log.on:
                return self.loss_gm(*outs, target)
            self.calls += 1
            return self.log.timed(self.stage, "loss", self.calls - 1, self.loss_gm, *outs, target)


class PipelineModel(nn.Module):
    """The local stages of a pipelined model and the schedule that runs them.

    ``step(**inputs)`` runs forward and backward of one batch (split into micro-batches) and returns the mean
    micro-batch loss (NOTE [pipeline loss]) on every rank; gradients are left in the parameters for an
    optimizer over ``parameters()`` (this rank's stages only). `param_dict()` maps original parameter names
    to this rank's parameters."""

    def __init__(self, stages: list[StagePlan], local: list[int], modules: list[nn.Module], schedule: Any, *, group,
                 stage0_inputs: list[str], target: str | None, constants: dict[str, Any], tied: list[str],
                 tied_here: list[str | None], last_rank: int, n_stages: int, tied_zeros: list[Any],
                 replica_group: Any = None, replicas: int = 1, axis: str = "pp",
                 canonical: dict[str, str] | None = None, pp_holders: dict[str, int] | None = None,
                 log: ActionLog | None = None, loss_fn: Any = None, schedule_kind: str = "1f1b",
                 n_microbatches: int = 1, autocast_dtype: torch.dtype | None = None,
                 device: torch.device | None = None, rows: dict[str, int] | None = None,
                 foreign: frozenset[int] = frozenset()):
        super().__init__()
        self.stages = nn.ModuleList(modules)  # this rank's stages, under their data-parallel wrappers
        self.local_stage_indices = local
        self.stage_plans = stages
        self._schedule = schedule
        self._group = group
        self.stage0_inputs = stage0_inputs
        self.target = target
        self.constants = constants
        self.tied = tied  # names (in the first stage that reads them) of parameters read on several ranks
        self._tied_here = tied_here  # per tied name: the name this rank's stages read it by, None if none does
        self._tied_zeros = tied_zeros  # per tied name: () -> this rank's zero contribution where it holds none
        self._replica_group = replica_group  # shard=False data parallelism: gradients averaged over it after a step
        self._replicas = replicas
        self.pp_axis = axis
        self._loss_fn = loss_fn
        self._canonical = canonical or {}  # stage-local name -> the unbuilt model's name (lm_head.weight -> wte's)
        self.pp_holders = pp_holders or {}  # the unbuilt model's name -> how many pp ranks hold it (tied: several)
        self.last_rank = last_rank
        self.n_stages = n_stages
        self.log = log or ActionLog()
        self.schedule_kind, self.n_microbatches = schedule_kind, n_microbatches
        self.autocast_dtype = autocast_dtype  # NOTE [pipeline autocast]
        self.device = device or torch.device("cpu")
        self.rows = rows or {}  # input name -> the rows (batch) one replica's step takes: as captured
        self._foreign = foreign  # ids of parameters another form reduces itself (the local experts): not averaged

    @contextlib.contextmanager
    def recording(self) -> Iterator[ActionLog]:
        """Record the actions of the steps run inside (`ActionLog`), e.g. for `treadle.run --trace`'s measured
        pipeline timeline; the log is emptied first."""
        self.log.actions.clear()
        self.log.on = True
        try:
            yield self.log
        finally:
            self.log.on = False

    def param_dict(self) -> dict[str, nn.Parameter]:
        out: dict[str, nn.Parameter] = {}
        for st in self.stages:
            for n, p in st.named_parameters():
                out.setdefault(n, p)
        return out

    def canonical_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by the unbuilt model's names (``named_parameters()`` of the model as written:
        a tied head is its embedding's name), each once: what a checkpoint in global shapes keys them by."""
        out: dict[str, nn.Parameter] = {}
        for n, p in self.param_dict().items():
            out.setdefault(self._canonical.get(n, n), p)
        return out

    def tied_params(self) -> dict[str, nn.Parameter]:
        """The parameters of `tied` this rank's stages hold, by the name they read each by (``lm_head.weight`` on
        the last stage's rank for GPT-2's ``transformer.wte.weight``)."""
        mine = self.param_dict()
        return {h: mine[h] for h in self._tied_here if h is not None}

    def forward(self, *args, **kwargs):
        raise BuildError("a pipelined model runs whole batches: call .step(**inputs), not forward")

    def step(self, **inputs: Any) -> float:
        """Forward and backward of one batch; the mean micro-batch loss of this replica, on every rank (broadcast
        from the last stage's rank over the pp group)."""
        mine = self.step_local(**inputs)
        loss = torch.tensor(mine if mine is not None else 0.0, dtype=torch.float64)
        dist.broadcast(loss, self.last_rank, group=self._group)
        return float(loss)

    def step_local(self, **inputs: Any) -> float | None:
        """`step` without the loss broadcast: the mean micro-batch loss on the rank that holds the last stage, None
        on the others (for a caller that reduces the loss with a collective of its own, as `treadle.run` does)."""
        self._check_autocast()
        for k, v in self.constants.items():
            if k in inputs and inputs[k] != v:
                raise BuildError(f"pipeline step: input {k}={inputs[k]!r} differs from the captured {v!r}")
        for k, n in self.rows.items():
            got = inputs[k].shape[0] if k in inputs and torch.is_tensor(inputs[k]) and inputs[k].dim() else None
            if got is not None and got != n:
                raise BuildError(f"pipeline step: input {k!r} has {got} rows but the stages were captured for {n} "
                                 f"per replica ({self.n_microbatches} micro-batches of {n // self.n_microbatches}: "
                                 f"the example batch over the data-parallel replicas); pass {n} rows, or rebuild "
                                 f"with example inputs of this replica's batch times the replica count")
        args = [inputs[n] for n in self.stage0_inputs]
        target = inputs[self.target] if self.target else None
        losses: list[torch.Tensor] = []
        holds_first = 0 in self.local_stage_indices
        holds_last = (self.n_stages - 1) in self.local_stage_indices
        kw = {}
        if holds_last:
            kw = {"target": target, "losses": losses}
        if isinstance(self._loss_fn, _LossFn):
            self._loss_fn.calls = 0
        # NOTE [the last stage's outputs]: torch's schedules keep every micro-batch's output of the last stage for a
        # merged return (and concatenate them: a second copy) unless return_outputs=False; the step returns the loss,
        # so they are not kept. Kept, they held the logits of every micro-batch to the step's end (for a 128k
        # vocabulary, seq 8192, bf16: 2.1 GB a micro-batch), and, under a split backward, the autograd graph of an
        # output that is a view (torch detaches only the others): the whole last stage's saved tensors
        self._schedule.step(*(args if holds_first else ()), return_outputs=False, **kw)
        self.log.timed(-1, "sync", 0, self._sync_tied)
        self.log.timed(-1, "sync", 1, self._average_replicas)
        return float(torch.stack([x.detach().double() for x in losses]).mean()) if holds_last else None

    def _check_autocast(self) -> None:
        """NOTE [pipeline autocast]: an ambient autocast must be the captured one (or none)."""
        dev = self.device.type
        if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) != self.autocast_dtype:
            raise BuildError(f"pipeline: step under torch.autocast({dev!r}, dtype={torch.get_autocast_dtype(dev)}) "
                             f"but the stages were captured {f'under {self.autocast_dtype}' if self.autocast_dtype else 'without autocast'}"
                             f"; build with build(sch, autocast_dtype=...) and step without an autocast of your own")

    def _average_replicas(self) -> None:
        if self._replica_group is None:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        params = [p for p in self.parameters() if p.requires_grad and id(p) not in self._foreign]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in replica_buckets(params):
            grads = [p.grad for p in bucket]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self._replica_group)
            flat.div_(self._replicas)
            for g, v in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(v)

    def _sync_tied(self) -> None:
        from torch.distributed.tensor import DTensor

        mine = self.param_dict()
        for here, zeros in zip(self._tied_here, self._tied_zeros):  # the same order on every rank of the group
            p = mine.get(here) if here is not None else None
            if p is None:  # ranks that do not hold it only contribute zeros
                dist.all_reduce(zeros(), group=self._group)
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=self._group)  # in place: an FSDP2 gradient's local shard


# schedule name -> torch.distributed.pipelining class
SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                    "looped_bfs": "ScheduleLoopedBFS", "interleaved_zb": "ScheduleInterleavedZeroBubble",
                    "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
def wrap_pipeline(builder) -> PipelineModel | None:
    """The "wrap" build step: split the captured graph (`stages.capture_root`) into stages, wrap this rank's under
    the data parallelism, and hand back the `PipelineModel` that runs them. None without a pipeline."""
    cfg = builder.v.extras.get("pipeline")
    if cfg is None:
        return None
    from torch.distributed.pipelining import schedules as torch_schedules

    gm, names, constants = builder.scratch["_pipeline_graph"]
    cuts = builder.v.extras["pipeline_cuts"]
    stages, loss_gm, stage0_inputs = split_stages(gm, cut_paths=cuts, input_names=names, target=cfg["target"])
    axis = cfg["axis"]
    pp = builder.sizes[axis]
    rank_pp = builder.coords[axis]
    n = len(stages)
    kind = cfg["schedule"]
    local = [i for i in range(n) if stage_rank(kind, i, pp) == rank_pp]
    # parameters read by stages that live on different ranks (tied embeddings), or by two stages of one rank
    holders: dict[int, set[int]] = {}
    readers: dict[int, tuple[str, set[int]]] = {}
    objs: dict[int, nn.Parameter] = {}
    for st in stages:
        for pn, p in st.module.named_parameters():
            holders.setdefault(id(p), set()).add(stage_rank(kind, st.index, pp))
            readers.setdefault(id(p), (pn, set()))[1].add(st.index)
            objs[id(p)] = p
    conflict = split_backward_conflict(kind, pp, list(readers.values()))
    dp = builder.v.data_parallel
    if conflict is None and dp is not None:
        conflict = shared_stage_conflict(kind, pp, list(readers.values()), str(dp)) or fsdp_split_conflict(kind, dp)
    if conflict:
        raise BuildError(f"pipeline: {conflict}")
    tied_ids = sorted((i for i, r in holders.items() if len(r) > 1), key=lambda i: readers[i][0])
    tied = [readers[i][0] for i in tied_ids]
    local_names = {id(p): pn for i in local for pn, p in stages[i].module.named_parameters()}
    tied_here = [local_names.get(i) for i in tied_ids]  # the name a local stage reads it by (lm_head.weight), or None
    model_names = {id(p): pn for pn, p in builder.model.named_parameters()}
    canonical = {pn: model_names.get(i, pn) for i, pn in local_names.items()}
    pp_holders = {model_names.get(i, readers[i][0]): len(r) for i, r in holders.items()}
    modules = [_under_data_parallel(builder, stages[i].module) for i in local]
    replica_group, replicas = None, 1
    if dp is not None and not dp.shard and dp.size(builder.mesh) > 1:
        replicas = dp.size(builder.mesh)
        replica_group = builder.mesh.flat_group(dp.axes)
    group = builder.group(axis)
    device = builder.mesh.device
    log = ActionLog()
    stage_cls = _timed_stage_class()
    pstages = []
    amp = builder.autocast_dtype
    for mod, i in zip(modules, local):
        pstages.append(stage_cls(mod, i, n, device, group=group))
        pstages[-1].log, pstages[-1].autocast_dtype = log, amp
    loss_fn = (_LossFn(loss_gm, log, n - 1, autocast=lambda: _autocast(amp, device)) if loss_gm is not None
               else (lambda out, tgt: out if not isinstance(out, tuple) else out[0]))
    mbs = cfg["n_microbatches"]
    cls = getattr(torch_schedules, SCHEDULE_CLASSES[kind])
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        if len(pstages) != 1:
            raise BuildError(f"pipeline: schedule {kind!r} runs one stage per rank; {n} stages on {pp} ranks need "
                             f"'interleaved_1f1b'")
        sched = cls(pstages[0], mbs, loss_fn=loss_fn, scale_grads=cfg["scale_grads"])
    else:
        try:
            sched = cls(pstages, mbs, loss_fn=loss_fn, scale_grads=cfg["scale_grads"])
        except (ValueError, RuntimeError) as exc:
            raise BuildError(f"pipeline: {SCHEDULE_CLASSES[kind]} with {n} stages on {pp} ranks and {mbs} "
                             f"micro-batches: {exc}") from exc
    coords = dict(builder.coords)
    coords[axis] = stage_rank(kind, n - 1, pp)
    last_global = _rank_of(builder, coords)
    logger.info("pipeline: %d stages on %s=%d (%s, %d micro-batches), local stages %s, tied %s, data parallel %s", n,
                axis, pp, kind, mbs, local, tied, dp)
    return PipelineModel(stages, local, modules, sched, group=group, stage0_inputs=stage0_inputs, target=cfg["target"],
                         constants=constants, tied=tied, tied_here=tied_here, last_rank=last_global, n_stages=n,
                         tied_zeros=[_zero_share(builder, objs[i]) for i in tied_ids], replica_group=replica_group,
                         replicas=replicas, axis=axis, canonical=canonical, pp_holders=pp_holders, log=log,
                         loss_fn=loss_fn, schedule_kind=kind, n_microbatches=mbs, autocast_dtype=amp, device=device,
                         rows=builder.scratch.get("_pipeline_rows"), foreign=_foreign_ids(builder))


def _foreign_ids(builder) -> frozenset[int]:
    """Ids of the parameters another form reduces itself (`treadle.forms.data.facts.foreign_params`: the local
    experts, NOTE [expert gradients]), which the replicas' average leaves alone."""
    from ..data.facts import foreign_params

    names = foreign_params(builder.model, builder.v)
    return frozenset(id(p) for n, p in builder.model.named_parameters(remove_duplicate=False) if n in names)


def replica_buckets(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The buckets a pipeline's replicas average their gradients in after the step (`PipelineModel`; the price
    charges the same): one dtype each, in reverse parameter order, closed once at least DDP's bucket size (25
    MiB). No small first bucket: nothing overlaps this all-reduce, so fewer, larger messages are cheaper."""
    from ..data.facts import DDP_BUCKET_BYTES, ddp_buckets

    ready = list(reversed(params))
    by = {str(i): p for i, p in enumerate(ready)}
    names = ddp_buckets([(k, p.numel() * p.element_size(), str(p.dtype)) for k, p in by.items()],
                        first_bucket_bytes=DDP_BUCKET_BYTES)
    return [[by[k] for k in b] for b in names]


def _under_data_parallel(builder, module: fx.GraphModule) -> nn.Module:
    """A stage under the schedule's FSDP2 / HSDP: its units are the model's units inside this stage. Unchanged
    without sharded data parallelism (the replicas of ``shard=False`` average after the step)."""
    if builder.v.data_parallel is None or not builder.v.data_parallel.shard:
        builder.materialize(within=module)  # NOTE [late materialisation]
        return module
    from ..data.facts import fsdp_units
    from ..data.runtime import wrap_module

    inside = {n for n, _ in module.named_modules() if n}
    units = [u for u in fsdp_units(builder.model)[:-1] if u in inside]
    wrapped = wrap_module(builder, module, units)
    return module if wrapped is None else wrapped


def _zero_share(builder, p: nn.Parameter):
    """() -> the zeros a rank holding no stage that reads tied `p` adds to its gradient's sum over pp: the shape
    of the rank's piece (its FSDP2 chunk of the tensor-parallel shard under data parallelism with shard=True)."""
    dp = builder.v.data_parallel
    shape = tuple(p.shape)
    if dp is not None and dp.shard:
        parts, i = 1, 0
        for a in dp.shard_axes:
            parts, i = parts * builder.sizes[a], i * builder.sizes[a] + builder.coords[a]
        chunks = torch.empty(shape, device="meta").chunk(parts, 0)
        shape = tuple(chunks[i].shape) if i < len(chunks) else (0,) + shape[1:]
    return lambda: torch.zeros(shape, dtype=p.dtype, device=builder.mesh.device)


def _rank_of(builder, coords: dict[str, int]) -> int:
    mesh = builder.sch.mesh
    for r in range(mesh.world_size):
        if mesh.coordinate(r) == coords:
            return r
    raise BuildError(f"pipeline: no rank at mesh coordinate {coords}")


