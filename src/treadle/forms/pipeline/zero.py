"""ZeRO-3 (FSDP2, HSDP) beside a planned pipeline: its terms in the pipeline MILP (NOTE [pipeline FSDP2 in the
plan]).

NOTE [pipeline FSDP2 in the plan]: with FSDP2 on each local stage (NOTE [pipeline FSDP2] in `fsdp.py`: every forward
gathers its stage and reshards after it, every backward gathers it again and keeps it, one reduce-scatter after the
stage's last backward), a stage's micro-batch moves, besides its compute, two all-gathers of each of its units (the
stage's blocks and its root) over the shard group: per micro-batch, 2 x (gathered bytes x the all-gather's slope +
units x its latency), and FSDP2's hooks on each unit in both (host time, `fsdp_host_s`). FSDP2 prefetches the next unit while the current one computes, so where the device overlaps
communication the stage takes the longer of its compute and its gathers (a variable bounded below by both), else
their sum. The reduce-scatter (HSDP: and the all-reduce of the shard over the replicate axes) runs once a step after
the last backward: in the rank's tail beside the optimizer, instead of the data form's per-step sync. Memory: the
parameters and optimizer states are the shard (the core's static bytes), but the gradients stay full-size until
the reduce-scatter, and while a stage runs it is gathered in full: each rank adds its stages' gradients' other
(n - 1)/n and its stages' gathered bytes. The slope of each collective is taken at a unit's size (a block's gathered
bytes), as the data form takes it (NOTE [bandwidth per byte]). FSDP2 copies stay the cost graph's (per step,
charged per micro-batch: an over-count by at most 3M / (2M + 1)).

Without reshard after forward (`reshard_after_forward=False`, as torchtitan sets it beside a pipeline) a stage is
gathered by its first forward and stays gathered to the step's end (the states of `fsdp.py`: 1F1B's and the
interleaved schedule's two local stages never leave the prefetch window): one all-gather of each unit a step, not
two a micro-batch. The planner charges it once, exposed, in the rank's tail beside the reduce-scatter (bandwidth,
latency and the gather's host bookkeeping), and per micro-batch only FSDP2's hooks on a gathered unit
(`fsdp_kept_host_s`, NOTE [FSDP2 units]). The peak is the same (the first backward gathers the whole stage while
every warm-up micro-batch is in flight, `test_keeping_stages_gathered_gathers_once_and_holds_the_same_peak_under_1f1b`);
the gathered bytes are then the cost graph's own (`gathered_kept` in its static bytes), not added again here.

With experts split over expert axes (`Roles.ep`, NOTE [experts in the plan]) a rank holds 1/e of each experts
module's weights, and FSDP2 shards those as units of their own over the shard axes the expert axes leave (m ranks;
NOTE [experts under FSDP2]), as build wraps them inside the stages and the pipeline's price charges them (NOTE
[pipeline FSDP2 price]): their gathers, reduce-scatter and HSDP all-reduce are on that group, their gradients' other
(m - 1)/m and their gathered bytes are held; with m = 1 FSDP2 leaves them alone (no gather, no extra bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...cost.collective_cost import all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s
from ...planner.capture import TensorMeta
from ...planner.node_costs import _tensor_axes_divisor
from ..data.facts import fsdp_host_s, fsdp_kept_host_s
from .cuts import _Cut, _step_time


@dataclass(slots=True)
class ZeroTerms:
    """A role assignment's ZeRO-3 beside its pipeline: `gathered[u][k]` bytes a unit's strategy gathers (its owned
    parameters in full, tensor shards divided), `grads[u][k]` its local gradients' bytes, the shard size `n`, the
    seconds per gathered byte of an all-gather (`ag_per_byte`) and of the step's reduce-scatter and HSDP all-reduce
    (`rs_per_byte`), one all-gather's latency (`ag_lat_s`), one unit's step-end latency (`rs_lat_s`), whether the
    device overlaps communication with compute (`overlap`), and FSDP2's host cost of one unit's hooks over a
    micro-batch (`unit_host_s`: half of `fsdp_host_s` a unit in its forward and in its backward, as the pipeline's
    price charges them)."""

    gathered: list[list[float]]
    grads: list[list[float]]
    n: int
    ag_per_byte: float
    rs_per_byte: float
    ag_lat_s: float
    rs_lat_s: float
    overlap: bool
    unit_host_s: float = 0.0  # FSDP2's hooks on one unit over a micro-batch's forward and backward
    experts: "ExpertUnits | None" = None  # the local experts' own units, where FSDP2 shards them (m > 1)
    reshard: bool = True  # reshard after forward; False: gathered once a step and kept (NOTE above)
    kept_host_s: float = 0.0  # FSDP2's hooks on one unit kept gathered over a micro-batch (`fsdp_kept_host_s`)

    def step_s(self, c) -> float:
        """One execution's (micro-batch's) seconds of a strategy `c`: kept gathered, FSDP2's copies and
        per-parameter host cost are the step's, not each micro-batch's (they go to `tail_s`)."""
        return _step_time(c) - (0.0 if self.reshard else c.fsdp_s)

    def tail_s(self, u: int, k: int, c) -> float:
        """Once-a-step seconds of unit u's strategy k (`c`): its optimizer step, `reduce_s`, and kept gathered
        FSDP2's copies and per-parameter host cost."""
        return c.opt_s + self.reduce_s(u, k) + (0.0 if self.reshard else c.fsdp_s)

    def _gather_once_s(self, u: int, k: int) -> float:
        own = self.experts.ag_per_byte * self.experts.gathered[u][k] if self.experts else 0.0
        return self.ag_per_byte * self.gathered[u][k] + own

    def gather_s(self, u: int, k: int) -> float:
        """Seconds of one micro-batch's two gathers of unit u's bytes under strategy k (bandwidth part); none
        without reshard after forward (gathered once a step: `reduce_s`)."""
        return 2 * self._gather_once_s(u, k) if self.reshard else 0.0

    def reduce_s(self, u: int, k: int) -> float:
        """Seconds of the step's reduce-scatter (and HSDP all-reduce) of unit u's bytes (bandwidth part), and
        without reshard after forward its one gather a step."""
        own = self.experts.rs_per_byte * self.experts.gathered[u][k] if self.experts else 0.0
        return self.rs_per_byte * self.gathered[u][k] + own + (0.0 if self.reshard else self._gather_once_s(u, k))

    def held(self, u: int, k: int) -> float:
        """Bytes a rank holds beyond the cost graph's sharded static bytes: `held_grads` and `held_gathered`."""
        return self.held_grads(u, k) + self.held_gathered(u, k)

    def held_grads(self, u: int, k: int) -> float:
        """The gradients' other (n - 1)/n (the local experts': their other (m - 1)/m): held from the stage's first
        backward (NOTE [a rank's memory at each moment] in `moments.py`)."""
        own = self.experts.gathered[u][k] * (1 - 1 / self.experts.m) if self.experts else 0.0
        return self.grads[u][k] * (1 - 1 / self.n) + own

    def held_gathered(self, u: int, k: int) -> float:
        """The gathered parameters (the local experts', gathered over m) while FSDP2 holds the stage gathered; 0
        without reshard after forward (the cost graph's static bytes hold them)."""
        if not self.reshard:
            return 0.0
        return self.gathered[u][k] + (self.experts.gathered[u][k] if self.experts else 0.0)


@dataclass(slots=True)
class ExpertUnits:
    """The local experts' FSDP2 units beside a pipeline (NOTE [pipeline FSDP2 in the plan]): `gathered[u][k]` the
    local experts' bytes a unit's strategy owns (1/e of theirs), sharded over `m` ranks, the seconds per byte of
    their two gathers and of their reduce-scatter (and HSDP all-reduce), one gather's and one step-end reduction's
    latency, and the experts modules per block (their units' count)."""

    gathered: list[list[float]]
    m: int
    ag_per_byte: float
    rs_per_byte: float
    ag_lat_s: float
    rs_lat_s: float
    per_block: float


def zero_terms(cg) -> ZeroTerms | None:
    """The ZeRO-3 terms of a pipeline role assignment (NOTE [pipeline FSDP2 in the plan]); None without ZeRO-3 over
    more than one rank."""
    roles = cg.roles
    mesh = cg.cluster.mesh
    n = math.prod(mesh.size(a) for a in roles.shard_axes) if roles.zero else 1
    if n <= 1:
        return None
    g = cg.graph
    tp_sizes = tuple(mesh.size(a) for a in roles.tp)
    owner: dict[str, int] = {}
    for i, node in enumerate(g.nodes):
        if node.kind == "op":
            for j in node.inputs:
                if g.nodes[j].kind == "param":
                    owner.setdefault(g.nodes[j].param, i)
    experts = set((((g.facts or {}).get("expert") or {}).get("experts") or {})) if roles.ep else set()
    ep_n = math.prod(mesh.size(a) for a in roles.ep)
    gathered, own = [], []
    for unit in cg.units:
        gu, ou = [], []
        for members in unit.strategies:
            b = e = 0.0
            for i, (combo, _) in members.items():
                node = g.nodes[i]
                for pos, j in enumerate(node.inputs):
                    src = g.nodes[j]
                    if src.kind == "param" and owner.get(src.param) == i and isinstance(src.out, TensorMeta):
                        pl = tuple(o.ins[pos] for o in combo)
                        x = src.out.numel * src.out.dtype.itemsize / _tensor_axes_divisor(pl, tp_sizes)
                        if g.param_modules.get(src.param) in experts:
                            e += x / ep_n  # this rank's experts (NOTE [experts in the plan])
                        else:
                            b += x
            gu.append(b)
            ou.append(e)
        gathered.append(gu)
        own.append(ou)
    link = cg.cluster.group_link(roles.shard_axes)
    blocks = max(1, sum(info.count for info in cg.templates.values()))
    ref = max(1.0, sum(max(gu) for gu in gathered) / blocks)  # a unit's gathered bytes, about a block's
    ag_lat = all_gather_time_s(0.0, n, link)
    rs_lat = reduce_scatter_time_s(0.0, n, link)
    ag = (all_gather_time_s(ref, n, link) - ag_lat) / ref
    rs = (reduce_scatter_time_s(ref, n, link) - rs_lat) / ref
    if roles.replicate:
        reps = math.prod(mesh.size(a) for a in roles.replicate)
        rlink = cg.cluster.group_link(roles.replicate)
        r_lat = all_reduce_time_s(0.0, reps, rlink)
        rs += (all_reduce_time_s(ref / n, reps, rlink) - r_lat) / ref
        rs_lat += r_lat
    # the gradients have the parameters' dtype and shards (every captured parameter trains)
    return ZeroTerms(gathered, gathered, n, ag, rs, ag_lat, rs_lat, cg.cluster.rank_device().overlap,
                     fsdp_host_s(1, 0, cg.cluster.rank_hardware()), _expert_units(cg, own, experts, blocks),
                     roles.reshard_after_forward, fsdp_kept_host_s(1, cg.cluster.rank_hardware()))


def _expert_units(cg, own: list[list[float]], experts: set, blocks: int) -> ExpertUnits | None:
    """The local experts' own FSDP2 units over the shard axes the expert axes leave (NOTE [pipeline FSDP2 in the
    plan]); None without experts split, or where no such axis is left (FSDP2 leaves them alone)."""
    roles, mesh = cg.roles, cg.cluster.mesh
    shard = tuple(a for a in roles.shard_axes if a not in roles.ep)
    m = math.prod(mesh.size(a) for a in shard)
    if not experts or m <= 1:
        return None
    link = cg.cluster.group_link(shard)
    ref = max(1.0, sum(max(ou) for ou in own) / max(1, len(experts)))  # about one experts module's local bytes
    ag_lat, rs_lat = all_gather_time_s(0.0, m, link), reduce_scatter_time_s(0.0, m, link)
    ag = (all_gather_time_s(ref, m, link) - ag_lat) / ref
    rs = (reduce_scatter_time_s(ref, m, link) - rs_lat) / ref
    rep = tuple(a for a in roles.replicate if a not in roles.ep)
    reps = math.prod(mesh.size(a) for a in rep)
    if reps > 1:
        rlink = cg.cluster.group_link(rep)
        r_lat = all_reduce_time_s(0.0, reps, rlink)
        rs += (all_reduce_time_s(ref / m, reps, rlink) - r_lat) / ref
        rs_lat += r_lat
    return ExpertUnits(own, m, ag, rs, ag_lat, rs_lat, len(experts) / blocks)


def _zero_constants(zt, cut: _Cut, ranks: list[list[int]]) -> tuple[list[float], list[float], list[float]]:
    """Per stage its gathers' latency per micro-batch (two of each unit: its blocks and a root) and FSDP2's hooks on
    its units (host time, beside the overlap), per rank the step-end reduce-scatters' latency (NOTE [pipeline FSDP2
    in the plan]); zeros without ZeRO-3."""
    S = len(cut.stages)
    if zt is None:
        return [0.0] * S, [0.0] * S, [0.0] * len(ranks)
    # a stage's FSDP2 units: its blocks, and a root where it holds parameters besides them (the embedding on the
    # first stage, the final norm and head on the last)
    units = [len(st) + (1 if i in (0, S - 1) else 0) for i, st in enumerate(cut.stages)]
    ex = zt.experts  # the local experts' own units, about `per_block` a block (NOTE [pipeline FSDP2 in the plan])
    own = [len(st) * ex.per_block if ex else 0.0 for st in cut.stages]
    gather = [u * zt.ag_lat_s + o * (ex.ag_lat_s if ex else 0.0) for u, o in zip(units, own)]  # one of each unit
    # kept gathered, a micro-batch runs the hooks alone; the gather's bookkeeping once a step, in the tail
    per_mb = zt.unit_host_s if zt.reshard else zt.kept_host_s
    once = 0.0 if zt.reshard else zt.unit_host_s - zt.kept_host_s
    return ([2 * x if zt.reshard else 0.0 for x in gather],
            [(u + o) * per_mb for u, o in zip(units, own)],
            [sum(units[st] * zt.rs_lat_s + own[st] * (ex.rs_lat_s if ex else 0.0)
                 + (0.0 if zt.reshard else gather[st] + (units[st] + own[st]) * once)
                 for st in mine) for mine in ranks])
