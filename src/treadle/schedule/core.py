"""The schedule tree and its module-level primitives.

A `Schedule` wraps one module of a model (``sch["transformer.h.0.attn"]``). Primitives are verbs that
*record* what the distributed model should look like — a parameter's layout, a layout change at a module
boundary, a checkpointed region — and return the sub-schedule so calls chain::

    sch["h.0.mlp.c_fc"].shard(["weight", "bias"], dim=1, axis="tp")
    sch["h.0.mlp.c_proj"].shard("weight", dim=0, axis="tp").sync("fwd_post", to=Replicate(), axis="tp")

Only `replace`/`replace_all` change the module tree at once (so later paths see the new modules); every
other primitive is data that `treadle.build` turns into sharded weights, hooks and wrappers once, at the
end, so the meaning of a schedule never depends on the order of its primitives (NOTE [record, then build]).
Shapes in primitives are global. Every primitive is appended to the log (`to_json`, `to_python`).
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ..errors import MeshError, ScheduleError
from ..mesh import Mesh
from .checkpoint_policies import checkpoint_policy
from .data_parallel import make_data_parallel
from .expert_primitive import ExpertPrimitive, expert_param_names, expert_paths
from .float8_primitive import Float8Primitive
from .log import Record, Ref, records_to_json
from .state import ParamShard, _State
from .sync import SyncPrimitive
from .tree import swap_module as _swap_module
from .view import ScheduleView

logger = logging.getLogger(__name__)

def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else (prefix or path)


try:  # graph-level primitives (trace, find, fuse, cut_pipeline_stage, ...) live in their own module
    from .graph_primitives import GraphPrimitives as _GraphPrimitives
except ImportError:  # pragma: no cover - only while that layer is absent
    class _GraphPrimitives:  # type: ignore[no-redef]
        pass


class Schedule(_GraphPrimitives, SyncPrimitive, ExpertPrimitive, Float8Primitive):
    """A schedule of one module of the model; the root schedule covers the whole model.

    Create with `treadle.create_schedule(model, mesh=...)`; index sub-modules by dotted path
    (``sch["encoder.layer.0.attention"]``, ModuleList/Sequential children by index).
    """

    def __init__(self, state: _State, path: str, mod: nn.Module):
        self._state = state
        self.path = path
        self.mod = mod

    # ------------------------------------------------------------------ tree
    @property
    def mesh(self) -> Mesh:
        return self._state.mesh

    @property
    def model(self) -> nn.Module:
        return self._state.model

    @property
    def records(self) -> list[Record]:
        """The log: every primitive applied so far, in order."""
        return list(self._state.records)

    def root(self) -> "Schedule":
        """The schedule of the whole model this sub-schedule belongs to."""
        return Schedule(self._state, "", self._state.model)

    def view(self) -> ScheduleView:
        """A read-only snapshot of everything the schedule recorded (`treadle.schedule.view.ScheduleView`):
        what build, the price, verify and treadle.run read."""
        return ScheduleView.of(self._state)

    # ------------------------------------------------------------------ what build tells the schedule
    def mark_built(self) -> None:
        """Called by `treadle.build` once it has turned this schedule's model into the distributed one: every
        primitive after it is refused. Raises ScheduleError when the schedule was built already."""
        if self._state.built:
            raise ScheduleError("build: this schedule was already built")
        self._state.built = True

    def rebind_param(self, old: nn.Parameter, new: nn.Parameter) -> None:
        """Called by `treadle.build` when it replaces parameter `old` of the model by `new` (its local shard, a
        materialised meta parameter): what was recorded for `old` now belongs to `new`."""
        st = self._state
        for table in (st.param_shards, st.annotations):
            if id(old) in table:
                table[id(new)] = table.pop(id(old))

    def __repr__(self) -> str:
        return f"Schedule({self.path or '<root>'!r}, {type(self.mod).__name__}, {self.mesh})"

    def __getitem__(self, path: str) -> "Schedule":
        if not isinstance(path, str):
            raise ScheduleError(f"index a schedule with a dotted module path string, got {path!r}")
        full = _join(self.path, path)
        mod = self.mod
        for i, part in enumerate(path.split(".") if path else []):
            child = mod._modules.get(part)
            if child is None:
                raise ScheduleError(self._unknown_path_message(full, ".".join(path.split(".")[: i + 1])))
            mod = child
        return Schedule(self._state, full, mod)

    def __contains__(self, path: str) -> bool:
        try:
            self[path]
        except ScheduleError:
            return False
        return True

    def _unknown_path_message(self, full: str, bad_prefix: str) -> str:
        paths = [p for p, _ in self._state.model.named_modules() if p]
        near = difflib.get_close_matches(full, paths, n=3, cutoff=0.5)
        bad = _join(self.path, bad_prefix) if self.path else bad_prefix
        hint = f"; nearest existing paths: {near}" if near else ""
        return f"unknown module path {full!r} ({bad!r} does not exist){hint}"

    def named_schedules(self, *, prefix_relative: bool = False) -> Iterator[tuple[str, "Schedule"]]:
        """(path, sub-schedule) for this module and every descendant, in `named_modules` order."""
        for name, mod in self.mod.named_modules():
            full = _join(self.path, name)
            yield (name if prefix_relative else full), Schedule(self._state, full, mod)

    def find(self, pattern: Any) -> list[Any]:
        """A regular expression (str): sub-schedules whose path relative to this one fully matches it.
        A Python function: subgraph matches in this module's traced graph (`find_pattern`)."""
        import re

        if not isinstance(pattern, str):
            return self.find_pattern(pattern)

        rx = re.compile(pattern)
        return [s for name, s in self.named_schedules(prefix_relative=True) if name and rx.fullmatch(name)]

    # ------------------------------------------------------------------ helpers
    def _record(self, name: str, args: dict[str, Any] | None = None, /, **kw: Any) -> None:
        self._state.records.append(Record(name, self.path, {**(args or {}), **kw}))
        logger.info("%s", self._state.records[-1].to_python())

    def _check_attr_name(self, name: Any, what: str) -> None:
        """An attribute name a primitive may set: an identifier, not a dunder (``__class__``, ``__dict__``)."""
        if not isinstance(name, str) or not name.isidentifier() or (name.startswith("__") and name.endswith("__")):
            raise ScheduleError(f"{what} at {self._where()}: attribute name must be a plain identifier (not a "
                                f"dunder), got {name!r:.80}")

    def _where(self) -> str:
        return f"sch[{self.path!r}]" if self.path else "sch"

    def _check_axis(self, axis: str, what: str) -> None:
        try:
            self.mesh.axis_index(axis)
        except MeshError as exc:
            raise ScheduleError(f"{what} at {self._where()}: {exc}") from None

    def _param(self, name: str) -> nn.Parameter:
        try:
            p = self.mod.get_parameter(name)
        except AttributeError:
            own = [n for n, _ in self.mod.named_parameters()]
            raise ScheduleError(f"{self._where()} ({type(self.mod).__name__}) has no parameter {name!r}; "
                                f"its parameters: {own}") from None
        return p

    def _check_not_built(self, op: str) -> None:
        if self._state.built:
            raise ScheduleError(f"{op} at {self._where()}: this schedule was already built; "
                                f"create a new schedule on a fresh model to change it")

    # ================================================================== primitives: module tree
    def replace(self, new: nn.Module | Callable[[nn.Module], nn.Module], match: Any = None) -> "Schedule":
        """Put `new` (a module, or a factory called with the old module) in place of this module; with
        `match` (from `find`), replace that matched subgraph of the traced module instead (`replace_match`).

        Forward hooks, forward pre-hooks and backward hooks of the old module carry over, as do
        primitives recorded for this path. Returns the schedule of the new module.
        Raises ScheduleError on the root, or when the factory does not return a module.
        """
        if match is not None:
            return self.replace_match(new, match)
        self._check_not_built("replace")
        if not self.path:
            raise ScheduleError("replace: cannot replace the root module; replace one of its children")
        built = new(self.mod) if not isinstance(new, nn.Module) and callable(new) else new
        if not isinstance(built, nn.Module):
            raise ScheduleError(f"replace at {self._where()}: expected an nn.Module or a factory returning one, "
                                f"got {type(built).__name__}")
        arg = new if isinstance(new, nn.Module) else Ref.of(new)
        self._state.snapshot()
        _swap_module(self._state.model, self.path, self.mod, built)
        self._record("replace", new=arg)
        self.mod = built
        return self

    def replace_all(self, module_type: type, factory: Callable[..., nn.Module], **kwargs: Any) -> list[str]:
        """Replace every module of exactly `module_type` under this one with ``factory(old, **kwargs)``; a
        factory with a ``path`` parameter (or ``**kw``) also receives the module's full dotted path
        (Slapo's ``make_mod_func(name, mod)``). `kwargs` are logged, so they must be JSON values.

        Returns the replaced paths. Raises ScheduleError when nothing matches (a pattern that matches
        nothing is a mistake, not a no-op) or the factory does not return a module.
        """
        import inspect

        self._check_not_built("replace_all")
        ref = Ref.of(factory)
        paths = [p for p, m in self.named_schedules() if type(m.mod) is module_type and p != self.path]
        if not paths:
            raise ScheduleError(f"replace_all at {self._where()}: no module of type {module_type.__qualname__} here")
        try:
            params = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            params = {}
        wants_path = "path" in params or any(q.kind == q.VAR_KEYWORD for q in params.values())
        if "path" in kwargs:
            raise ScheduleError(f"replace_all at {self._where()}: 'path' is passed by treadle; rename that argument")
        self._state.snapshot()
        for p in paths:
            sub = Schedule(self._state, p, self._state.model.get_submodule(p))
            new = factory(sub.mod, **({"path": p} if wants_path else {}), **kwargs)
            if not isinstance(new, nn.Module):
                raise ScheduleError(f"replace_all: factory {ref.target} returned {type(new).__name__} for {p!r}")
            _swap_module(self._state.model, p, sub.mod, new)
        self._record("replace_all", module_type=module_type, factory=ref, **kwargs)
        return paths

    # ================================================================== primitives: layouts
    def shard(self, names: str | list[str], *, dim: int, axis: str, blocks: int = 1) -> "Schedule":
        """Split parameter(s) `names` along tensor dim `dim` over mesh axis `axis`. Shapes are global:
        a (3072, 768) weight with dim=0 on tp=4 keeps (768, 768) per rank.

        `blocks=k` treats the dim as k equal concatenated parts (fused q|k|v) and splits each part.
        Tied parameters are one object, so they stay tied (sharding one shards all its aliases).
        Requires: each name is a parameter of this module; its size on `dim` divides by blocks x axis size
        (after earlier splits of the same dim); the parameter is not yet split on `axis`.
        Raises: ScheduleError naming path, parameter, dim, size and axis.
        """
        self._check_not_built("shard")
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise ScheduleError(f"shard at {self._where()}: dim must be an integer tensor dim, got {dim!r}")
        if not isinstance(blocks, int) or isinstance(blocks, bool):
            raise ScheduleError(f"shard at {self._where()}: blocks must be an integer, got {blocks!r}")
        dp = self._state.data_parallel
        if dp is not None and axis in dp.axes:
            raise ScheduleError(f"shard at {self._where()}: mesh axis {axis!r} is the data-parallel axis "
                                f"(data_parallel(axis={dp.label()!r})); shard parameters over another axis")
        name_list = [names] if isinstance(names, str) else list(names)
        if not name_list:
            raise ScheduleError(f"shard at {self._where()}: no parameter names given")
        self._check_axis(axis, "shard")
        if blocks < 1:
            raise ScheduleError(f"shard at {self._where()}: blocks must be >= 1, got {blocks}")
        n = self.mesh.size(axis)
        for name in name_list:
            p = self._param(name)
            if not -p.dim() <= dim < p.dim():
                raise ScheduleError(f"shard at {self._where()}: parameter {name!r} has {p.dim()} dims "
                                    f"(shape {tuple(p.shape)}); dim={dim} is out of range")
            d = dim % p.dim()
            prior = self._state.param_shards.get(id(p), [])
            for s in prior:
                if s.axis == axis:
                    raise ScheduleError(f"shard at {self._where()}: parameter {name!r} is already split on mesh axis "
                                        f"{axis!r} (dim {s.dim}); a parameter takes each mesh axis at most once")
            size = p.shape[d]
            order = self.mesh.names
            for s in prior:
                if s.dim == d:
                    size //= self.mesh.size(s.axis)
                    if order.index(s.axis) > order.index(axis):
                        # slicing applies shards in call order (the first axis splits outermost); layouts
                        # and conversions count a dim split over several axes in mesh-axis order
                        raise ScheduleError(
                            f"shard at {self._where()}: parameter {name!r} dim {d} is already split on mesh axis "
                            f"{s.axis!r}; split a dim over several axes in mesh-axis order {list(order)} "
                            f"(shard on {axis!r} first, then on {s.axis!r})")
            if size % (n * blocks):
                what = f"{blocks} blocks x " if blocks > 1 else ""
                raise ScheduleError(f"shard at {self._where()}: parameter {name!r} dim {d} has size {size}, "
                                    f"not divisible by {what}mesh axis {axis!r} of size {n}; "
                                    f"use an axis size that divides {size}")
        for name in name_list:
            p = self._param(name)
            self._state.param_shards.setdefault(id(p), []).append(ParamShard(dim % p.dim(), axis, blocks))
        args: dict[str, Any] = {"*": name_list[0] if len(name_list) == 1 else name_list, "dim": dim, "axis": axis}
        if blocks != 1:
            args["blocks"] = blocks
        self._record("shard", args)
        return self

    # ================================================================== primitives: regions
    def checkpoint(self, match: Any = None, *, save: list[str] | None = None, policy: str = "full") -> "Schedule":
        """Recompute this module's forward in backward instead of saving its activations
        (non-reentrant `torch.utils.checkpoint`; dropout recomputes the same mask).
        With `match` (from `find`): checkpoint only that subgraph of the traced module (`checkpoint_match`).
        With `save=[ops]`: selective checkpointing that keeps those ops' outputs (`checkpoint_selective`).
        With `policy`: "full" (the default), or a selective policy as a peer project defines it:
        "alternate-matmuls" (torchtitan's op-level SAC), "attention-core" (Megatron's selective recomputation);
        NOTE [checkpoint policies as peers define them]. Layer-level every-k is `checkpoint_every(k)` on the
        stack of blocks."""
        if sum(x is not None for x in (match, save)) + (policy != "full") > 1:
            raise ScheduleError(f"checkpoint at {self._where()}: give one of match=, save= or policy=")
        if match is not None:
            return self.checkpoint_match(match)
        if save is not None:
            return self.checkpoint_selective(save=save)
        if checkpoint_policy(policy, self._where()) is not None:
            return self.checkpoint_selective(policy=policy)
        self._check_not_built("checkpoint")
        if isinstance(self.mod, (nn.ModuleList, nn.ModuleDict)):
            raise ScheduleError(f"checkpoint at {self._where()}: a {type(self.mod).__name__} has no forward to "
                                f"recompute; checkpoint its items, e.g. sch[{(_join(self.path, '0'))!r}], or "
                                f"every k-th of them: checkpoint_every(k)")
        if self.path in self._state.checkpoints or any(p == self.path for p, _ in self._state.extras.get("selective", [])):
            raise ScheduleError(f"checkpoint at {self._where()}: already checkpointed")
        self._state.checkpoints.append(self.path)
        self._record("checkpoint")
        return self

    def checkpoint_every(self, k: int, *, policy: str = "full") -> "Schedule":
        """Layer-level checkpointing of this stack of blocks (an nn.ModuleList, nn.Sequential or indexed
        nn.ModuleDict): checkpoint every `k`-th block, blocks k-1, 2k-1, ... (torchtitan's layer-level selective
        AC, ``selective_ac_option = "k"``; k=1 checkpoints every block), each with `policy` (`checkpoint`).
        Records one ``checkpoint`` per chosen block, so a file names the blocks. Raises ScheduleError for a
        module that is no stack, k < 1, or a block already checkpointed."""
        self._check_not_built("checkpoint_every")
        if not isinstance(self.mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            raise ScheduleError(f"checkpoint_every at {self._where()}: a {type(self.mod).__name__} is no stack of "
                                f"blocks; call it on the nn.ModuleList / nn.Sequential holding them")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ScheduleError(f"checkpoint_every at {self._where()}: k must be an int >= 1, got {k!r:.40}")
        names = [n for n, _ in self.mod.named_children()]
        for i, name in enumerate(names):
            if (i + 1) % k == 0:
                self[name].checkpoint(policy=policy)
        return self

    def fork_rng(self, *, axis: str = "tp") -> "Schedule":
        """Give each rank along `axis` its own random stream inside this module (dropout on sharded data).
        Checkpoint recomputation replays the same streams."""
        self._check_not_built("fork_rng")
        self._check_axis(axis, "fork_rng")
        self._state.fork_rngs.append((self.path, axis))
        self._record("fork_rng", axis=axis)
        return self

    def reduce_grads(self, *, axis: str, names: list[str] | None = None) -> "Schedule":
        """Sum the gradients of this module's replicated parameters over `axis`: for modules that see a
        shard of the data along `axis` (sequence-parallel norms). Default: all its direct parameters."""
        self._check_not_built("reduce_grads")
        self._check_axis(axis, "reduce_grads")
        names_t = tuple(names) if names is not None else tuple(n for n, _ in self.mod.named_parameters(recurse=False))
        for n in names_t:
            self._param(n)
        if not names_t:
            raise ScheduleError(f"reduce_grads at {self._where()}: module has no direct parameters")
        self._state.reduce_grads.append((self.path, axis, names_t))
        args: dict[str, Any] = {"axis": axis}
        if names is not None:
            args["names"] = list(names)
        self._record("reduce_grads", **args)
        return self

    # ================================================================== primitives: metadata
    def annotate(self, param: str, key: str, value: Any) -> "Schedule":
        """Tag parameter `param` with ``key=value``; `treadle.annotations(built_model)` returns the tags."""
        self._check_not_built("annotate")
        p = self._param(param)
        self._state.annotations.setdefault(id(p), {})[key] = value
        self._record("annotate", **{"*": param, "key": key, "value": value})
        return self

    def set_attr(self, name: str, value: Any) -> "Schedule":
        """Set attribute `name` of this module at build (a `Ref` is resolved and, if it has ``bind(mesh)``,
        bound to the mesh) — e.g. a model's loss function."""
        self._check_not_built("set_attr")
        self._check_attr_name(name, "set_attr")
        self._state.attrs.append((self.path, name, value))
        self._record("set_attr", **{"*": name, "value": value})
        return self

    def shard_attr(self, name: str, *, axis: str) -> "Schedule":
        """Declare that integer attribute `name` counts a dim split over `axis` (e.g. a fused-qkv split
        size); build divides it by the axis size. Raises ScheduleError if it is not a divisible int."""
        self._check_not_built("shard_attr")
        self._check_attr_name(name, "shard_attr")
        self._check_axis(axis, "shard_attr")
        v = getattr(self.mod, name, None)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ScheduleError(f"shard_attr at {self._where()}: attribute {name!r} is {v!r}, not an int")
        if v % self.mesh.size(axis):
            raise ScheduleError(f"shard_attr at {self._where()}: attribute {name!r} = {v} is not divisible by "
                                f"mesh axis {axis!r} of size {self.mesh.size(axis)}")
        self._state.shard_attrs.append((self.path, name, axis))
        self._record("shard_attr", **{"*": name, "axis": axis})
        return self

    def data_parallel(self, *, axis: str | tuple[str, ...] = "dp", shard: bool = False,
                      replicate: str | tuple[str, ...] = (), reshard_after_forward: bool = True) -> "Schedule":
        """Data parallelism over one or several mesh axes (the batch splits over all of them, row-major in
        mesh order). Composes with tensor parallelism on the other axes. Root only.

        - ``shard=False``: replicate the model over every axis in `axis` and average gradients over their
          flattened group (DDP): ``data_parallel(axis=("dp", "tp"))`` is pure DP over a 2x2 mesh's 4 ranks;
        - ``shard=True``: shard parameters, gradients and optimizer state over the flattened group of `axis`
          (ZeRO-3 via FSDP2 `fully_shard`); with ``replicate=("r",)`` also replicate over those axes (HSDP:
          ``data_parallel(axis="s", shard=True, replicate="r")``);
        - ``reshard_after_forward=False`` (FSDP2): keep gathered parameters from forward to backward.

        Raises: ScheduleError for an unknown or repeated axis, an axis that already shards parameters, a
        second call, and the flag combinations `treadle.schedule.data_parallel.make_data_parallel` refuses."""
        self._check_not_built("data_parallel")
        if self.path:
            raise ScheduleError(f"data_parallel applies to the whole model: call it on the root schedule, "
                                f"not {self._where()}")
        if self._state.data_parallel is not None:
            raise ScheduleError(f"data_parallel: already set ({self._state.data_parallel})")
        spec = make_data_parallel(self.mesh, axis=axis, shard=shard, replicate=replicate,
                                  reshard_after_forward=reshard_after_forward)
        experts = expert_param_names(self.mod, self._state.extras)  # split over a data axis by design
        for ax in spec.axes:
            on_axis = sorted({n for n, p in self.mod.named_parameters(remove_duplicate=False) if n not in experts
                              and any(s.axis == ax for s in self._state.param_shards.get(id(p), []))})
            if on_axis:
                raise ScheduleError(f"data_parallel: mesh axis {ax!r} already shards parameters {on_axis[:3]}"
                                    f"{' ...' if len(on_axis) > 3 else ''}; data parallelism needs an axis of its "
                                    f"own (mesh axes: {list(self.mesh.names)}, data-parallel: {list(spec.axes)})")
        outside = {path: [a for a in axes if a not in spec.axes]
                   for path, axes in expert_paths(self._state.extras).items()}
        outside = {path: ax for path, ax in outside.items() if ax}
        if outside:
            path, ax = next(iter(outside.items()))
            raise ScheduleError(f"data_parallel(axis={spec.label()!r}): sch[{path!r}] is expert-parallel over "
                                f"{ax[0]!r}, which is not one of its axes; experts split over axes whose ranks route "
                                f"their own tokens")
        self._state.data_parallel = spec
        args: dict[str, Any] = {"axis": axis if isinstance(axis, str) else list(axis), "shard": bool(shard)}
        if replicate:
            args["replicate"] = replicate if isinstance(replicate, str) else list(replicate)
        if not reshard_after_forward:
            args["reshard_after_forward"] = False
        self._record("data_parallel", args)
        return self

    # ------------------------------------------------------------------ serialisation
    def to_json(self) -> str:
        """The log as JSON (`treadle.load_schedule` replays it)."""
        return records_to_json(self._state.records, mesh_shape=self.mesh.shape, mesh_names=self.mesh.names)

    def to_python(self) -> str:
        """The log as Python calls one can paste back (``sch[...]`` is the root schedule)."""
        return "\n".join(r.to_python() for r in self._state.records)


def create_schedule(model: nn.Module, *, mesh: Mesh) -> Schedule:
    """The root schedule of `model` on `mesh`. The model keeps its definition; nothing changes until
    primitives are applied and `treadle.build` runs."""
    if not isinstance(model, nn.Module):
        raise ScheduleError(f"create_schedule needs an nn.Module, got {type(model).__name__}")
    if not isinstance(mesh, Mesh):
        raise ScheduleError(f"create_schedule needs mesh=treadle.Mesh(shape, names), got {mesh!r}")
    return Schedule(_State(model=model, mesh=mesh), "", model)

