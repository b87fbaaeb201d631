"""The `expert_parallel` primitive: a mixture-of-experts layer's experts split over a mesh axis, tokens sent to
their experts' ranks and back (a mixin of `Schedule`; what build installs: `treadle.forms.expert`).

The experts module is the model's own: a module whose direct parameters all stack the experts on dim 0
(``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``, biases ``(E, O)``) and whose forward takes the routed
rows, each row's expert indices and their weights (``forward(hidden (T, H), top_k_index (T, k),
top_k_weights (T, k)) -> (T, H)``), as every Hugging Face MoE decoder's experts are since transformers 5.
Rank r of the axis keeps experts ``r*E/n .. (r+1)*E/n - 1``; the axis must be a data-parallel axis (each rank
routes its own tokens), as in torchtitan and Megatron-Core. Several axes make one expert group, their flattened
group (row-major in mesh order, as `data_parallel` flattens its axes): EP 64 over the (8, 8) axes ``("dp", "tp")``
as DeepSeek-V3 trains.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import ScheduleError
from .state import ParamShard

if TYPE_CHECKING:  # (annotations only: core's Schedule mixes this class in)
    from .core import Schedule

EXTRAS_KEY = "expert_parallel"  # extras[EXTRAS_KEY]: {experts module path: its expert axes, in mesh order}
LOAD_KEY = "expert_load"  # extras[LOAD_KEY]: {experts module path: load_imbalance} where stated above 1


def expert_load_imbalances(extras) -> dict[str, float]:
    """The busiest rank's routed rows over the mean that a schedule states per experts module (NOTE [expert load
    in a rehearsal]); a module it does not name is priced balanced (1.0)."""
    return dict(extras.get(LOAD_KEY, {}))


def load_assumption(extras) -> str | None:
    """One line saying what expert load a price of this schedule assumed (NOTE [expert load in a rehearsal]); None
    without expert parallelism."""
    paths = expert_paths(extras)
    if not paths:
        return None
    stated = expert_load_imbalances(extras)
    if not stated:
        return (f"experts: {len(paths)} expert-parallel modules priced at a balanced load (assumed; state "
                f"expert_parallel(load_imbalance=) with the busiest / mean rank treadle.run logs)")
    loads = sorted(set(stated.values()))
    say = f"{loads[0]:g}x" if len(loads) == 1 else f"{loads[0]:g}x to {loads[-1]:g}x"
    return (f"experts: the busiest rank of the expert axis priced at {say} the mean routed rows in "
            f"{len(stated)} of {len(paths)} expert-parallel modules (stated: load_imbalance)")


def is_load_imbalance(value) -> bool:
    """Whether `value` is a load imbalance: a finite number >= 1 (the busiest rank's routed rows over the mean), not
    a bool. The one rule for the primitive, `plan_model` and plan files (`planner.decision_check`)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 1


def check_load_imbalance(value, *, where: str) -> float:
    """`value` as a load imbalance (`is_load_imbalance`). Raises ScheduleError naming `where` and the value
    otherwise."""
    if not is_load_imbalance(value):
        raise ScheduleError(f"{where}: load_imbalance must be a finite number >= 1 (the busiest rank's routed rows "
                            f"over the mean; 1 is balanced), got {value!r:.40}")
    return float(value)


def expert_paths(extras) -> dict[str, tuple[str, ...]]:
    """The expert-parallel modules a schedule recorded: path -> the mesh axes its experts split over (one axis, or
    several flattened as one group; in mesh order)."""
    return dict(extras.get(EXTRAS_KEY, {}))


def axes_label(axes: tuple[str, ...]) -> str:
    """How prices and messages name the (flattened) group of `axes`: the names joined by ","."""
    return ",".join(axes)


def expert_axes(mesh, axis, *, where: str) -> tuple[str, ...]:
    """`expert_parallel`'s `axis` argument as the tuple of mesh axes it names, in mesh order: one axis name, or a
    list or tuple of distinct ones. Raises ScheduleError naming `where`, the mesh's axes and what is wrong."""
    names = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(axis, (list, tuple)) else None
    if not names or not all(isinstance(a, str) for a in names) or len(set(names)) != len(names):
        raise ScheduleError(f"{where}: axis must be a mesh axis name or a list of distinct ones (mesh axes "
                            f"{list(mesh.names)}), got {axis!r:.80}")
    unknown = [a for a in names if a not in mesh.names]
    if unknown:
        raise ScheduleError(f"{where}: mesh axes {unknown} do not exist; {mesh} has axes {list(mesh.names)}")
    return tuple(sorted(names, key=mesh.names.index))


def expert_param_names(model, extras) -> set[str]:
    """Names (every alias) of the parameters of `model` that expert parallelism splits."""
    paths = expert_paths(extras)
    return {n for n, _ in model.named_parameters(remove_duplicate=False)
            if n.rpartition(".")[0] in paths}


def experts_shape(path: str, mod) -> int:
    """The number of experts of experts module `mod` at `path` (the common dim 0 of its direct parameters).
    Raises ScheduleError naming the path and the parameter that does not stack experts on dim 0."""
    own = [(n, p) for n, p in mod.named_parameters(recurse=False)]
    where = f"expert_parallel at sch[{path!r}] ({type(mod).__name__})"
    if not own:
        raise ScheduleError(f"{where}: the module has no parameters of its own; state expert parallelism on the "
                            f"module that holds the stacked expert weights (e.g. '...mlp.experts')")
    nested = [n for n, _ in mod.named_parameters() if "." in n]
    if nested:
        raise ScheduleError(f"{where}: its children hold parameters {nested[:3]}; an experts module keeps every "
                            f"expert's weights itself, stacked on dim 0")
    sizes = {n: tuple(p.shape) for n, p in own}
    bad = [n for n, s in sizes.items() if len(s) < 2]
    if bad or len({s[0] for s in sizes.values()}) != 1:
        raise ScheduleError(f"{where}: its parameters {sizes} do not all stack the experts on dim 0 (each "
                            f"parameter (E, ...) with one E); this is not an experts module")
    positional, routed = _routed_signature(mod)
    if not routed and not _dense(mod):
        raise ScheduleError(f"{where}: its forward takes {positional}; an experts module takes "
                            f"the rows, their expert indices and their routing weights "
                            f"(forward(hidden_states, top_k_index, top_k_weights)), or E groups of rows, one per "
                            f"expert (NOTE [dense experts])")
    return next(iter(sizes.values()))[0]


def experts_layout(mod) -> str:
    """How experts module `mod` takes its rows: "routed" (rows, their expert indices and routing weights) or
    "dense" (E groups of rows, one per expert: NOTE [dense experts])."""
    return "routed" if _routed_signature(mod)[1] or not _dense(mod) else "dense"


def _routed_signature(mod) -> tuple[list[str], bool]:
    """The names of `mod.forward`'s positional parameters, and whether it can take routed rows, their expert
    indices and routing weights (three positional parameters, or *args)."""
    try:
        params = list(inspect.signature(mod.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional, len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _dense(mod) -> bool:
    from .expert_split import dense_experts

    return dense_experts(mod)


class ExpertPrimitive:
    """`Schedule.expert_parallel` and its checks (the schedule provides `_state`, `mesh`, `mod`, `path`,
    `_where`, `_check_axis`, `_check_not_built`, `_record`)."""

    def expert_parallel(self: "Schedule", *, axis: str | Sequence[str] = "dp", tensor: str | None = None,
                        load_imbalance: float = 1.0) -> "Schedule":
        """Split this experts module's experts over mesh axis `axis` (expert parallelism): rank r keeps E/n
        of the E experts (every parameter split on dim 0). `axis` may name several axes: the experts then split
        over their flattened group of n = the product of their sizes (rank r row-major over the axes in mesh
        order, as `data_parallel` flattens its axes; e.g. EP 64 over ``("dp", "tp")`` of sizes (8, 8)).
        In forward each rank sends every (token, expert)
        pair it routes to the rank holding that expert, which runs the module's own forward on the rows it
        receives, and the results come back to be weighted and summed as the model does (dropless: every
        routed pair is computed; an index outside 0..E-1 is the model's own "no expert" and is not sent).

        Each of the `axis` axes must be a data-parallel axis of the schedule (checked here when `data_parallel`
        came first, at build otherwise): the experts' gradients are summed over the tokens of every rank of the axis and
        averaged with the other data-parallel axes, as data parallelism averages the rest of the model.

        `tensor`: a tensor-parallel mesh axis that also splits each expert's weights (Megatron-Core's expert
        tensor parallelism): the split whose parts sum to the whole is found by running the module's own forward
        on random weights of one expert (NOTE [experts split by tensor] in `expert_split.py`; a fused gate|up is
        split in its two blocks, the down projection on its contraction) and recorded as shards on `tensor`;
        each rank of a `tensor` group routes the same rows and their combined results are summed over it.

        `load_imbalance`: the busiest rank's routed rows over the mean that the price charges (NOTE [expert load in
        a rehearsal]; 1.0, the default, is the balanced load a load-balanced router aims at). Training routes as
        the router does whatever is stated here; `treadle.run` logs the measured value of its expert axis
        (`ExpertLoad.rank_imbalance`), which is what to state.
        Raises ScheduleError naming the path, parameter, axis and sizes at fault."""
        self._check_not_built("expert_parallel")
        where = f"expert_parallel at {self._where()}"
        axes = expert_axes(self.mesh, axis, where=where)
        for a in axes:
            self._check_axis(a, "expert_parallel")
        load = check_load_imbalance(load_imbalance, where=where)
        if not self.path:
            raise ScheduleError(f"{where}: state expert parallelism on an experts module, not the whole model")
        paths = self._state.extras.setdefault(EXTRAS_KEY, {})
        if self.path in paths:
            raise ScheduleError(f"{where}: already expert-parallel over {axes_label(paths[self.path])!r}")
        e = experts_shape(self.path, self.mod)
        n = math.prod(self.mesh.size(a) for a in axes)
        if e % n:
            what = f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"the flattened mesh axes {list(axes)}"
            raise ScheduleError(f"{where}: {e} experts do not divide over {what} of size {n}; use axes whose "
                                f"sizes multiply to a divisor of {e}")
        dp = self._state.data_parallel
        outside = [a for a in axes if dp is not None and a not in dp.axes]
        if outside:
            raise ScheduleError(f"{where}: mesh axis {outside[0]!r} is not data-parallel (data_parallel(axis="
                                f"{dp.label()!r})); experts split over axes whose ranks route their own tokens")
        if experts_layout(self.mod) == "dense" and (tensor is not None or load != 1.0):
            what = "tensor=" if tensor is not None else "load_imbalance="
            raise ScheduleError(f"{where}: {what} is for experts that take routed rows; this module runs every expert "
                                f"on every row (NOTE [dense experts]), so its load is even and its experts split "
                                f"over the expert axes only")
        split = self._expert_split(tensor, axes, where)
        for name, p in self.mod.named_parameters(recurse=False):
            prior = self._state.param_shards.get(id(p), [])
            if prior:
                raise ScheduleError(f"{where}: parameter {name!r} is already split on mesh axis {prior[0].axis!r} "
                                    f"(dim {prior[0].dim}); state expert_parallel first (its axis splits the "
                                    f"experts' dim 0), then any split of each expert's weights")
        for name, p in self.mod.named_parameters(recurse=False):
            self._state.param_shards.setdefault(id(p), []).extend(ParamShard(0, a) for a in axes)  # row-major
            if name in split:
                self._state.param_shards[id(p)].append(split[name])
        paths[self.path] = axes
        if load != 1.0:
            self._state.extras.setdefault(LOAD_KEY, {})[self.path] = load
        self._record("expert_parallel", axis=axes[0] if len(axes) == 1 else list(axes),
                     **({"tensor": tensor} if tensor is not None else {}),
                     **({"load_imbalance": load} if load != 1.0 else {}))
        return self

    def _expert_split(self: "Schedule", tensor: str | None, axes: tuple[str, ...], where: str) -> dict[str, ParamShard]:
        """The split of each expert's weights over tensor axis `tensor` (NOTE [experts split by tensor])."""
        if tensor is None:
            return {}
        from .expert_split import as_axis, find_split

        self._check_axis(tensor, "expert_parallel")
        dp = self._state.data_parallel
        if tensor in axes or (dp is not None and tensor in dp.axes):
            what = ("the expert axis" if len(axes) == 1 else "an expert axis") if tensor in axes else "data-parallel"
            raise ScheduleError(f"{where}: tensor={tensor!r} is {what}; each expert's weights split over a "
                                f"tensor-parallel axis (one whose ranks see the same rows)")
        return as_axis(find_split(self.mod, self.mesh.size(tensor), where=where), tensor)
