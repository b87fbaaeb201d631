"""What `build` installs for expert parallelism (`Schedule.expert_parallel`): the "pre_shard" step plans each
experts module's local forward (NOTE [expert dispatch] in `dispatch.py`); the form's `own_params` face names the
local expert weights, which the data-parallel form leaves alone (NOTE [expert gradients]).

NOTE [expert gradients]: data parallelism averages a replicated weight's gradient over its D replicas:
(1/D) * sum over ranks r of dL_r/dW. An expert's weight lives on one rank of the expert axis (here and below: or
the flattened group of the expert axes, when `expert_parallel` names several), and the token
exchange already sums, into its gradient, the tokens of every rank of that axis. So it is summed further over
the data-parallel ranks outside the expert axis (when there are any: the same expert's copies) and scaled by
1/D, in the backward of the experts' local forward; DDP and FSDP2 are told to ignore those weights (DDP's
ignore list, FSDP2's `ignored_params`), so no second reduction averages them over experts they do not share.
Every rank's local weights get a gradient, zero where no row reached them, so the reduction runs on every rank
in the same order. Under ZeRO-3 with shard axes besides the expert axis, FSDP2 shards the experts over those
and averages their gradients there itself (NOTE [experts under FSDP2]); the local forward then only scales by
1/|expert axis|.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import BuildError, ScheduleError
from ...schedule.expert_primitive import (axes_label, expert_load_imbalances, expert_paths, experts_layout,
                                          experts_shape)
from ...schedule.expert_split import check_split
from ...sharding_rules import LeafPlan
from .dispatch import DenseExpertLeaf, ExpertLeaf
from .facts import expert_fsdp

logger = logging.getLogger(__name__)


def count_attrs(mod, experts: int) -> tuple[str, ...]:
    """The integer attributes of experts module `mod` that count its experts (``num_experts``): named for
    experts and equal to their number."""
    return tuple(sorted(n for n, v in vars(mod).items() if "expert" in n.lower() and type(v) is int and v == experts))


def plan_experts(builder) -> None:
    """The "pre_shard" build step: each expert-parallel module's local forward (NOTE [expert dispatch]),
    planned as its leaf (inside pipeline stages too: a stage calls the block's modules, and the replicas' average
    leaves the experts alone; under FSDP2's mixed-precision policy the experts, which FSDP2 leaves alone, are
    cast to its compute dtype as it casts the rest). Raises BuildError for what expert parallelism cannot
    reproduce exactly: no data parallelism over the expert axis, a split of each expert's weights whose parts
    do not sum to the whole (NOTE [experts split by tensor])."""
    paths = expert_paths(builder.v.extras)
    if not paths:
        return
    dp = builder.v.data_parallel
    for path, axes in paths.items():
        label = axes_label(axes)
        where = f"build: expert_parallel at sch[{path!r}] over {label!r}"
        outside = [a for a in axes if dp is None or a not in dp.axes]
        if outside:
            raise BuildError(f"{where}: the experts' axes must be data-parallel (each of their ranks routes its "
                             f"own tokens); {outside[0]!r} is not: add data_parallel(axis=...) holding {list(axes)}")
        m = builder.module(path)
        tensor = _tensor_axis(builder, m, axes, where)
        experts = experts_shape(path, m)
        size = math.prod(builder.sizes[a] for a in axes)
        if expert_fsdp(builder.v, axes)[0]:  # FSDP2 averages over the other data-parallel ranks
            grad_group, grad_scale = None, 1.0 / size  # NOTE [experts under FSDP2]
        else:
            rest = tuple(a for a in dp.axes if a not in axes)
            many = math.prod(builder.sizes[a] for a in rest) > 1
            grad_group = builder.mesh.flat_group(rest) if many else None
            grad_scale = 1.0 / dp.size(builder.mesh)
        kind = DenseExpertLeaf if experts_layout(m) == "dense" else ExpertLeaf  # NOTE [dense experts]
        leaf = kind(path=path, orig=m.forward, experts=experts, group=builder.mesh.flat_group(axes),
                    rank=builder.mesh.flat_rank(axes), size=size, grad_group=grad_group,
                    grad_scale=grad_scale, count_attrs=count_attrs(m, experts),
                    param_dtype=getattr(builder.mp_policy, "param_dtype", None),
                    tensor_group=builder.group(tensor) if tensor and builder.sizes[tensor] > 1 else None,
                    tensor_axis=tensor, load_imbalance=expert_load_imbalances(builder.v.extras).get(path, 1.0))
        builder.leaf[path] = LeafPlan(forward=leaf.forward)
        m._treadle_expert_leaf = leaf  # what `expert_loads` reads
        logger.info("expert parallel: %s: %d experts over %r (%d per rank)%s", path, experts, label,
                    experts // size, f", each split over {tensor!r}" if tensor else "")


def _tensor_axis(builder, m: nn.Module, axes: tuple[str, ...], where: str) -> str | None:
    """The tensor axis that splits each expert's weights (None: none), after checking that the split makes the
    parts sum to the whole (NOTE [experts split by tensor]). Raises BuildError for a split over several axes,
    over a data-parallel axis, or one whose parts do not sum to the whole."""
    other: dict[str, dict[str, list]] = {}
    for name, p in m.named_parameters(recurse=False):
        for s in builder.param_shards.get(id(p), ()):
            if s.axis not in axes:
                other.setdefault(s.axis, {}).setdefault(name, []).append(s)
    if not other:
        return None
    if len(other) > 1:
        raise BuildError(f"{where}: the experts' weights are split over mesh axes {sorted(other)}; each expert's "
                         f"weights split over one tensor axis at most")
    (tensor, shards), = other.items()
    if tensor in builder.v.data_parallel.axes:
        raise BuildError(f"{where}: the experts' weights {sorted(shards)} are split over data-parallel axis "
                         f"{tensor!r}, whose ranks route different rows; split them over a tensor axis")
    try:
        check_split(m, shards, tensor, builder.sizes[tensor], where=where)
    except ScheduleError as exc:
        raise BuildError(str(exc)) from None
    return tensor


@dataclass(frozen=True)
class ExpertLoad:
    """The routed rows each expert of one experts module computed over the steps since the last reading (every
    data-parallel replica's tokens), and `imbalance`: the busiest expert's rows over the mean (1.0: balanced;
    the step waits for the busiest rank of the expert axis); `ranks`: the expert axis's size, whose
    `rank_imbalance` is what `expert_parallel(load_imbalance=)` states (NOTE [expert load in a rehearsal])."""

    module: str
    rows: tuple[int, ...]
    ranks: int = 1  # the expert axis's size in the run that counted them

    @property
    def imbalance(self) -> float:
        mean = sum(self.rows) / len(self.rows) if self.rows else 0.0
        return max(self.rows) / mean if mean else 1.0

    def rank_imbalance(self, ranks: int) -> float:
        """The busiest rank's rows over the mean with the experts split over `ranks` ranks (rank r holding experts
        r*E/ranks .. (r+1)*E/ranks - 1, as `expert_parallel` places them): what `expert_parallel(load_imbalance=)`
        states for the price (NOTE [expert load in a rehearsal]). At most `imbalance`; equal to it with one expert
        a rank. Raises ValueError when `ranks` does not divide the experts."""
        e = len(self.rows)
        if ranks < 1 or e % ranks:
            raise ValueError(f"rank_imbalance: {e} experts of {self.module!r} do not split over {ranks} ranks")
        per = e // ranks
        return ExpertLoad(self.module, tuple(sum(self.rows[r * per:(r + 1) * per]) for r in range(ranks))).imbalance


def expert_loads(model: nn.Module) -> list[ExpertLoad] | None:
    """Per expert-parallel experts module of a built `model`, the rows each of its experts computed since the
    last call, summed over every rank (a collective: every rank calls it at the same steps); None when the model
    has no expert-parallel module."""
    leaves = [(p, m._treadle_expert_leaf) for p, m in model.named_modules() if hasattr(m, "_treadle_expert_leaf")]
    if not leaves:
        return None
    import torch.distributed as dist

    sizes = [leaf.experts for _, leaf in leaves]
    vec = torch.zeros(sum(sizes), dtype=torch.int64, device=next(model.parameters()).device)
    off = 0
    for (_, leaf), e in zip(leaves, sizes):
        local = leaf.take_load()
        start = off + leaf.rank * len(local)
        vec[start:start + len(local)] += torch.tensor(local, dtype=torch.int64, device=vec.device)
        off += e
    dist.all_reduce(vec)  # each expert's rows, from every replica of the expert axis that holds it
    out, off = [], 0
    for (path, leaf), e in zip(leaves, sizes):
        rows = tuple(int(v) for v in vec[off:off + e].tolist())
        out.append(ExpertLoad(path.removeprefix("module."), rows, leaf.size))
        off += e
    return out
