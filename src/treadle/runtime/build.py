"""`build(sch)`: turn a recorded schedule into a trainable model on the mesh, once, at the end.

Order (NOTE [record, then build] in treadle.schedule.core): bind the mesh; set attributes; the steps that read
no values (graph rewrites, a pipeline's capture); plan sharded leaves from global shapes; slice every sharded
parameter to its local shard (tied parameters stay one object); install local forwards, sync hooks, derived
gradient reductions, forked RNG streams and checkpoint wrappers; wrap for data parallel (DDP or FSDP2). Meta
parameters get their deterministic values as late as each part allows, each rank only its part (NOTE [late
materialisation]).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..errors import BuildError, ScheduleError
from ..schedule.core import Schedule
from ..schedule.state import ParamShard, SyncSpec
from ..schedule.log import Ref
from ..sharding_rules import LeafPlan, has_leaf_rule, leaf_plan
from . import collectives as C
from .collectives import on_grad
from .convert import _same as _same_placement
from .convert import apply_op, convert, convert_multi
from .leaves import gathered_forward
from .materialize import materialize
from .params import local_slice
from .recompute import checkpointed_forward
from .steps import build_steps, wrap_forward
from .sync_plan import plan_syncs

logger = logging.getLogger(__name__)

ANNOTATIONS_ATTR = "_treadle_annotations"

def annotations(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Tags set by `annotate`, by parameter name, read from a built (or unbuilt) model."""
    inner = getattr(model, "module", model) if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {n: dict(getattr(p, ANNOTATIONS_ATTR)) for n, p in inner.named_parameters(remove_duplicate=False)
            if hasattr(p, ANNOTATIONS_ATTR)}


# ------------------------------------------------------------------------------------------- inputs
def _input_slot(mod: nn.Module, args: tuple, kwargs: dict, arg: int | str, where: str) -> tuple[str, int | str]:
    names = [p.name for p in inspect.signature(mod.forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if isinstance(arg, int):
        if arg < len(args):
            return "pos", arg
        if arg < len(names) and names[arg] in kwargs:
            return "kw", names[arg]
    else:
        if arg in kwargs:
            return "kw", arg
        if arg in names and names.index(arg) < len(args):
            return "pos", names.index(arg)
    raise BuildError(f"{where}: input {arg!r} was not passed to the module (got {len(args)} positional "
                     f"and keywords {sorted(kwargs)})")


def _map_input(mod, args, kwargs, arg, fn, where):
    kind, key = _input_slot(mod, args, kwargs, arg, where)
    x = args[key] if kind == "pos" else kwargs[key]
    if not torch.is_tensor(x):
        raise BuildError(f"{where}: input {arg!r} is a {type(x).__name__}, not a tensor")
    y = fn(x)
    if kind == "pos":
        args = args[:key] + (y,) + args[key + 1 :]
    else:
        kwargs = {**kwargs, key: y}
    return args, kwargs


def _map_output(output: Any, out: int, fn: Callable[[torch.Tensor], torch.Tensor], where: str) -> Any:
    if torch.is_tensor(output):
        if out != 0:
            raise BuildError(f"{where}: the module returns one tensor; out={out} does not exist")
        return fn(output)
    if isinstance(output, (tuple, list)):
        items = list(output)
        if out >= len(items) or not torch.is_tensor(items[out]):
            raise BuildError(f"{where}: out={out}, but the module returns a {type(output).__name__} of "
                             f"{len(items)} items" + ("" if out >= len(items) else f" and item {out} is a "
                                                      f"{type(items[out]).__name__}, not a tensor"))
        items[out] = fn(items[out])
        return type(output)(items) if isinstance(output, list) else tuple(items)
    if isinstance(output, dict):  # HF ModelOutput
        if out >= len(output):
            raise BuildError(f"{where}: out={out}, but the module returns {len(output)} outputs {list(output)}")
        key = list(output.keys())[out]
        output[key] = fn(output[key])
        return output
    raise BuildError(f"{where}: cannot find output {out} in a {type(output).__name__}")


# ------------------------------------------------------------------------------------------- build
class _Builder:
    def __init__(self, sch: Schedule, init_fn: Callable[[nn.Module], None] | None, mp_policy: Any = None,
                 wrap: bool = True, autocast_dtype: torch.dtype | None = None):
        self.sch = sch
        self.mp_policy = mp_policy
        self.autocast_dtype = autocast_dtype
        self.wrap = wrap
        self.v = sch.view()
        # build's own copies of the parameter tables: re-keyed as parameters are replaced (`rebind`)
        self.param_shards: dict[int, tuple[ParamShard, ...]] = dict(self.v.param_shards)
        self.annotations: dict[int, dict[str, Any]] = {k: dict(t) for k, t in self.v.annotations.items()}
        self.scratch: dict[str, Any] = {}  # what one build step hands a later one (a pipeline's captured graph)
        self.keep_meta: set[str] = set()  # modules this rank never runs ("pre_materialize" steps name them)
        self.mesh = sch.mesh.bind()
        self.model = self.v.model
        self.init_fn = init_fn
        self.coords = {ax: self.mesh.local_rank(ax) for ax in self.mesh.names}
        self.sizes = dict(zip(self.mesh.names, self.mesh.shape))
        self.leaf: dict[str, LeafPlan] = {}
        self._shared_f: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}

    def group(self, axis: str):
        return self.mesh.group(axis)

    def module(self, path: str) -> nn.Module:
        try:
            return self.model.get_submodule(path) if path else self.model
        except AttributeError:
            raise BuildError(f"build: module path {path!r} no longer exists (was a parent replaced after "
                             f"primitives were applied to it?)") from None

    # ---------------------------------------------------------------- parameters
    def owners(self) -> dict[int, list[tuple[nn.Module, str, str]]]:
        """id(param) -> every (module, attribute name, module path) that holds it (tied params: several)."""
        out: dict[int, list[tuple[nn.Module, str, str]]] = {}
        for path, m in self.model.named_modules(remove_duplicate=False):
            for name, p in m._parameters.items():
                if p is not None:
                    out.setdefault(id(p), []).append((m, name, path))
        return out

    def rebind(self, old: nn.Parameter, new: nn.Parameter) -> None:
        """`new` replaces parameter `old` in the model: the records of `old` follow it, here and in the schedule."""
        for table in (self.param_shards, self.annotations):
            if id(old) in table:
                table[id(new)] = table.pop(id(old))
        self.sch.rebind_param(old, new)

    def check_params_present(self, owners) -> None:
        for pid in list(self.param_shards) + list(self.annotations):
            if pid not in owners:
                raise BuildError("build: a sharded or annotated parameter is no longer in the model "
                                 "(its module was replaced after the primitive); apply shard/annotate after replace")

    def materialize(self, within: nn.Module | None = None) -> None:
        """Give meta parameters values (NOTE [late materialisation]): those of `within`'s modules (all when None),
        but the modules in `keep_meta` that can stay on meta (NOTE [what stays on meta]); a parameter already
        sliced keeps its shard. The schedule's records follow the new objects. Nothing when none is on meta."""
        if not any(p.is_meta for p in self.model.parameters()):
            return
        keep = set(self.keep_meta)
        if within is not None:
            inside = {id(m) for m in within.modules()}
            keep |= {path for path, m in self.model.named_modules() if id(m) not in inside}
        kept = materialize(self.model, self.init_fn, self.mesh.device, on_new=self.rebind, keep_meta=keep,
                           local=self.local_value)
        if within is None and kept:
            logger.info("build: %d modules this rank never runs stay on the meta device (%s, ...)", len(kept),
                        ", ".join(sorted(kept)[:3]))

    def local_value(self, meta: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        """What sliced meta parameter `meta` keeps of its whole initial value `full`: its shard (`slice_params`)."""
        return local_slice(full, list(self.param_shards[id(meta)]), self.coords, self.sizes)

    def slice_params(self, owners) -> None:
        for pid, shards in list(self.param_shards.items()):
            holders = owners[pid]
            p = holders[0][0]._parameters[holders[0][1]]
            local = local_slice(p.detach(), shards, self.coords, self.sizes).clone().contiguous()
            new = nn.Parameter(local, requires_grad=p.requires_grad)
            new.global_shape = tuple(p.shape)  # Slapo's orig_shape: the whole parameter's shape
            for m, name, _ in holders:
                m._parameters[name] = new
            self.rebind(p, new)  # records follow the live object
            logger.debug("shard %s: %s -> %s", holders[0][2] + "." + holders[0][1], tuple(p.shape), tuple(local.shape))
        owners2 = self.owners()
        for pid, tags in self.annotations.items():
            if pid in owners2:
                m, name, _ = owners2[pid][0]
                setattr(m._parameters[name], ANNOTATIONS_ATTR, dict(tags))

    def plan_leaves(self, owners) -> None:
        by_module: dict[str, dict[str, list[ParamShard]]] = {}
        for pid, shards in self.param_shards.items():
            for m, name, path in owners[pid]:
                by_module.setdefault(path, {})[name] = shards
        ruled = {path for path in by_module if has_leaf_rule(self.module(path))}
        covered = {id(p) for path in ruled for p in self.module(path)._parameters.values() if p is not None}
        for path, shards in by_module.items():
            if path in self.leaf:
                continue  # planned by a form's "pre_shard" step (an expert-parallel experts module)
            m = self.module(path)
            if path not in ruled and all(id(m._parameters[n]) in covered for n in shards):
                # an alias of a parameter that a ruled leaf computes with (e.g. a head's tied bias)
                logger.debug("build: %r holds aliases of sharded parameters %s; computed by their leaf", path,
                             sorted(shards))
                continue
            plan = leaf_plan(path, m, shards)
            if plan.bind is not None:  # a local forward that depends on the rank (a vocab-sharded lookup)
                plan.forward = plan.bind(self)
            if plan.gathered is not None:
                plan.forward = gathered_forward(plan.gathered, self.group)
            self.leaf[path] = plan

    # ---------------------------------------------------------------- hooks
    def syncs_of(self, path: str, mode: str) -> list[SyncSpec]:
        return [s for s in self.v.syncs if s.path == path and s.mode == mode]

    def transform(self, idx: int, spec: SyncSpec, where: str, *,
                  fused_gather: set[str]) -> Callable[[torch.Tensor], torch.Tensor]:
        """The function a sync hook applies: its explicit op, or the conversion from the layout the sync plan
        derived (`self.syncs.src[idx]`) to its target."""
        if spec.op is not None:
            kw = spec.kw()
            if spec.op == "all_gather" and spec.axis in fused_gather:
                kw["grad"] = "reduce_scatter"
            group = self.group(spec.axis)
            if spec.mode == "bwd_post":
                return lambda x: on_grad(x, lambda g: apply_op(g, spec.op, kw, group, where))
            return lambda x: apply_op(x, spec.op, kw, group, where)
        src = dict(self.syncs.src.get(idx, dict(spec.from_ or ())))
        dst = dict(spec.to)
        if spec.mode == "bwd_post":
            return lambda x: on_grad(x, lambda g: convert_multi(g, src, dst, self.group, where=where))

        changed = [ax for ax, d in dst.items() if not _same_placement(src.get(ax, Replicate()), d, None)]

        def typed(x: torch.Tensor) -> torch.Tensor:
            # several axes at once, or an axis whose tensor dim is also split over another axis (one axis at a
            # time would gather blocks in the wrong order): the cost model's cheapest path (may use flat groups)
            if len(changed) > 1 or _shares_dim(changed, src, dst, x.dim()):
                return self.redistribute(x, src, dst, where)
            for ax, d in dst.items():
                s = src.get(ax, Replicate())
                gg = "reduce_scatter" if ax in fused_gather else "split"
                x = convert(x, s, d, self.group(ax), where=f"{where} axis {ax!r}", gather_grad=gg)
            return x

        return typed

    def redistribute(self, x: torch.Tensor, src: dict[str, Placement], dst: dict[str, Placement],
                     where: str) -> torch.Tensor:
        from ..cost.layout import Layout
        from .redistribute import redistribute

        def norm(p: Placement) -> Placement:
            return Shard(p.dim % x.dim()) if isinstance(p, Shard) else p

        src_full = [norm(src.get(ax, Replicate())) for ax in self.mesh.names]
        dst_full = [norm(dst.get(ax, src.get(ax, Replicate()))) for ax in self.mesh.names]
        global_shape = list(x.shape)
        for ax, p in zip(self.mesh.names, src_full):
            if isinstance(p, Shard):
                global_shape[p.dim] *= self.sizes[ax]
        return redistribute(x, Layout(src_full), Layout(dst_full), mesh=self.mesh, global_shape=global_shape)

    def install_syncs(self) -> None:
        """Hooks for every sync and derived collective, per module: input syncs (fwd_pre, then bwd_post), the
        derived input-gradient reduction of a column-parallel leaf, output syncs in order, a derived all-reduce
        of a pending sum nobody reduces, the row-parallel bias, the local forward (NOTE [explicit replaces
        derived] in `sync_plan`)."""
        types = {p: type(m).__name__ for p, m in self.model.named_modules()}
        self.syncs = plan_syncs(self.v.syncs, self.leaf, types)
        index = {id(s): i for i, s in enumerate(self.v.syncs)}
        paths = list(dict.fromkeys([s.path for s in self.v.syncs] + list(self.leaf)))
        for path in paths:
            m = self.module(path)
            plan = self.leaf.get(path)
            where = f"sync at sch[{path!r}]"
            fused = self.syncs.fused.get(path, set())
            for s in self.syncs_of(path, "fwd_pre") + self.syncs_of(path, "bwd_post"):
                if index[id(s)] in self.syncs.merged:
                    continue  # carried out by the fwd_pre gather's backward
                fn = self.transform(index[id(s)], s, where, fused_gather=fused)
                m.register_forward_pre_hook(
                    lambda mod, a, k, fn=fn, s=s: _map_input(mod, a, k, s.arg, fn, where), with_kwargs=True)
            if plan is not None:
                for ax in plan.grad_partial_axes:
                    if ax in fused or (path, ax) in self.syncs.grad_replaced:
                        continue
                    f = self.shared_grad_all_reduce(ax)
                    m.register_forward_pre_hook(
                        lambda mod, a, k, f=f: _map_input(mod, a, k, 0, f, f"build at {path!r}"), with_kwargs=True)
            for s in self.syncs_of(path, "fwd_post"):
                fn = self.transform(index[id(s)], s, where, fused_gather=set())
                m.register_forward_hook(lambda mod, a, out, fn=fn, s=s: _map_output(out, s.out, fn, where))
            for ax in self.syncs.derived_reduce.get(path, []):
                logger.info("build: all-reduce after %r on axis %r (a pending sum no sync reduces)", path, ax)
                g = self.group(ax)
                m.register_forward_hook(lambda mod, a, out, g=g: _map_output(out, 0, lambda y: C.all_reduce(y, g), where))
            final = self.syncs.final.get(path, {})
            if plan is not None and plan.pending_bias:
                self.install_pending_bias(path, m, plan, final)
            if plan is not None and plan.forward is not None:
                fwd = plan.forward
                wrap_forward(m, lambda orig, fwd=fwd, m=m: (lambda *a, **k: fwd(m, *a, **k)))

    def shared_grad_all_reduce(self, axis: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The input-gradient reduction of column-parallel leaves on `axis`, shared between leaves that read
        the very same input tensor (q, k and v; gate and up): their partial gradients are summed by autograd
        first and reduced once, as Megatron's single "f" per block does, instead of once per leaf."""
        g = self.group(axis)
        last: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def f(x: torch.Tensor) -> torch.Tensor:
            hit = last.get("x")
            if hit is not None and hit[0] is x:
                return hit[1]
            y = C.grad_all_reduce(x, g)
            last["x"] = (x, y)
            return y

        if axis not in self._shared_f:
            self._shared_f[axis] = f
        return self._shared_f[axis]

    def install_pending_bias(self, path: str, m: nn.Module, plan: LeafPlan, final: dict[str, Placement]) -> None:
        """Add a row-parallel bias once: after the reduction when the leaf reduces its own output,
        else as bias/n on each rank's partial sum; its gradient is summed where ranks see different data.

        NOTE [bias on a changed column layout]: the local bias is this rank's column shard, so it fits the
        output only while every column axis keeps the leaf's Shard(-1). When a fwd_post sync changes a column
        axis (gathers it, as planner layouts under a memory budget do), the bias is added before the syncs,
        on the leaf's own layout (column shard, pending sum over the row axis) as bias/n."""
        (ax,) = plan.row_axes
        g = self.group(ax)
        n = self.sizes[ax]
        lay = final.get(ax, Partial())
        col = list(plan.grad_partial_axes)
        early = {"on": False}

        def last_dim_shard(p: Placement | None, ndim: int) -> bool:
            return isinstance(p, Shard) and p.dim % ndim == ndim - 1

        def add_early(out: torch.Tensor) -> torch.Tensor:
            early["on"] = any(not last_dim_shard(final.get(a), out.dim()) for a in col)
            if not early["on"]:
                return out
            return out + C.grad_all_reduce(m._parameters[plan.pending_bias], g) / n

        def add(out: torch.Tensor) -> torch.Tensor:
            if early["on"]:
                return out
            b = m._parameters[plan.pending_bias]
            if isinstance(lay, Replicate):
                return out + b
            if isinstance(lay, Shard):
                bb = C.grad_all_reduce(b, g)
                if lay.dim % out.dim() == out.dim() - 1:
                    bb = bb.chunk(n)[self.coords[ax]]
                return out + bb
            return out + C.grad_all_reduce(b, g) / n

        if col:
            m.register_forward_hook(lambda mod, a, out: add_early(out), prepend=True)
        m.register_forward_hook(lambda mod, a, out: add(out))

    def install_attrs(self) -> None:
        for path, name, value in self.v.attrs:
            m = self.module(path)
            if isinstance(value, Ref):
                value = value.resolve()
            if hasattr(value, "bind"):
                value = value.bind(self.mesh)
            setattr(m, name, value)
        for path, name, axis in self.v.shard_attrs:
            m = self.module(path)
            setattr(m, name, getattr(m, name) // self.sizes[axis])

    def install_reduce_grads(self) -> None:
        # NOTE [one all-reduce per module]: a module's replicated parameters that see sharded data (a sequence-
        # parallel norm's weight and bias) get their gradients from one backward node; they are summed over the
        # axis in one flat all-reduce, not one each (as Megatron-LM coalesces its sequence-parallel norm grads).
        for path, axis, names in self.v.reduce_grads:
            m = self.module(path)
            g = self.group(axis)

            def make(orig, m=m, g=g, names=names):
                def forward(*a, **k):
                    saved = {n: m._parameters[n] for n in names}
                    try:  # NOTE [one all-reduce per module]
                        for n, p in zip(saved, C.grad_all_reduce_many(list(saved.values()), g)):
                            m._parameters[n] = p
                        return orig(*a, **k)
                    finally:
                        m._parameters.update(saved)

                return forward

            wrap_forward(m, make)

    def install_fork_rng(self) -> None:
        devices = [torch.cuda.current_device()] if self.mesh.device.type == "cuda" else []
        for path, axis in self.v.fork_rngs:
            m = self.module(path)
            coord = self.coords[axis]

            def make(orig, coord=coord):
                def forward(*a, **k):
                    # drawn from the shared stream, so every rank (and a checkpoint recompute) agrees on it
                    base = int(torch.randint(0, 2**62, (1,)).item())
                    with torch.random.fork_rng(devices=devices):
                        torch.manual_seed((base + 1_000_003 * (coord + 1)) % 2**63)
                        return orig(*a, **k)

                return forward

            wrap_forward(m, make)

    def install_checkpoints(self) -> None:
        for path in self.v.checkpoints:
            m = self.module(path)
            wrap_forward(m, lambda orig, m=m, path=path: checkpointed_forward(m, orig, path))

    def run(self) -> nn.Module:
        if self.v.built:
            raise BuildError("build: this schedule was already built")
        owners = self.owners()
        self.check_params_present(owners)
        self.install_attrs()
        for ext in build_steps("pre_materialize"):
            ext(self)
        for ext in build_steps("pre_shard"):
            ext(self)
        owners = self.owners()
        self.plan_leaves(owners)
        self.slice_params(owners)
        for p in self.model.parameters():
            if not hasattr(p, "global_shape"):
                p.global_shape = tuple(p.shape)  # not sharded: local and global shapes agree
        self.install_syncs()
        self.install_reduce_grads()
        self.install_fork_rng()
        self.install_checkpoints()
        for ext in build_steps("post_hooks"):
            ext(self)
        self.sch.mark_built()
        out = None
        for ext in build_steps("wrap") if self.wrap else ():
            out = ext(self)
            if out is not None:
                break
        self.materialize()  # what no wrapper materialised (NOTE [late materialisation])
        if out is None:
            out = self.model
        logger.info("built %d sharded parameters, %d syncs, %d checkpointed modules on %s",
                    len(self.param_shards), len(self.v.syncs), len(self.v.checkpoints), self.mesh)
        return out


def _shares_dim(changed: list[str], src: dict[str, Placement], dst: dict[str, Placement], ndim: int) -> bool:
    """True when a changed axis's Shard dim is also sharded on another axis, before or after."""
    def dims(lay: dict[str, Placement], ax: str) -> set[int]:
        return {p.dim % ndim for a, p in lay.items() if a != ax and isinstance(p, Shard)}

    for ax in changed:
        mine = {p.dim % ndim for p in (src.get(ax), dst.get(ax)) if isinstance(p, Shard)}
        if mine & (dims(src, ax) | dims({**src, **dst}, ax)):
            return True
    return False


def build(sch: Schedule, *, init_fn: Callable[[nn.Module], None] | None = None, mp_policy: Any = None,
          wrap: bool = True, autocast_dtype: torch.dtype | None = None) -> nn.Module:
    """Turn `sch` into a trainable model on its mesh (inside a launched job: torchrun or `testing.spawn`).

    Every parameter of the result carries ``global_shape`` (the whole tensor's shape; Slapo's ``orig_shape``).
    Pretrained weights are sliced to the local shard, never re-initialised; meta parameters are
    materialised with a per-module seeded init (`init_fn`, else the model's ``_init_weights``, else
    ``reset_parameters``) that yields the same global tensors for any mesh. Returns the model, or its
    DDP wrapper under ``data_parallel(shard=False)``. The schedule's model is changed in place.
    `mp_policy`: an FSDP2 MixedPrecisionPolicy for ``data_parallel(shard=True)`` (ignored otherwise).
    `autocast_dtype`: a pipeline's forward runs under ``torch.autocast`` of this dtype (e.g. bfloat16); its capture
    is traced under the same autocast, so the stage graphs hold the dtypes the forward will see (NOTE [pipeline
    autocast] in `treadle.forms.pipeline.runtime`). Ignored without a pipeline.
    ``wrap=False`` returns the rank's model without the wrappers of the "wrap" build steps (the data-parallel
    form's DDP / FSDP2, a pipeline's stage runner): what the price rehearses.
    Raises BuildError / MeshError naming the path, parameter and axis at fault.
    """
    if not isinstance(sch, Schedule):
        raise ScheduleError(f"build needs a Schedule, got {type(sch).__name__}")
    root = sch if not sch.path else sch.root()
    return _Builder(root, init_fn, mp_policy, wrap, autocast_dtype).run()  # always from the root
