"""`price(sch, example_inputs, cluster)`: predicted step time, peak memory and MFU of ANY schedule.

How (NOTE [pricing by rehearsal]): the schedule is replayed on a copy of its model and built by
`treadle.build` for rank 0 of its mesh on an in-process *fake* process group (collectives return at once,
nothing is sent), so what is priced is exactly what the runtime would run — hand-written primitives
(``sync``, ``shard_attr``, ``set_attr``, ``blocks=3``, the vocab-parallel loss), the Megatron recipes and
planner output alike. One training step of that rank's model then runs on fake tensors under the
profiler's recorder (`treadle.profile.recorder`): every ATen op with its module and phase (forward,
backward, recompute) is priced by the roofline of the rank's device, autograd's saved tensors are
counted by ``saved_tensors_hooks`` (the profiler's figure: one source of truth), and every collective
the built model issues (tensor parallel, sequence parallel, vocab-parallel loss, ``reduce_grads``) is
seen as a ``c10d`` op with its process group (hence its mesh axis) and bytes, priced by the alpha-beta
formulas of `treadle.cost.collective_cost` and placed on the critical path; one issued soon after the
previous blocking collective pays less of its link's measured drift (NOTE [lead-dependent skew]).

Data parallelism is not run but priced the way the runtime executes it (NOTE [overlap model] in
`treadle.cost.overlap`): DDP reduces gradient buckets (`ddp_buckets`) as soon as their last gradient
is ready, overlapped with the backward still to run; FSDP2 (``data_parallel(shard=True)``: one unit per
entry of every ``nn.ModuleList`` plus the root) all-gathers a unit's parameters one unit ahead in forward
and in backward (prefetch) and reduce-scatters its gradients when its backward ends; the root is gathered
once and not again in backward (FSDP2 keeps the root unsharded after forward); the local copies FSDP2
makes around each collective (2 (full + shard) bytes) are compute where the collective is used.
Data parallelism over several axes runs on one flattened process group, priced on the slowest link of its
axes (`treadle.cost.collective_cost.flat_link`); HSDP all-reduces each reduce-scattered shard over the
replicate axes once its reduce-scatter ends; ``reshard_after_forward=False`` drops the backward gathers
and keeps every unit gathered from forward to backward.

The step ends with the optimizer (AdamW: elementwise over the local parameters, priced by the roofline),
after every gradient reduction. Each op also costs the device's fixed `op_overhead_s` (dispatch), and the
framework's host costs are charged where the runtime pays them (NOTE [framework overheads] in
`treadle.profile.hardware`): a recomputed op `checkpoint_op_s` and a checkpointed region
`checkpoint_region_s`; an FSDP2 unit ``fsdp_unit_s + n_params * fsdp_param_s`` per step (half at its
forward, half at its backward); the optimizer's ops ``10 n_tensors`` (per-tensor loop, CPU) or
``12 + 2 n_tensors`` (foreach, GPU) times `op_overhead_s`, plus `subclass_op_overhead_s` per op (loop) or per
list op (foreach) on FSDP2's DTensor parameters.

For a GPU device attention with dropout is rehearsed as the fused kernel a GPU runs (NOTE [attention as a GPU
runs it] in `treadle.profile.fused_attention`); a CPU device keeps PyTorch's CPU kernels.
Data-dependent scalars (``.item()``) read as 1 on fake tensors: pricing needs shapes, not values.
Pipelines (``pipeline``) are not priced (PlanError). `price` cannot run inside a launched process group
(it needs its own fake one): call it before ``init_process_group`` or in another process.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from ..cost import collective_cost as cc
from ..cost.cluster import ClusterSpec, RankDevice
from ..cost.overlap import Collective, Segment, Timeline, ddp_buckets, simulate
from ..errors import PlanError, ProfileError
from ..mesh import Mesh
from ..profile.fused_attention import GpuAttention, attach_in_recompute
from ..profile.memory import buffer_bytes
from ..loss import default_loss
from ..profile.profiler import fake_step_recorder
from ..profile.recorder import Dispatch, StepRecorder, _tensors
from ..profile.roofline import mfu as mfu_of
from ..profile.roofline import op_time_s

logger = logging.getLogger(__name__)

# torch.optim.AdamW (no amsgrad) per element: ~12 FLOPs (two moment updates, bias corrections, sqrt, division,
# decoupled weight decay). Dispatched ops per step (counted in PyTorch 2.13): the per-tensor loop (PyTorch's
# default on CPU) ~10 per parameter tensor; the foreach form (default for CUDA tensors) ~12 multi-tensor ops
# plus ~2 per parameter tensor (step counters).
_ADAMW_FLOPS_PER_ELEM = 12
_ADAMW_OPS = 10
_ADAMW_FOREACH_OPS = 12
_ADAMW_FOREACH_OPS_PER_PARAM = 2
# the fused kernel (NOTE [fused optimizer] in treadle.runtime.optimizer): the step counters' foreach add and
# `_fused_adamw_` over the list, which loops over the tensors in C++ (measured on one core: ~8 us per tensor,
# ~one dispatch's worth)
_ADAMW_FUSED_OPS = 2
_ADAMW_FUSED_OPS_PER_PARAM = 1


# NOTE [AdamW traffic]: torch.optim.AdamW (PyTorch 2.13, no amsgrad, not `fused`) makes eight elementwise
# passes over every parameter element, in the loop form and the foreach form alike; each pass reads and writes
# memory of its own (p: a parameter's or gradient's element size, s: one moment's):
#     p.mul_(1 - lr * wd)                 read p, write p         2p
#     m.lerp_(g, 1 - beta1)               read m, g, write m      2s + p
#     v.mul_(beta2)                       read v, write v         2s
#     v.addcmul_(g, g, 1 - beta2)         read v, g, write v      2s + p
#     d = v.sqrt()                        read v, write d         2s
#     d.div_(bias_correction2 ** 0.5)     read d, write d         2s
#     d.add_(eps)                         read d, write d         2s
#     p.addcdiv_(m, d, -step_size)        read p, m, d, write p   2p + 2s
# = 6p + 14s bytes per element: 80 B for fp32 parameters and moments, ~2.9x the 28 B of one fused pass (read
# p, g, m, v; write p, m, v). Measured on one core (GPT-2 of the benches, 0.96 M parameters): 5.9-8.4 ms per
# step in the foreach form, priced 3.6-3.8 ms with 28 B and ~8.5 ms with 80 B. The runtime now runs the fused
# kernel wherever it can (NOTE [fused optimizer]; 1.8-3.3 ms), and `HardwareSpec.optimizer_fused` says which
# form the price charges.
# The fused kernel makes one pass: read p, g, m, v; write p, m, v = 3p + 4s (28 B in fp32).
def adamw_bytes_per_elem(param_itemsize: int, optimizer_bytes_per_elem: int, fused: bool = False) -> float:
    """Bytes AdamW's step moves per parameter element (NOTE [AdamW traffic]): one pass when `fused`, eight
    otherwise; `optimizer_bytes_per_elem` is both moments' (8 for fp32 AdamW)."""
    if fused:
        return 3 * param_itemsize + 4 * optimizer_bytes_per_elem / 2
    return 6 * param_itemsize + 14 * optimizer_bytes_per_elem / 2


def adamw_ops(n_tensors: int, foreach: bool, fused: bool = False) -> tuple[int, int]:
    """(dispatched ops, of which on whole lists) of one AdamW step over `n_tensors` parameter tensors: a DTensor
    parameter pays `subclass_op_overhead_s` once per op of the loop, or once per list op in the foreach and
    fused forms."""
    if fused:
        return _ADAMW_FUSED_OPS + _ADAMW_FUSED_OPS_PER_PARAM * n_tensors, _ADAMW_FUSED_OPS
    if foreach:
        return _ADAMW_FOREACH_OPS + _ADAMW_FOREACH_OPS_PER_PARAM * n_tensors, _ADAMW_FOREACH_OPS
    return _ADAMW_OPS * n_tensors, _ADAMW_OPS * n_tensors

_PHASE = {"forward": "fwd", "backward": "bwd", "recompute": "recompute"}
# c10d op name -> (collective kind, how its bytes are read: "sum" of a tensor list, "out" first tensor, "in" 2nd)
_C10D = {"allreduce_": ("all_reduce", "list"), "allreduce_coalesced_": ("all_reduce", "list"),
         "_allgather_base_": ("all_gather", "first"), "allgather_into_tensor_coalesced_": ("all_gather", "first"),
         "allgather_": ("all_gather", "nested"), "_reduce_scatter_base_": ("reduce_scatter", "second"),
         "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "second"),
         "reduce_scatter_": ("reduce_scatter", "nested"), "alltoall_base_": ("all_to_all", "second"),
         "alltoall_": ("all_to_all", "list"), "broadcast_": ("broadcast", "list")}


@dataclass(slots=True)
class PriceRow:
    """One module in one phase: `module` path ("" the root), `phase` "fwd" / "bwd" / "recompute",
    compute seconds of the module's own ops, and communication issued there:
    ``comm_s[axis][kind]`` seconds (kind "all_reduce", "all_gather", ...; `source` tells tp / ddp / fsdp
    in `Price.collectives`), of which `exposed_comm_s` delayed compute; `saved_bytes` kept for backward."""

    module: str
    phase: str
    compute_s: float = 0.0
    comm_s: dict[str, dict[str, float]] = field(default_factory=dict)
    exposed_comm_s: float = 0.0
    saved_bytes: int = 0


@dataclass(slots=True)
class Price:
    """The price of one schedule on one cluster, per device (rank 0). Seconds, bytes, MFU in 0..1.

    Time: ``step_s = compute_s + recompute_s + exposed_comm_s``; `comm_s` is all communication and
    ``overlapped_comm_s = comm_s - exposed_comm_s`` the part hidden behind compute (NOTE [overlap model]).
    Memory: ``peak_bytes = static_bytes + activation_bytes + transient_bytes`` where static are parameters,
    optimizer state, buffers, inputs and DDP's bucket copies; activation the bytes autograd saves in
    forward (``saved_tensors_hooks``, storages once); transient the rest of the recorded peak (gradients
    as they appear, temporaries, a recomputed block, FSDP2's gathered units). `grad_bytes` are the local
    gradients. `device` says how the compute rate was derived.

    Breakdown for timelines: `rows` (per module and phase, see PriceRow); `segments` — the step's compute
    in order, dicts {module, phase, start_s, compute_s, flops, bytes (read + written), ops} (the last
    three None for the optimizer segment); `collectives` — dicts {kind, axis, nbytes,
    time_s, module, phase, source ("tp", "ddp", "fsdp"), blocking, start_s, end_s, exposed_s}, so a
    timeline can draw compute and each axis's channel on one time axis.
    """

    step_s: float
    compute_s: float
    recompute_s: float
    comm_s: float
    exposed_comm_s: float
    overlapped_comm_s: float
    peak_bytes: float
    static_bytes: float
    activation_bytes: float
    transient_bytes: float
    grad_bytes: float
    mfu: float
    model_flops: float
    device: RankDevice
    data_parallel: str
    rows: list[PriceRow]
    segments: list[dict]
    collectives: list[dict]

    def estimate(self):
        """The planner's `Estimate` of this price (comm = exposed communication)."""
        from .plan import Estimate

        return Estimate(self.step_s, self.peak_bytes, self.mfu, self.compute_s, self.exposed_comm_s,
                        self.recompute_s, self.static_bytes, self.activation_bytes, self.transient_bytes)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (f"step {self.step_s * 1e3:.3f} ms (compute {self.compute_s * 1e3:.3f}, recompute "
                f"{self.recompute_s * 1e3:.3f}, comm {self.comm_s * 1e3:.3f} of which exposed "
                f"{self.exposed_comm_s * 1e3:.3f}), peak {self.peak_bytes / 2**20:.2f} MiB (static "
                f"{self.static_bytes / 2**20:.2f}, activations {self.activation_bytes / 2**20:.2f}, transient "
                f"{self.transient_bytes / 2**20:.2f}), MFU {self.mfu * 100:.2f}% on {self.device.name}")


# ----------------------------------------------------------------------------------------------- rehearsal
class _PriceDispatch(Dispatch):
    """The profiler's dispatch, plus: c10d collectives noted (not priced as ops) and `.item()` read as 1."""

    def __init__(self, recorder: StepRecorder, axis_of_group: dict[str, str]) -> None:
        super().__init__(recorder)
        self.axis_of_group = axis_of_group
        self.collectives: list[tuple[int, str, str, str, str, float]] = []  # (n records, module, phase, kind, axis, bytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        ns = getattr(func, "namespace", "")
        if ns == "c10d" and not self.recorder.paused:
            self._note(func, args)
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _note(self, func: Any, args: tuple) -> None:
        name = func._overloadpacket.__name__
        if name not in _C10D:
            raise PlanError(f"price: the built model issues collective c10d.{name}, which has no cost formula; "
                            f"known: {sorted(_C10D)}")
        kind, how = _C10D[name]
        group = None
        for a in args:
            if isinstance(a, torch.ScriptObject):
                try:
                    group = dist.ProcessGroup.unbox(a)
                    break
                except RuntimeError:
                    continue
        axis = self.axis_of_group.get(group.group_name if group is not None else "", None)
        if axis is None:
            raise PlanError(f"price: a {kind} runs on a process group that is no single mesh axis")
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        nested = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], (list, tuple))]
        if how == "list":
            nbytes = sum(t.numel() * t.element_size() for t in lists[0])
        elif how == "first":
            nbytes = tensors[0].numel() * tensors[0].element_size()
        elif how == "second":
            nbytes = tensors[1].numel() * tensors[1].element_size()
        else:
            nbytes = sum(t.numel() * t.element_size() for t in nested[0][0])
        module, phase = self.recorder.where()
        self.collectives.append((len(self.recorder.records), module, phase, kind, axis, float(nbytes)))


def _split_batch(inputs: dict, dp: int) -> dict:
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and dp > 1:
            if v.shape[0] % dp:
                raise PlanError(f"price: input {k!r} has batch {v.shape[0]}, not divisible by the data-parallel "
                                f"axis of size {dp}; use a batch divisible by {dp}")
            v = v[: v.shape[0] // dp]
        out[k] = v
    return out


@dataclass(slots=True)
class _Rehearsal:
    records: list
    collectives: list
    model: nn.Module
    saved_input_bytes: int
    mesh: Mesh
    data_parallel: Any  # treadle.schedule.data_parallel.DataParallel | None
    inputs: dict
    checkpoints: tuple[str, ...] = ()  # checkpointed module paths, deepest first


def _rehearse(sch, example_inputs: dict, hw, loss_fn, *, gpu: bool = False) -> _Rehearsal:
    from ..runtime.build import build
    from ..schedule.core import load_schedule

    if dist.is_available() and dist.is_initialized():
        raise PlanError("price: torch.distributed is already initialised in this process; price a schedule "
                        "before init_process_group (it builds rank 0 on its own fake process group)")
    if any(r.op in ("pipeline", "cut_pipeline_stage") for r in sch._state.records):
        raise PlanError("price: pipeline schedules are not priced (pipeline / cut_pipeline_stage in the log)")
    if sch._state.built:
        raise PlanError("price: this schedule was already built; price an unbuilt schedule")
    original = sch._state.original if sch._state.original is not None else sch._state.model
    try:
        text = sch.to_json()
    except Exception as exc:  # a primitive argument that is no data (a lambda): the log cannot be replayed
        raise PlanError(f"price: the schedule cannot be replayed from its log ({exc})") from exc
    from torch.testing._internal.distributed.fake_pg import FakeStore

    mesh0 = sch.mesh
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=mesh0.world_size)
    try:
        model = copy.deepcopy(original)
        mesh = Mesh(mesh0.shape, mesh0.names)
        sch2 = load_schedule(model, text, mesh)
        dp = sch2._state.data_parallel
        sch2._state.data_parallel = None  # priced, not run (module doc)
        built = build(sch2)
        axis_of_group = {mesh.group(a).group_name: a for a in mesh.names}
        inputs = _split_batch(dict(example_inputs), dp.size(mesh) if dp else 1)
        records, coll, saved_in = _record(built, inputs, hw, loss_fn, axis_of_group, gpu=gpu)
    finally:
        dist.destroy_process_group()
    ckpts = tuple(sorted(sch2._state.checkpoints, key=lambda p: -p.count(".")))
    return _Rehearsal(records, coll, built, saved_in, mesh, dp, inputs, ckpts)


def _record(model: nn.Module, inputs: dict, hw, loss_fn, axis_of_group, gpu: bool = False):
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    state, args, kwargs, rec, named = fake_step_recorder(model, (), inputs, fake_mode=fake_mode, hw=hw)
    mode = _PriceDispatch(rec, axis_of_group)
    handles = rec.attach(named)
    attention = GpuAttention() if gpu else contextlib.nullcontext()  # NOTE [attention as a GPU runs it]
    if gpu:  # and in what a checkpoint recomputes
        handles += attach_in_recompute(named, lambda: rec.in_backward)
    try:
        with _reparametrize_module(model, state, tie_weights=True), attention, fake_mode, mode, \
                torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack), torch.enable_grad():
            out = model(*args, **kwargs)
            loss = (loss_fn or default_loss)(out)
            del out
            rec.start_backward()
            loss.backward()
            del loss
    except (PlanError, ProfileError):
        raise
    except Exception as exc:  # an op error inside autograd comes back wrapped
        err = rec.error
        raise PlanError(f"price: the rehearsed step failed: {err or f'{type(exc).__name__}: {exc}'}") from exc
    finally:
        for h in handles:
            h.remove()
    return rec.records, mode.collectives, rec.saved_input_bytes


# ----------------------------------------------------------------------------------------------- pricing
def _segments(records, op_overhead_s: float = 0.0, checkpoint_op_s: float = 0.0,
              checkpoint_region_s: float = 0.0, regions: tuple[str, ...] = ()) -> tuple[list[Segment], list[int]]:
    """Consecutive records of one (module, phase) merged, each op its roofline time plus the device's
    per-op overhead (a recomputed op also `checkpoint_op_s`, and each checkpointed region of `regions` (module
    paths) `checkpoint_region_s` once, at its first recomputed op: NOTE [framework overheads]); returns
    segments and, per record, its segment."""
    segs: list[Segment] = []
    seg_of: list[int] = []
    acc = 0.0
    key = None
    seen: set[str] = set()
    for r in records:
        k = (r.module, _PHASE.get(r.phase, r.phase))
        if k != key:
            if key is not None:
                segs.append(Segment(key[0], key[1], acc))
            key, acc = k, 0.0
        acc += r.time_s + op_overhead_s
        if r.phase == "recompute":
            acc += checkpoint_op_s
            region = next((p for p in regions if _within(r.module, p)), None)
            if region is not None and region not in seen:
                seen.add(region)
                acc += checkpoint_region_s
        seg_of.append(len(segs))
    if key is not None:
        segs.append(Segment(key[0], key[1], acc))
    return segs, seg_of


def _coll_time_s(kind: str, nbytes: float, n: int, link) -> float:
    if n <= 1:
        return 0.0
    fn = {"all_reduce": cc.all_reduce_time_s, "all_gather": cc.all_gather_time_s,
          "reduce_scatter": cc.reduce_scatter_time_s, "all_to_all": cc.all_to_all_time_s,
          "broadcast": cc.broadcast_time_s}[kind]
    return fn(nbytes, n, link)


def _within(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _local_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _dp_link(cluster: ClusterSpec, axes: tuple[str, ...]):
    """The link of the flattened group of `axes` (one process group over all of them): the measured one, or
    the slowest hop (`ClusterSpec.group_link`)."""
    return cluster.group_link(axes)


def _ddp(reh: _Rehearsal, segs: list[Segment], cluster: ClusterSpec) -> list[Collective]:
    """DDP's bucketed all-reduces over the flattened group of every data-parallel axis (prod of their sizes
    ranks, `_dp_link`), each issued when the bucket's last gradient is ready."""
    dp = reh.data_parallel
    axis, n, link = dp.label(), dp.size(reh.mesh), _dp_link(cluster, dp.axes)
    bwd_last: dict[str, int] = {}
    for i, s in enumerate(segs):
        if s.phase == "bwd":
            bwd_last[s.module] = i
    last_bwd = max(bwd_last.values(), default=len(segs) - 1)
    grads = []
    for order, (name, p) in enumerate(reversed(_local_params(reh.model))):
        owner = name.rpartition(".")[0]
        ready = bwd_last.get(owner, last_bwd)
        grads.append((ready, order, name, p.numel() * p.element_size(), str(p.dtype)))
    grads.sort()
    ready_of = {g[2]: g[0] for g in grads}
    size_of = {g[2]: g[3] for g in grads}
    out = []
    for bucket in ddp_buckets([(g[2], g[3], g[4]) for g in grads]):
        nbytes = sum(size_of[x] for x in bucket)
        after = max(ready_of[x] for x in bucket)
        out.append(Collective("all_reduce", axis, nbytes, _coll_time_s("all_reduce", nbytes, n, link),
                              segs[after].module, "bwd", after, blocking=False, needed_before=None, source="ddp",
                              link=link))
    cast = buffer_bytes(reh.model)  # NOTE [DDP buffers]: every buffer, before the forward's first op, waited on
    if cast:
        first = next((i for i, s in enumerate(segs) if s.phase == "fwd"), 0)
        out.append(Collective("broadcast", axis, cast, _coll_time_s("broadcast", cast, n, link),
                              segs[first].module if segs else "", "fwd", first - 1, blocking=True, source="ddp",
                              link=link))
    return out


# NOTE [DDP buffers]: DistributedDataParallel (broadcast_buffers=True, as `build` makes it) broadcasts the
# module's buffers from rank 0 at the start of every forward — one coalesced broadcast over the data-parallel
# group, on the critical path (the forward needs them). A model with buffers (LLaMA's rotary `inv_freq`, a
# BatchNorm's running statistics) pays one collective's latency per step; one without (GPT-2) pays nothing.
# `treadle.price` (`_ddp`) and the planner's cost graph (`CostGraph.dp_buffer_s`) both charge it, for the bytes
# of `treadle.profile.memory.buffer_bytes`.


def fsdp_units(model: nn.Module) -> list[str]:
    """FSDP2 units as `build` wraps them: every entry of every ModuleList, then the root ("")."""
    units = []
    for path, m in model.named_modules():
        if isinstance(m, nn.ModuleList):
            units += [f"{path}.{i}" if path else str(i) for i in range(len(m))]
    return units + [""]


def fsdp_param_units(model: nn.Module, units: list[str] | None = None) -> list[str]:
    """The FSDP2 unit (of `fsdp_units`) of each trainable parameter, in `named_parameters` order: the first unit
    holding its module (the root "" comes last)."""
    units = fsdp_units(model) if units is None else units
    return [next(u for u in units if _within(name.rpartition(".")[0], u)) for name, _ in _local_params(model)]


def _fsdp(reh: _Rehearsal, segs: list[Segment], cluster: ClusterSpec) -> tuple[list[Collective], float]:
    """FSDP2's gathers and reduce-scatters (module doc); returns them and the gathered-buffer bytes at peak.

    Gathers and reduce-scatters run over the flattened group of the shard axes (n = prod of their sizes,
    `_dp_link`). HSDP adds, per unit, an all-reduce of the reduced shard (unit bytes / n) over the
    replicate axes, after its reduce-scatter. ``reshard_after_forward=False``: no backward gathers, and every
    unit stays gathered from its forward to its backward (gathered bytes at peak: all units)."""
    dp = reh.data_parallel
    axis, n, link = ",".join(dp.shard_axes), dp.shard_size(reh.mesh), _dp_link(cluster, dp.shard_axes)
    rep_axes = dp.replicate_axes
    units = fsdp_units(reh.model)
    unit_bytes: dict[str, float] = {u: 0.0 for u in units}
    unit_params: dict[str, int] = {u: 0 for u in units}
    for (name, p), unit in zip(_local_params(reh.model), fsdp_param_units(reh.model, units)):
        unit_bytes[unit] += p.numel() * p.element_size()
        unit_params[unit] += 1

    def unit_of(module: str) -> str:
        return next(u for u in units if _within(module, u))

    first_fwd: dict[str, int] = {}
    first_bwd: dict[str, int] = {}
    last_bwd: dict[str, int] = {}
    for i, s in enumerate(segs):
        u = unit_of(s.module)
        if s.phase == "fwd":
            first_fwd.setdefault(u, i)
        elif s.phase in ("bwd", "recompute"):
            first_bwd.setdefault(u, i)
            last_bwd[u] = i
    end_fwd = max((i for i, s in enumerate(segs) if s.phase == "fwd"), default=-1)
    out: list[Collective] = []
    fwd_order = sorted((u for u in first_fwd if u and unit_bytes[u]), key=first_fwd.get)
    if unit_bytes[""]:
        out.append(Collective("all_gather", axis, unit_bytes[""], _coll_time_s("all_gather", unit_bytes[""], n, link),
                              "", "fwd", -1, blocking=False, needed_before=0, source="fsdp", link=link))
    prev_start = 0
    for u in fwd_order:  # gathered one unit ahead: issued when the previous unit starts
        need = first_fwd[u]
        issue = min(prev_start, need) - 1
        out.append(Collective("all_gather", axis, unit_bytes[u], _coll_time_s("all_gather", unit_bytes[u], n, link),
                              u, "fwd", issue, blocking=False, needed_before=need, source="fsdp", link=link))
        prev_start = need
    bwd_order = sorted((u for u in first_bwd if u and unit_bytes[u] and dp.reshard_after_forward),
                       key=first_bwd.get)
    prev_start = end_fwd + 1
    for u in bwd_order:
        need = first_bwd[u]
        issue = min(prev_start, need) - 1
        out.append(Collective("all_gather", axis, unit_bytes[u], _coll_time_s("all_gather", unit_bytes[u], n, link),
                              u, "bwd", issue, blocking=False, needed_before=need, source="fsdp", link=link))
        prev_start = need
    for u in units:
        if not unit_bytes[u]:
            continue
        after = last_bwd.get(u, len(segs) - 1)
        rs = Collective("reduce_scatter", axis, unit_bytes[u], _coll_time_s("reduce_scatter", unit_bytes[u], n, link),
                        u or "", "bwd", after, blocking=False, needed_before=None, source="fsdp", link=link)
        out.append(rs)
        if rep_axes:
            shard_bytes = unit_bytes[u] / n
            t = _coll_time_s("all_reduce", shard_bytes, dp.replicate_size(reh.mesh), _dp_link(cluster, rep_axes))
            out.append(Collective("all_reduce", ",".join(rep_axes), shard_bytes, t, u or "", "bwd", after,
                                  blocking=False, needed_before=None, source="fsdp", follows=rs,
                                  link=_dp_link(cluster, rep_axes)))
    if dp.reshard_after_forward:
        gathered = unit_bytes[""] + 2 * max((unit_bytes[u] for u in units if u), default=0.0)
    else:
        gathered = sum(unit_bytes.values())
    # FSDP2's hooks per unit per step (NOTE [framework overheads]): half where its forward starts, half where
    # its backward starts
    hw = cluster.rank_hardware()
    for u in units:
        if not unit_bytes[u]:
            continue
        host_s = hw.fsdp_unit_s + unit_params[u] * hw.fsdp_param_s
        for where in (first_fwd.get(u), first_bwd.get(u)):
            if where is not None:
                segs[where] = dataclasses.replace(segs[where], compute_s=segs[where].compute_s + host_s / 2)
    # FSDP2's copies around each collective (copy-in of the shard / gradient, copy-out of the gathered
    # parameter / reduced shard): 2 (full + shard) bytes moved, on the compute stream where it runs
    for c in out:
        if c.kind == "all_reduce":  # HSDP's all-reduce works on the reduce-scatter's output in place
            continue
        where = c.needed_before if c.kind == "all_gather" else c.issue_after
        if where is not None and 0 <= where < len(segs):
            cp = op_time_s(0, int(2 * (c.nbytes + c.nbytes / n)), hw, torch.float32)
            segs[where] = dataclasses.replace(segs[where], compute_s=segs[where].compute_s + cp)
    return out, gathered


def price(sch, example_inputs: dict, cluster: ClusterSpec, *, optimizer_bytes_per_elem: int = 8,
          master_copy: bool = True, loss_fn=None) -> Price:
    """Price one training step of `sch` (an unbuilt Schedule) on `cluster` (see the module doc).

    `example_inputs`: keyword arguments of forward, global batch (the data-parallel axis splits dim 0).
    `optimizer_bytes_per_elem` (AdamW: 8) and `master_copy` (fp32 copy of lower-precision parameters)
    as in the planner's `TrainSpec`. `loss_fn(output)` defaults to the output's ``.loss``.
    `cluster` is seen through the schedule's mesh (`ClusterSpec.for_mesh`: same world size).
    Raises PlanError for a schedule that cannot be rehearsed (pipeline, already built, a batch the
    data-parallel axis does not divide, a mesh mismatch, inside a running process group).
    """
    if not isinstance(example_inputs, dict):
        raise PlanError("price: example_inputs must be a dict of keyword arguments of forward")
    if cluster.world_size != sch.mesh.world_size:
        raise PlanError(f"price: the schedule is written for {sch.mesh} ({sch.mesh.world_size} ranks) but the "
                        f"cluster has {cluster.world_size} ranks ({cluster.mesh}); give a cluster of that size")
    cluster = cluster.for_mesh(sch.mesh)
    device = cluster.rank_device()
    hw = cluster.rank_hardware()
    reh = _rehearse(sch, example_inputs, hw, loss_fn, gpu=not cluster.is_cpu())
    segs, seg_of = _segments(reh.records, hw.op_overhead_s, hw.checkpoint_op_s, hw.checkpoint_region_s,
                             reh.checkpoints)
    colls: list[Collective] = []
    for n_before, module, phase, kind, axis, nbytes in reh.collectives:
        after = seg_of[n_before - 1] if n_before > 0 else -1
        t = _coll_time_s(kind, nbytes, reh.mesh.size(axis), cluster.link(axis))
        colls.append(Collective(kind, axis, nbytes, t, module, _PHASE.get(phase, phase), after, source="tp",
                                link=cluster.link(axis)))
    dp_kind, gathered = "none", 0.0
    zero_n = 1  # ranks an FSDP2 shard group spans: parameters, gradients and optimizer state are 1/zero_n
    dp = reh.data_parallel
    if dp is not None and dp.size(reh.mesh) > 1:
        if dp.shard:
            extra, gathered = _fsdp(reh, segs, cluster)
            zero_n = dp.shard_size(reh.mesh)
        else:
            extra = _ddp(reh, segs, cluster)
        dp_kind = str(dp)
        colls += extra
    # the optimizer step: elementwise over the local parameters, one pass fused or eight (NOTE [AdamW traffic])
    n_opt = len(segs)
    opt_s = 0.0
    local = _local_params(reh.model)
    for _, p in local:
        elems = p.numel() / zero_n
        moved = elems * adamw_bytes_per_elem(p.element_size(), optimizer_bytes_per_elem, hw.optimizer_fused)
        opt_s += op_time_s(int(_ADAMW_FLOPS_PER_ELEM * elems), int(moved), hw, p.dtype)
    n_ops, n_list_ops = adamw_ops(len(local), hw.optimizer_foreach, hw.optimizer_fused)
    opt_s += n_ops * hw.op_overhead_s
    if zero_n > 1:  # FSDP2's parameters are DTensors: every optimizer op dispatches through DTensor
        opt_s += n_list_ops * hw.subclass_op_overhead_s
    segs.append(Segment("", "optim", opt_s))
    for c in colls:
        if not c.blocking and c.needed_before is None:
            c.needed_before = n_opt  # gradients are reduced before the optimizer steps
    tl: Timeline = simulate(segs, colls, overlap=device.overlap)
    # ---- memory
    zero = dp is not None and dp.shard and dp_kind != "none"
    param_b = grad_b = opt_b = 0.0
    for _, p in _local_params(reh.model):
        elems = p.numel() / zero_n
        param_b += elems * p.element_size()
        grad_b += elems * p.element_size()
        opt_b += elems * (optimizer_bytes_per_elem + (4 if master_copy and p.dtype != torch.float32 else 0))
    frozen_b = sum(p.numel() * p.element_size() for p in reh.model.parameters() if not p.requires_grad)
    buffer_b = buffer_bytes(reh.model)
    input_b = sum(t.numel() * t.element_size() for t in _tensors(reh.inputs))
    bucket_b = grad_b if dp_kind.startswith("ddp") else 0.0  # DDP's flat bucket buffers hold a copy of the grads
    static = param_b + frozen_b + opt_b + buffer_b + input_b + bucket_b
    saved = float(sum(r.saved_bytes for r in reh.records if r.phase == "forward"))
    peak_live = max((r.live_after_bytes for r in reh.records), default=0)
    if zero:
        peak_live -= grad_b * (zero_n - 1)  # the recorded full gradients are reduce-scattered to 1/zero_n
    transient = max(0.0, peak_live - saved) + gathered
    # ---- time split
    compute = math.fsum(s.compute_s for s in segs if s.phase != "recompute")  # forward, backward, optimizer
    recompute = math.fsum(s.compute_s for s in segs if s.phase == "recompute")
    flops = float(sum(r.flops for r in reh.records if r.phase in ("forward", "backward")))
    dtype = next((p.dtype for p in reh.model.parameters()), torch.float32)
    mfu = mfu_of(int(flops), tl.step_s, hw, dtype) if tl.step_s > 0 else 0.0
    rows = _rows(segs, reh.records, tl)
    seg_flops = [0.0] * len(segs)
    seg_bytes = [0.0] * len(segs)
    seg_ops = [0] * len(segs)
    for r, i in zip(reh.records, seg_of):
        seg_flops[i] += r.flops
        seg_bytes[i] += r.read_bytes + r.write_bytes
        seg_ops[i] += 1
    seg_dicts = [{"module": s.module, "phase": s.phase, "start_s": st, "compute_s": s.compute_s,
                  "flops": seg_flops[i] if i < n_opt else None, "bytes": seg_bytes[i] if i < n_opt else None,
                  "ops": seg_ops[i] if i < n_opt else None}
                 for i, (s, st) in enumerate(zip(segs, tl.segment_start_s))]
    coll_dicts = [{"kind": c.kind, "axis": c.axis, "nbytes": c.nbytes, "time_s": c.time_s, "module": c.module,
                   "phase": c.phase, "source": c.source, "blocking": c.blocking, "start_s": c.start_s,
                   "end_s": c.end_s, "exposed_s": c.exposed_s} for c in tl.collectives]
    out = Price(tl.step_s, compute, recompute, tl.comm_s, tl.exposed_comm_s, tl.overlapped_comm_s,
                static + saved + transient, static, saved, transient, grad_b, mfu, flops, device, dp_kind,
                rows, seg_dicts, coll_dicts)
    logger.info("price %s: %s", sch.mesh, out)
    return out


def _rows(segs: list[Segment], records, tl: Timeline) -> list[PriceRow]:
    rows: dict[tuple[str, str], PriceRow] = {}
    for s in segs:
        r = rows.setdefault((s.module, s.phase), PriceRow(s.module, s.phase))
        r.compute_s += s.compute_s
    for rec in records:
        if rec.phase == "forward" and rec.saved_bytes:
            rows.setdefault((rec.module, "fwd"), PriceRow(rec.module, "fwd")).saved_bytes += rec.saved_bytes
    for c in tl.collectives:
        r = rows.setdefault((c.module, c.phase), PriceRow(c.module, c.phase))
        per = r.comm_s.setdefault(c.axis, {})
        per[c.kind] = per.get(c.kind, 0.0) + c.time_s
        r.exposed_comm_s += c.exposed_s
    return list(rows.values())


__all__ = ["price", "Price", "PriceRow", "RankDevice", "fsdp_units"]
