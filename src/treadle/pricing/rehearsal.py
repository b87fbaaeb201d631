"""Rehearsal: one rank's training step built on a fake process group and recorded on fake tensors, the ground
truth `treadle.pricing` prices (NOTE [pricing by rehearsal] in its module doc)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from ..errors import PlanError, ProfileError
from ..loss import default_loss
from ..mesh import Mesh
from ..profile.blocks import block_container
from ..profile.eager_masks import eager_masks
from ..profile.fake_gaps import copy_model
from ..profile.fake_group import fake_process_group
from ..profile.fused_attention import GpuAttention, attach_in_recompute
from ..profile.profiler import fake_step_recorder
from ..profile.recorder import Dispatch, StepRecorder
from ..schedule.expert_primitive import axes_label, expert_paths
from ..schedule.tree import within
from ..schedule.view import ScheduleView
from .reuse import Shortening, shortened_list, shortening, splice

_PIPELINE_OPS = frozenset({"pipeline", "cut_pipeline_stage"})
# c10d op name -> (collective kind, how its bytes are read: "list" the first tensor list's sum, "first" / "second"
# tensor, "nested" the first list of lists; "larger": the larger of the buffers the rank receives and sends (the first
# two tensors or tensor lists), since an uneven all-to-all ends when its busiest rank has received: NOTE [expert load
# in a rehearsal])
_C10D = {"allreduce_": ("all_reduce", "list"), "allreduce_coalesced_": ("all_reduce", "list"),
         "_allgather_base_": ("all_gather", "first"), "allgather_into_tensor_coalesced_": ("all_gather", "first"),
         "allgather_": ("all_gather", "nested"), "_reduce_scatter_base_": ("reduce_scatter", "second"),
         "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "second"),
         "reduce_scatter_": ("reduce_scatter", "nested"), "alltoall_base_": ("all_to_all", "larger"),
         "alltoall_": ("all_to_all", "larger"), "broadcast_": ("broadcast", "list")}


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
            raise PlanError(f"price: a {kind} runs on a process group that is no single mesh axis (nor an expert "
                            f"group's flattened axes)")
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        nested = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], (list, tuple))]
        if how == "list":
            nbytes = sum(t.numel() * t.element_size() for t in lists[0])
        elif how == "first":
            nbytes = tensors[0].numel() * tensors[0].element_size()
        elif how == "second":
            nbytes = tensors[1].numel() * tensors[1].element_size()
        elif how == "larger":
            bufs = lists[:2] if len(lists) >= 2 else [[t] for t in tensors[:2]]
            nbytes = max(sum(t.numel() * t.element_size() for t in b) for b in bufs)
        else:
            nbytes = sum(t.numel() * t.element_size() for t in nested[0][0])
        module, phase = self.recorder.where()
        self.collectives.append((len(self.recorder.records), module, phase, kind, axis, float(nbytes)))


def split_batch(inputs: dict, dp: int, *, by: str | None = None) -> dict:
    """Rank 0's part of a global batch split in `dp` (dim 0 of every tensor): over the data-parallel replicas,
    or into micro-batches where `by` names what splits it ("n_microbatches=4")."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and dp > 1:
            if v.shape[0] % dp:
                raise PlanError(f"price: input {k!r} has batch {v.shape[0]}, not divisible by "
                                f"{by or f'the data-parallel axis of size {dp}'}; use a batch divisible by {dp}")
            v = v[: v.shape[0] // dp]
        out[k] = v
    return out


@dataclass(slots=True)
class Rehearsal:
    """One rank's step as rehearsed: the profiler's op records, the collectives the built model issued
    ((records before it, module, phase, kind, axis, bytes)), the rank's built model (unwrapped: no
    data-parallel or pipeline wrapper), the bytes of inputs autograd saved, the mesh, what the replayed schedule
    recorded (`view`), this rank's inputs, and the checkpointed module paths, deepest first."""

    records: list
    collectives: list
    model: nn.Module
    saved_input_bytes: int
    mesh: Mesh
    view: ScheduleView
    inputs: dict
    checkpoints: tuple[str, ...] = ()
    output_bytes: dict = field(default_factory=dict)  # watched module path -> bytes its forward returned
    flows: list = field(default_factory=list)  # per record: (reads, writes) storage identities (StepRecorder.flows)
    selective: tuple[str, ...] = ()  # module paths under selective checkpointing's dispatch modes (`sac_regions`)


def rehearse(sch, example_inputs: dict, hw, loss_fn, *, gpu: bool = False, unpipelined: bool = False,
             watch: tuple[str, ...] = (), flows: bool = False) -> Rehearsal:
    """Replay `sch` on a copy of its model, build rank 0 on a fake process group and record one training step
    on fake tensors (module doc of `treadle.pricing`). `unpipelined`: replay the log without its pipeline
    primitives (the pipeline form prices the stages of that one step itself); `watch`: module paths whose
    forward output bytes (every tensor it returns) are kept in `Rehearsal.output_bytes`; `flows`: record the data
    flow between ops (`Rehearsal.flows`, which a compiled step's price needs). Each context of blocks is rehearsed
    once (NOTE [blocks rehearsed once per context]). Raises PlanError for a
    pipeline (unless `unpipelined`), a built schedule, a log that cannot be replayed, a batch the data-parallel
    axes do not divide, or a running process group."""
    from ..runtime.build import build
    from ..schedule.replay import load_schedule

    if dist.is_available() and dist.is_initialized():
        raise PlanError("price: torch.distributed is already initialised in this process; price a schedule "
                        "before init_process_group (it builds rank 0 on its own fake process group)")
    v = sch.view()
    if v.ops() & _PIPELINE_OPS and not unpipelined:
        raise PlanError("price: a pipeline is priced by the pipeline form (treadle.price), not rehearsed whole")
    if v.built:
        raise PlanError("price: this schedule was already built; price an unbuilt schedule")
    original = v.reference
    try:
        text = sch.to_json()
    except Exception as exc:  # a primitive argument that is no data (a lambda): the log cannot be replayed
        raise PlanError(f"price: the schedule cannot be replayed from its log ({exc})") from exc
    if unpipelined:
        doc = json.loads(text)
        doc["records"] = [r for r in doc["records"] if r.get("op") not in _PIPELINE_OPS]
        text = json.dumps(doc)
    mesh0 = sch.mesh
    with fake_process_group(mesh0.world_size):  # NOTE [a fake group leaves no trace]
        model = copy_model(original)  # fake tensors: copied without torch's data_ptr warning
        mesh = Mesh(mesh0.shape, mesh0.names)
        sch2 = load_schedule(model, text, mesh)
        v2 = sch2.view()
        dp = v2.data_parallel
        built = build(sch2, wrap=False)  # data parallelism is priced, not run (module doc)
        axis_of_group = {mesh.group(a).group_name: a for a in mesh.names}
        for axes in expert_paths(v2.extras).values():  # an expert group over several axes: their flattened group
            if len(axes) > 1:
                axis_of_group[mesh.flat_group(axes).group_name] = axes_label(axes)
        inputs = split_batch(dict(example_inputs), dp.size(mesh) if dp else 1)
        regions = v2.checkpoints + selective_regions(v2)
        short = shortening(built, block_container(built), sch2.records, regions)
        if short is not None:
            reh = _rehearse_short(built, inputs, hw, loss_fn, axis_of_group, gpu, sac_regions(v2), watch, short,
                                  flows=flows)
        if short is None or reh is None:
            reh = _rehearse_all(built, inputs, hw, loss_fn, axis_of_group, gpu, sac_regions(v2), watch, flows)
        records, coll, saved_in, flow_list, out_bytes = reh
    ckpts = tuple(sorted(regions, key=lambda p: -p.count(".")))
    # the view as built: its parameter tables follow the parameters build replaced (`Schedule.rebind_param`); the
    # view taken before build keys them by the replaced ones, which a built model's parameters may reuse by chance
    return Rehearsal(records, coll, built, saved_in, mesh, sch2.view(), inputs, ckpts, out_bytes, flow_list,
                     sac_regions(v2))


def _watching(model: nn.Module, paths: tuple[str, ...], out: dict[str, int]) -> list:
    return [model.get_submodule(p).register_forward_hook(_output_bytes(p, out)) for p in paths]


def _rehearse_all(built, inputs, hw, loss_fn, axis_of_group, gpu, sac, watch, flows):
    out_bytes: dict[str, int] = {}
    hooks = _watching(built, watch, out_bytes)
    try:
        rec, coll, _ = _record(built, inputs, hw, loss_fn, axis_of_group, gpu=gpu, sac=sac, flows=flows)
    finally:
        for h in hooks:
            h.remove()
    return rec.records, coll, rec.saved_input_bytes, rec.flows or [], out_bytes


def _rehearse_short(built, inputs, hw, loss_fn, axis_of_group, gpu, sac, watch, short: Shortening, *,
                    flows: bool = False):
    """The step rehearsed with the kept blocks only and spliced (NOTE [blocks rehearsed once per context]), or
    None where it cannot be."""
    kept = [short.path(j) for j in short.kept]
    # a watched path inside a left-out block is watched in the kept block that stands for it
    stand_in = {}
    for p in watch:
        i = next((i for i in range(len(short.keys)) if within(p, short.path(i))), None)
        stand_in[p] = p if i is None else p.replace(short.path(i), short.path(short.kept[short.rep[i]]), 1)
    out_bytes: dict[str, int] = {}
    hooks = _watching(built, tuple(sorted(set(stand_in.values()))), out_bytes)
    try:
        with shortened_list(built, short):
            rec, coll, state = _record(built, inputs, hw, loss_fn, axis_of_group, gpu=gpu, sac=sac, flows=flows)
    finally:
        for h in hooks:
            h.remove()
    for name, t in state.items():  # a block's own buffer saved for backward: charged once per storage
        if id(t.untyped_storage()) in rec.saved and any(within(name, p) for p in kept):
            return None
    owners = {id(t.untyped_storage()): (j, name[len(p):]) for name, t in state.items()
              for j, p in enumerate(kept) if within(name, p)}
    spliced = splice(rec.records, coll, short, rec.live_bytes, rec.frees, flows=rec.flows, owners=owners)
    if spliced is None:
        return None
    records, colls, flow_list = spliced
    return records, colls, rec.saved_input_bytes, flow_list, {p: out_bytes[q] for p, q in stand_in.items()
                                                              if q in out_bytes}


def selective_regions(v: ScheduleView) -> tuple[str, ...]:
    """The module paths of the checkpointed regions selective checkpoints make: the module itself, or for the
    "attention-core" policy the attention core build adds to it (NOTE [checkpoint policies as peers define
    them]): each pays checkpointing's region cost when it is recomputed."""
    from ..runtime.graph_steps import ATTENTION_CORE
    from ..schedule.checkpoint_policies import CHECKPOINT_POLICIES

    out = []
    for path, save in v.extras.get("selective", []):
        calls = isinstance(save, str) and CHECKPOINT_POLICIES[save].how == "attention-calls"
        out.append(".".join(filter(None, (path, ATTENTION_CORE))) if calls else path)
    return tuple(out)


def _output_bytes(path: str, into: dict[str, int]):
    def hook(module, args, output):
        if path not in into:  # the forward, not a recomputation
            into[path] = sum(t.numel() * t.element_size() for t in _tensor_leaves(output))
    return hook


def _tensor_leaves(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensor_leaves(v)]
    if isinstance(x, dict) or hasattr(x, "values"):
        return [t for v in x.values() for t in _tensor_leaves(v)]
    return []


def sac_regions(v: ScheduleView) -> tuple[str, ...]:
    """Module paths that run under selective checkpointing's own cache (a save list, or a policy of how
    "selective"): what it keeps is held outside autograd's saved tensors (NOTE [what SAC keeps])."""
    from ..schedule.checkpoint_policies import CHECKPOINT_POLICIES

    return tuple(p for p, save in v.extras.get("selective", [])
                 if not isinstance(save, str) or CHECKPOINT_POLICIES[save].how == "selective")


def _charge_sac_kept(rec, regions: tuple[str, ...]) -> None:
    """NOTE [what SAC keeps]: selective checkpointing keeps the outputs its policy saves in a cache of its own,
    not through autograd's saved-tensor hooks, so the recorder's pack hook never sees them. At the forward's end
    every storage still alive that an op inside such a region made, and that autograd did not save, is what
    that cache holds until the backward: it is charged as saved, to the op that made it, as autograd's are."""
    if not regions:
        return
    for key, (nbytes, index, _) in list(rec.alive.items()):
        r = rec.records[index]
        if key in rec.saved or r.phase != "forward":
            continue
        if any(within(r.module, p) for p in regions):
            rec.saved.add(key)
            r.saved_bytes += nbytes


def _record(model: nn.Module, inputs: dict, hw, loss_fn, axis_of_group, gpu: bool = False,
            sac: tuple[str, ...] = (), flows: bool = True):
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    state, args, kwargs, rec, named = fake_step_recorder(model, (), inputs, fake_mode=fake_mode, hw=hw)
    rec.flows = [] if flows else None  # the data flow a compiled step's fusion needs (`treadle.pricing.compiled`)
    rec.frees = []  # where each storage's life ends: a splice's check (`reuse.splice`)
    mode = _PriceDispatch(rec, axis_of_group)
    handles = rec.attach(named)
    attention = GpuAttention() if gpu else contextlib.nullcontext()  # NOTE [attention as a GPU runs it]
    if gpu:  # and in what a checkpoint recomputes
        handles += attach_in_recompute(named, lambda: rec.in_backward)
    try:
        with _reparametrize_module(model, state, tie_weights=True), attention, eager_masks(inputs), fake_mode, mode, \
                torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack), torch.enable_grad():
            out = model(*args, **kwargs)
            loss = (loss_fn or default_loss)(out)
            del out
            _charge_sac_kept(rec, sac)
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
    return rec, mode.collectives, state


