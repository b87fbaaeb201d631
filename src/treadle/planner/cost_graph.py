"""The cost graph: decision units (merged ops), their strategies with costs, and layout-equality edges.

Built for one *axis role assignment*: each mesh axis is either the data-parallel axis (at most one; the
batch is split over it for the whole model, weights replicated or ZeRO-3-sharded over it) or a tensor
axis (every op picks an option from the dimension algebra, `dims.py`). The ILP is solved per role
assignment and the best is kept (`plan.py`), so the optimum over assignments is exact.

NOTE [expressible plans]: the output is a module-level schedule, so a layout may change only where a
module hands its output to code outside it (``sync("fwd_post", to=...)``). A node's *published* layout
is its raw output layout, or — when the node is the single exit of its innermost module — Replicate,
priced by `treadle.cost.convert.plan_conversion` (forward and adjoint). Every consumer must read exactly
the published layout, which the ILP states as equalities of placement indicators, with no edge variables.
Parameters may be sharded only where the runtime has a sharded-compute rule for the owning leaf module
(`treadle.runtime.leaf_rules`); other parameters stay replicated on tensor axes, and when their gradient
is a pending sum there, `reduce_grads` is emitted and priced.

NOTE [instance weights]: a captured block instance stands for `Block.weight` real blocks; instances with
equal hashes share one unit per node. A unit's costs are per execution and multiplied by `Unit.count`,
the number of real executions; an equality edge is stated once per distinct (unit, unit, placement) pair.

NOTE [followers]: a node whose only variable input is one unit, and that has exactly one strategy per
strategy of that unit, is merged into it (its costs add to the leader's strategy). This is exact: the
follower's choice is forced by the equality edge anyway.

NOTE [bucketed data parallel] (the data-parallel form's terms): `treadle.forms.data.plan`.

Costs per strategy (per execution, per device, seconds and bytes) are computed in `node_costs.py`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cost.cluster import ClusterSpec
from ..errors import PlanError
from ..form import forms
from ..mesh import Mesh
from ..placement import P, R, pin_holds
from ..runtime.optimizer import adamw_fixed_s
from ..runtime.recompute import recompute_host_s, selective_host_s
from ..units import fmt_bytes
from .capture import CapturedGraph, Node, TensorMeta
from .dims import AxisOption, block_chain, dim_spec, strategies
from .node_costs import NodeCosts, StrategyCost
from .assembly import Assembly, Edge, TemplateInfo
from .floors import FloorTerms, OverMemoryFloor, memory_floor, unit_memory_mins
from .roles import Roles, TrainSpec
from .views import noop_cast, view_attr_needs

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class Unit:
    """One decision: a leader node (and its followers), `count` real executions, `template` block id or None."""

    leader: int
    nodes: list[int]
    count: int
    template: int | None
    strategies: list[dict[int, tuple[tuple[AxisOption, ...], tuple[int, ...]]]]  # node -> (combo, published)
    costs: list[StrategyCost]
    allowed: list[bool]
    module: str
    # NOTE [billing by module]: followers may come from other modules than the leader (GPT-2's GELU after
    # c_fc, LLaMA's rotary ops after q_proj); per strategy, the costs of each member's own module, kept only
    # when the members span several modules (else `module` gets all of `costs`)
    parts: list[dict[str, StrategyCost]] | None = None


@dataclass(slots=True)
class CostGraph:
    graph: CapturedGraph
    cluster: ClusterSpec
    roles: Roles
    units: list[Unit]
    edges: list[Edge]
    unit_of: dict[int, tuple[int, dict[int, int] | None]]  # node -> (unit, leader k -> own strategy) or identity
    templates: dict[int, "TemplateInfo"]
    unknown_flops: dict[str, int] = field(default_factory=dict)
    fixed_static_bytes: float = 0.0  # memory that no decision changes (buffers, user inputs)
    attr_resolver: Any = None
    model_flops: float = 0.0  # forward + backward FLOPs of one step, whole model (for MFU)
    host_s: float = 0.0  # host overheads fixed by the role (NOTE [framework overheads]): FSDP2 units, foreach lists
    ckpt_host_s: dict[int, float] = field(default_factory=dict)  # per template: host cost of checkpointing a block
    form_terms: dict[str, Any] = field(default_factory=dict)  # a parallel form's constants of the role, by form name
    replaced: frozenset[int] = frozenset()  # nodes a form replaces at build (the vocab-parallel loss's chain)
    variants: dict[int, list] = field(default_factory=dict)  # template -> its `variants.Variant`s (a form's)
    policies: tuple[str, ...] = ()  # selective checkpoint policies the MILP may use (NOTE [checkpoint policies in the plan])
    sac_host_s: dict[tuple[int, str], float] = field(default_factory=dict)  # per (template, policy): host cost a block


def exit_module(graph: CapturedGraph, node: Node) -> str | None:
    """The innermost module that `node` is the single exit of (all users outside it), or None."""
    q = node.module
    if not q or not isinstance(node.out, TensorMeta) or not node.users:
        return None
    for u in node.users:
        m = graph.nodes[u].module
        if m == q or m.startswith(q + "."):
            return None
    exits = [n for n in graph.nodes if n.kind == "op" and (n.module == q or n.module.startswith(q + "."))
             and not noop_cast(graph, n)
             and any(not (graph.nodes[u].module == q or graph.nodes[u].module.startswith(q + "."))
                     for u in n.users)]
    return q if len(exits) == 1 else None


def build_cost_graph(graph: CapturedGraph, cluster: ClusterSpec, roles: Roles, *,
                     train: TrainSpec = TrainSpec(), pins: dict[str, tuple[int, ...]] | None = None,
                     shardable: "callable[[str, str], set[tuple[int, ...]]] | None" = None,
                     dtype_compute: torch.dtype | None = None, attr_resolver=None,
                     budget_bytes: float | None = None, memo: dict | None = None) -> CostGraph:
    """Units, strategies and costs of `graph` on `cluster` under `roles`.

    `pins` maps a parameter name to its required placement on the tensor axes (codes per axis);
    `shardable(param, module)` returns the parameter placements (codes per tensor axis, besides all-R) the
    runtime can build for that parameter (default: none, i.e. everything replicated).
    `budget_bytes`: where given, raises `OverMemoryFloor` before the costs when no plan of the role assignment
    can fit it (NOTE [a memory floor before the costs]). `memo`: a dict the caller keeps for one captured graph,
    where each op's dimension spec and per-axis strategy combinations are kept by tensor sizes, and which of
    them divide by the sizes, the data-parallel size and which of its tensors carry the batch (they read nothing
    else); the search passes one per `plan_model` call.
    Raises PlanError if a pin names an unknown parameter or can never be met.
    """
    b = _Builder(graph, cluster, roles, train, pins or {}, shardable, dtype_compute)
    b.attr_resolver = attr_resolver
    b.budget_bytes = budget_bytes
    b.memo = memo
    cg = b.build()
    cg.attr_resolver = attr_resolver
    return cg


class _Builder(NodeCosts, Assembly):
    def __init__(self, graph, cluster, roles, train, pins, shardable, dtype_compute):
        self.g = graph
        self.nodes = graph.nodes
        self.cluster = cluster
        self.roles = roles
        self.train = train
        self.pins = pins
        self.shardable = shardable or (lambda p, m: set())
        self.hw = cluster.rank_hardware()  # NOTE [rank device] in treadle.cost.cluster
        mesh = cluster.mesh
        self.tp_axes = roles.tp
        self.tp_sizes = tuple(mesh.size(a) for a in self.tp_axes)
        self.dp_size = math.prod(mesh.size(a) for a in roles.dp)  # replicas: the batch divisor
        if roles.pp is not None:  # a pipeline's costs are per micro-batch (`treadle.forms.pipeline.plan`)
            self.dp_size *= roles.pp_microbatches
        # how parameters live (the data-parallel form's `prepare` sets them under ZeRO-3): split over
        # `param_divisor` ranks, tensor subclasses in the optimizer step, kept gathered from forward to backward
        self.param_divisor = 1
        self.param_subclass = False
        self.gathered_kept = False
        # parameter name -> the ranks a form other than data parallelism splits it over and reduces it itself
        # (the expert form's `prepare`: the experts over the expert axis; data parallelism leaves them alone)
        self.own_split: dict[str, int] = {}
        # parameter name -> the ranks its gathered copy is split over, for such a parameter FSDP2 also shards on
        # axes of its own (the experts under ZeRO-3: NOTE [experts in the plan]); kept without reshard
        self.own_gathered: dict[str, int] = {}
        # modules whose outputs leave them replicated on every tensor axis, whatever their ops' layouts: a form's
        # own module forward reduces at its exit (the experts' local forward sums over the experts' tensor axis:
        # NOTE [experts in the plan]); set by a form's `prepare`
        self.replicated_exits: set[str] = set()
        # the tensor axes' links and device, without the copy rate: the local ops around a conversion are priced
        # as `treadle.price` prices the ops it records (`NodeCosts.layout_change_s`, NOTE [copies]), not twice
        self.sub_cluster = (ClusterSpec(Mesh(self.tp_sizes, self.tp_axes), tuple(cluster.link(a) for a in self.tp_axes),
                                        cluster.device) if self.tp_axes else None)
        for p in pins:
            if p not in graph.params:
                raise PlanError(f"pin on parameter {p!r}: no such parameter in {graph.model_class}; "
                                f"parameters look like {sorted(graph.params)[:3]}")
        self.unknown_flops: dict[str, int] = {}
        self.dtype_compute = dtype_compute
        self._grad_bytes: float | None = None  # NodeCosts.replicated_grad_bytes
        self._uses, self._traffic = {}, {}  # NodeCosts.grad_uses, NodeCosts.traffic: per node
        # block -> its last node whose ops save a tensor (NOTE [recompute stops early] in saved.py)
        self.last_packer: dict[int, int] = {}
        for b, blk in enumerate(graph.blocks):
            saving = [i for i in blk.nodes if graph.packers and i in graph.packers]
            if saving:
                self.last_packer[b] = max(saving)
        self.attr_resolver = None
        self.budget_bytes: float | None = None  # NOTE [a memory floor before the costs]
        self.memo: dict | None = None  # (op node, tensor sizes, ...) -> its strategies: `build_cost_graph`

    # ------------------------------------------------------------------ per-node facts
    def canonical(self, i: int) -> int:
        """The node of the template instance standing for node i (itself outside repeated blocks)."""
        n = self.nodes[i]
        if n.block is None:
            return i
        b = self.g.blocks[n.block]
        if b.template == n.block:
            return i
        t = self.g.blocks[b.template]
        return t.nodes[b.nodes.index(i)]

    def count(self, i: int) -> int:
        """Real executions of the canonical node i: the sum of the weights of all instances it stands for."""
        n = self.nodes[i]
        if n.block is None:
            return 1
        t = self.g.blocks[n.block].template
        return sum(b.weight for b in self.g.blocks if b.template == t)

    def _batch(self) -> None:
        """Which values carry the batch (split over the dp axis) and which need gradients."""
        self.carry = [False] * len(self.nodes)
        self.rg = [False] * len(self.nodes)
        for n in self.nodes:
            if n.kind == "input":
                self.carry[n.index] = True
            elif n.kind == "param":
                self.rg[n.index] = True
            elif n.kind == "op":
                self.carry[n.index] = any(self.carry[i] for i in n.inputs)
                out = n.out[0] if isinstance(n.out, tuple) and n.out else n.out
                self.rg[n.index] = (any(self.rg[i] for i in n.inputs) and isinstance(out, TensorMeta)
                                    and out.dtype.is_floating_point)

    def local_dp_shape(self, i: int, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dp_size > 1 and self.carry[i] and shape and shape[0] % self.dp_size == 0:
            return (shape[0] // self.dp_size,) + tuple(shape[1:])
        return tuple(shape)

    def dp_div(self, i: int) -> int:
        return self.dp_size if self.carry[i] else 1

    # ------------------------------------------------------------------ strategies
    def node_strategies(self, n: Node) -> list[tuple[tuple[AxisOption, ...], tuple[int, ...]]]:
        key = (n.index, self.tp_sizes)  # both read only the graph and the tensor sizes
        got = self.memo.get(key) if self.memo is not None else None
        if got is None:
            got = dim_spec(n, self.nodes)
            got = (got, strategies(n, self.nodes, got, self.tp_sizes))
            if self.memo is not None:
                self.memo[key] = got
        spec, combos = got
        # which combinations divide: read only the sizes, the data-parallel size and which tensors carry the batch
        dkey = ("divisible", n.index, self.tp_sizes, self.dp_size, self.carry[n.index],
                tuple(self.carry[j] for j in n.inputs))
        divides = self.memo.get(dkey) if self.memo is not None else None
        if divides is None:
            divides = tuple(self._divisible(n, combo) for combo in combos)
            if self.memo is not None:
                self.memo[dkey] = divides
        out: list = []
        exitable = self.exit_of.get(n.index) is not None
        is_output = n.index in self.g.outputs
        fused = self.chain_k.get(n.index) and len(n.out.shape) - 1  # NOTE [blocked split] in dims.py
        for combo, ok in zip(combos, divides):
            if not ok or not self._inputs_ok(n, combo):
                continue
            if fused and sum(1 for o in combo if o.outs[0] == fused) > 1:
                continue  # interleaved blocks over two axes: the runtime splits blocks on one axis only
            if not all(f.keep_strategy(self, n, spec, combo) for f in forms()):
                continue  # a form cannot run it (the vocab-parallel loss: only on its cross-entropy; NOTE
                # [sequence parallel]: no row shard into a reshape with a literal row size)
            if n.index not in self.replaced and view_attr_needs(n, combo, self.tp_axes, self.attr_resolver) is None:
                continue  # (a node a form replaces at build, e.g. by the loss function, keeps no view of its own)
            raw = tuple(o.outs[0] for o in combo) if combo else ()
            # a row-parallel op with a bias: the runtime adds the bias once, when the sum is reduced at the
            # module's exit, so a Partial value leaving a module that holds such an op must be reduced there
            affine_partial = P in raw and self._leaves(n) and n.module in self.biased_modules
            if any(p != R for p in raw) and self._leaves_replicated(n):
                out.append((combo, tuple(R for _ in raw)))  # the module's own forward hands its output on whole
                continue
            if (not is_output or all(p == R for p in raw)) and not affine_partial:
                out.append((combo, raw))
            if exitable and any(p != R for p in raw) and not (fused and fused in raw):
                out.append((combo, tuple(R for _ in raw)))
            # what a form may publish besides (NOTE [sequence parallel]: row shards at a block's module exits)
            out += [(combo, pub) for f in forms() for pub in f.extra_publishes(self, n, raw, exitable)]
        return out

    def _leaves(self, n: Node) -> bool:
        """Whether some user of `n` runs outside n's innermost module."""
        q = n.module
        return any(not (self.nodes[u].module == q or self.nodes[u].module.startswith(q + ".")) for u in n.users)

    def _leaves_replicated(self, n: Node) -> bool:
        """Whether `n` hands a value out of a module in `replicated_exits` (which publishes it Replicate)."""
        for q in self.replicated_exits:
            if n.module == q or n.module.startswith(q + "."):
                return any(not (self.nodes[u].module == q or self.nodes[u].module.startswith(q + "."))
                           for u in n.users)
        return False

    def _divisible(self, n: Node, combo: tuple[AxisOption, ...]) -> bool:
        """Every sharded dim divides on the data-parallel-local shape (the dims rules checked global sizes)."""
        if not combo:
            return True
        checks = [(self.nodes[j].out, j, tuple(o.ins[pos] for o in combo)) for pos, j in enumerate(n.inputs)]
        outs = n.out if isinstance(n.out, tuple) else (n.out,)
        checks += [(m, n.index, tuple(o.outs[k] if k < len(o.outs) else R for o in combo)) for k, m in enumerate(outs)]
        for meta, j, pl in checks:
            if not isinstance(meta, TensorMeta):
                continue
            shape = list(self.local_dp_shape(j, meta.shape))
            for p, size in zip(pl, self.tp_sizes):
                if p >= 0:
                    if p >= len(shape) or shape[p] % size:
                        return False
                    shape[p] //= size
        return True

    def _inputs_ok(self, n: Node, combo: tuple[AxisOption, ...]) -> bool:
        for pos, i in enumerate(n.inputs):
            src = self.nodes[i]
            pl = tuple(o.ins[pos] for o in combo)
            if src.kind in ("input", "buffer", "const"):
                if any(p != R for p in pl):
                    return False
            elif src.kind == "param":
                if any(p == P for p in pl):
                    return False
                pin = self.pins.get(src.param)
                if pin is not None and not pin_holds(pl, pin):
                    return False
                if any(p != R for p in pl) and pl not in self.shardable(src.param, n.module):
                    return False
                # a replicated parameter with a pending-sum gradient on a tensor axis: allowed only where
                # the runtime can reduce it (reduce_grads on a module that is not a sharded leaf)
                if any(o.grad_partial[pos] for o in combo) and self.shardable(src.param, n.module):
                    return False
        return True

    # ------------------------------------------------------------------ costs
    def build(self) -> CostGraph:
        self._batch()
        self._mark_saved()
        self.replaced: set[int] = set()  # nodes a form replaces at build (the loss function's ops)
        for f in forms():
            f.prepare(self)
        # canonical op nodes in order
        canon_ops = [n for n in self.nodes if n.kind == "op" and self.canonical(n.index) == n.index]
        self.exit_of = {n.index: exit_module(self.g, n) for n in canon_ops}
        self.chain_k = block_chains(self.nodes, canon_ops)
        self.biased_modules = {n.module for n in canon_ops if _has_bias(n)}
        self.param_owner: dict[str, int] = {}
        for n in canon_ops:
            for j in n.inputs:
                if self.nodes[j].kind == "param":
                    self.param_owner.setdefault(self.nodes[j].param, n.index)
        self.flop_cache = {n.index: self._flops(n) for n in canon_ops}
        node_strats: dict[int, list] = {}
        for n in canon_ops:
            s = self.node_strategies(n)
            if not s:
                err = PlanError(f"op {n.name} ({n.op_name}) at {n.module or '<root>'} has no strategy that meets "
                                f"the pins and the runtime's sharding rules on {self.roles}")
                err.node_index = n.index  # for `pin_check` (which pin, and why)
                raise err
            node_strats[n.index] = s
        # followers
        unit_of: dict[int, tuple[int, dict[int, int] | None]] = {}
        units: list[Unit] = []
        leader_unit: dict[int, int] = {}
        for n in canon_ops:
            i = n.index
            var_inputs = {self.canonical(j) for j in n.inputs if self.nodes[j].kind == "op"}
            mapping = None
            if len(var_inputs) == 1:
                u = next(iter(var_inputs))
                mapping = self._follow(n, u, node_strats, unit_of, units)
            if mapping is not None:
                uidx, _ = unit_of[next(iter(var_inputs))]
                unit_of[i] = (uidx, mapping)
                units[uidx].nodes.append(i)
                for k, l in mapping.items():
                    units[uidx].strategies[k][i] = node_strats[i][l]
                continue
            strat = node_strats[i]
            unit = Unit(i, [i], self.count(i), self._template(i),
                        [{i: s} for s in strat], [StrategyCost() for _ in strat], [True] * len(strat), n.module)
            unit_of[i] = (len(units), None)
            leader_unit[i] = len(units)
            units.append(unit)
        templates = self._templates(units, unit_of, node_strats)
        fixed = sum(n.out.nbytes / self.dp_div(n.index) for n in self.nodes
                    if n.kind in ("buffer", "const", "input") and isinstance(n.out, TensorMeta))
        if self.budget_bytes is not None:  # NOTE [a memory floor before the costs]
            floor = self._memory_floor(units, templates, fixed)
            if floor > self.budget_bytes * (1 + 1e-9):
                raise OverMemoryFloor(f"{self.roles}: every plan needs at least {fmt_bytes(floor)} per device "
                                      f"(the memory floor), over the budget {fmt_bytes(self.budget_bytes)}", floor)
        # costs
        for unit in units:
            mixed = len({self.nodes[i].module for i in unit.nodes}) > 1
            if mixed:
                unit.parts = [{} for _ in unit.strategies]
            for k, members in enumerate(unit.strategies):
                total = unit.costs[k]
                for i, (combo, pub) in members.items():
                    c = self.strategy_cost(self.nodes[i], combo, pub)
                    _add_cost(total, c)
                    if mixed:
                        _add_cost(unit.parts[k].setdefault(self.nodes[i].module, StrategyCost()), c)
        edges = self._edges(units, unit_of, node_strats)
        model_flops = 0.0
        for n in canon_ops:
            f, b = self.flop_cache[n.index]
            model_flops += (f + b) * self.count(n.index)
        cg = CostGraph(self.g, self.cluster, self.roles, units, edges, unit_of, templates,
                       unknown_flops=dict(self.unknown_flops), fixed_static_bytes=fixed, model_flops=model_flops,
                       replaced=frozenset(self.replaced), policies=tuple(self.train.checkpoint_policies))
        self._host_terms(cg)
        for f in forms():  # each form's constants of the role (data parallelism: NOTE [bucketed data parallel])
            f.graph_terms(self, cg)
        logger.debug("cost graph %s: %d units (%d strategies), %d edges, %d templates", self.roles, len(units),
                     sum(len(u.strategies) for u in units), len(edges), len(templates))
        return cg

    def _memory_floor(self, units: list[Unit], templates: dict[int, TemplateInfo], fixed: float) -> float:
        """The memory floor of the role assignment (NOTE [a memory floor before the costs]): each unit's smallest
        static and saved bytes over its strategies (`strategy_memory`), read by the form that owns the step's
        formula (`Form.memory_floor`; a pipeline's), else by `memory_floor`."""
        mins = [unit_memory_mins(unit, self.nodes, self.strategy_memory) for unit in units]
        static_min, act_min, base_min = ([x[j] for x in mins] for j in range(3))
        ft = FloorTerms(self.g, self.cluster, self.roles, units, templates, static_min, act_min, base_min, fixed)
        for f in forms():
            own = f.memory_floor(ft)
            if own is not None:
                return own
        return memory_floor(ft)

    def _host_terms(self, cg: CostGraph) -> None:
        """NOTE [framework overheads] (treadle.profile.hardware), as the price charges them: a checkpointed block costs
        `treadle.runtime.recompute.recompute_host_s` of its region and ops (and a dispatch per detach of an activation
        it saves again); the optimizer its list ops (`adamw_fixed_s`). (FSDP2's units: the data form's terms.)"""
        hw = self.hw
        for t, info in cg.templates.items():
            nodes = [i for u in info.units for i in cg.units[u].nodes]
            ops = sum(self.op_counts(i)[0] for i in nodes if self.recomputed(i) != "none")  # NOTE [ops per node]
            # NOTE [recompute stops early]: and a detach of every activation the block saves again
            detaches = sum((self.g.packs or {}).get(i, 0) for i in nodes)
            cg.ckpt_host_s[t] = recompute_host_s(hw, ops=ops + detaches, regions=1) + detaches * hw.op_overhead_s
            for p, facts in (self.g.sac or {}).items():  # NOTE [ops a policy keeps]: what the policy recomputes
                ops_p = sum(self.op_counts(i)[0] - facts[i].kept_ops for i in nodes
                            if i in facts and self.recomputed(i) != "none")
                fwd_ops = sum(self.op_counts(i)[0] for i in nodes)  # the dispatch modes see every op
                cg.sac_host_s[t, p] = (recompute_host_s(hw, ops=ops_p + detaches, regions=1)
                                       + detaches * hw.op_overhead_s
                                       + selective_host_s(hw, ops=fwd_ops + ops_p, regions=1))
        cg.host_s += adamw_fixed_s(hw, subclass=self.param_subclass)

def _add_cost(total: StrategyCost, c: StrategyCost) -> None:
    total.compute_s += c.compute_s
    total.comm_s += c.comm_s
    total.fwd_s += c.fwd_s
    total.rec_s += c.rec_s
    total.bwd_s += c.bwd_s
    total.w_s += c.w_s
    total.bwd_comm_s += c.bwd_comm_s
    total.dp_comm_s += c.dp_comm_s
    total.opt_s += c.opt_s
    total.fsdp_s += c.fsdp_s
    total.act_bytes += c.act_bytes
    total.work_bytes = max(total.work_bytes, c.work_bytes)
    total.static_bytes += c.static_bytes
    total.grad_bytes += c.grad_bytes
    total.static_grad_bytes += c.static_grad_bytes
    total.w_held_bytes += c.w_held_bytes
    for key, t in c.grad_sums.items():  # one tensor's gradient sum, whichever member needs it
        total.grad_sums[key] = max(total.grad_sums.get(key, 0.0), t)
    for p, (k, r, sv) in c.sac.items():  # NOTE [ops a policy keeps] (every op of a block has every policy's)
        k0, r0, s0 = total.sac.get(p, (0.0, 0.0, 0.0))
        total.sac[p] = (k0 + k, r0 + r, s0 + sv)


def block_chains(nodes: list[Node], ops) -> dict[int, int]:
    """Node -> k for every node on a blocked split's chain (NOTE [blocked split] in dims.py)."""
    out: dict[int, int] = {}
    for n in ops:
        chain = block_chain(n, nodes)
        if chain:
            for j in chain[0]:
                out[j] = chain[1]
    return out


def _has_bias(n: Node) -> bool:
    return (n.op_name == "linear" and len(n.inputs) > 2) or n.op_name in ("addmm", "baddbmm")


__all__ = ["Roles", "TrainSpec", "StrategyCost", "Unit", "Edge", "CostGraph", "TemplateInfo",
           "build_cost_graph", "exit_module", "noop_cast", "view_attr_needs", "block_chains"]
