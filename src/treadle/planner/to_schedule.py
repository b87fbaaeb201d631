"""Turn a solved cost graph into plan *decisions* (plain data) and decisions into a treadle Schedule.

Decisions are module-level: parameter shards (``shard``), layout changes at a module's exit
(``sync("fwd_post", to=...)``) or, for the sequence slice where the residual stream enters the repeated
blocks, at the first block's input (``sync("fwd_pre", to=Shard(d))``), the vocab-parallel loss
(``set_attr("loss_function", Ref(...))``), gradient reductions of replicated parameters that see sharded data
(``reduce_grads``), per-rank random streams for sharded dropout (``fork_rng``), checkpointed blocks
(``checkpoint``, spread evenly over a template's blocks) and the data-parallel axis (``data_parallel``).
Each decision carries the graph nodes that justify it (`why`), so `Plan.explain` can answer "why".
Decisions in a repeated block are expanded to every real block the template stands for.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .cost_graph import CostGraph
from .dims import R, P

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Decision:
    """One schedule primitive as data: `op` in {"shard", "sync", "shard_attr", "reduce_grads", "fork_rng",
    "checkpoint", "data_parallel", "set_attr"}, the module `path`, and its arguments; `why` names the graph
    node(s) behind it. A ``set_attr`` value is a `treadle.schedule.log.Ref` as data: ``ref`` and ``kwargs``."""

    op: str
    path: str
    args: dict = field(default_factory=dict)
    why: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, *, where: str = "plan decision") -> "Decision":
        """A decision read from a plan file, checked as data (`treadle.planner.decision_check`, NOTE [files
        are data]). Raises PlanError naming `where`, the op and the argument at fault."""
        from ..errors import PlanError
        from .decision_check import check_decision

        if not isinstance(d, dict):
            raise PlanError(f"{where}: a decision must be an object, got {type(d).__name__}")
        op, path, args, why = d.get("op"), d.get("path"), d.get("args", {}), d.get("why", "")
        check_decision(op, path, args, why, where=where)
        return cls(op, path, dict(args), why)

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.args.items())
        return f'sch["{self.path}"].{self.op}({args})'


def _members(cg: CostGraph, module: str, node_index: int) -> list[str]:
    """Real module paths that one canonical module path stands for (every block of its template)."""
    n = cg.graph.nodes[node_index]
    if n.block is None:
        return [module]
    blk = cg.graph.blocks[n.block]
    rel = module[len(blk.path):]
    return [m + rel for b in cg.graph.blocks if b.template == blk.template for m in b.members]


def _spread(members: list[str], count: int) -> list[str]:
    """`count` of `members`, evenly spaced (the first and last included when count >= 2)."""
    if count <= 0:
        return []
    if count >= len(members):
        return list(members)
    step = len(members) / count
    return [members[int(i * step)] for i in range(count)]


def decisions_from_solution(cg: CostGraph, choice: list[int], ckpt: dict[int, int], *,
                            leaf_param: "callable[[str], bool]") -> list[Decision]:
    """The module-level decisions of a solution, in a stable order (shards, syncs, grads, rng, ckpt, dp)."""
    g = cg.graph
    axes = cg.roles.tp
    shards: dict[tuple[str, str, int, str, int], str] = {}
    syncs: dict[tuple[str, str], dict] = {}
    grads: dict[tuple[str, str], set[str]] = {}
    rngs: dict[tuple[str, str], str] = {}
    attrs: dict[tuple[str, str, str], str] = {}
    losses: list[Decision] = []
    entries: dict[tuple[str, str], dict] = {}
    from .cost_graph import block_chains, entry_block, exit_module, view_attr_needs
    from .sp_gather import active
    chain_k = block_chains(g.nodes, g.ops())  # NOTE [blocked split] in dims.py
    # NOTE [gather with a reduce-scatter backward] in sp_gather.py: gathered at the consumer module's input
    sp_in = {(sg.j, axes[sg.k]): sg for sg in active(cg, choice)}
    inputs: dict[tuple[str, str], dict] = {}
    for u, unit in enumerate(cg.units):
        members = unit.strategies[choice[u]]
        for i, (combo, pub) in members.items():
            n = g.nodes[i]
            raw = tuple(o.outs[0] for o in combo)
            for pos, j in enumerate(n.inputs):
                src = g.nodes[j]
                if src.kind != "param":
                    continue
                owner = g.param_modules[src.param]
                pname = src.param[len(owner) + 1:] if owner else src.param
                for a, o in zip(axes, combo):
                    pl = o.ins[pos]
                    if pl >= 0:
                        # the fused output dim of a blocked split's linear: k interleaved blocks
                        k = chain_k[i] if i in chain_k and o.outs[0] == len(n.out.shape) - 1 else 1
                        for m in _members(cg, owner, i):
                            shards[(m, pname, pl, a, k)] = n.name
                    elif o.grad_partial[pos] and not leaf_param(src.param):
                        for m in _members(cg, owner, i):
                            grads.setdefault((m, a), set()).add(pname)
            blk = entry_block(g, n) if raw != pub else None
            if blk is not None and all(r in (R, P) for r in raw) and any(p >= 0 for p in pub):
                # NOTE [sequence parallel] in extra_layouts.py: a pending sum is reduced at its module's exit,
                # then the value is sliced at the input of the block it enters
                q = exit_module(g, n)
                for a, r, p in zip(axes, raw, pub):
                    if r == P:
                        for m in _members(cg, q, i):
                            syncs[(m, a)] = {"to": "R", "from_": "P", "node": n.name, "layout": None}
                    if p >= 0:
                        entries[(blk, a)] = {"to": _pl_str(p), "node": n.name}
            elif raw != pub:
                q = exit_module(g, n)
                # several axes change at one exit: each sync also carries the whole layout, so build converts
                # them in one step from the true source (one axis's from_ alone would call the others Replicate)
                whole = ({"from": {a: _pl_str(r) for a, r in zip(axes, raw)},
                          "to": {a: _pl_str(p) for a, p in zip(axes, pub)}}
                         if sum(r != p for r, p in zip(raw, pub)) > 1 else None)
                for a, r, p in zip(axes, raw, pub):
                    if r != p and (i, a) in sp_in:
                        for m in _members(cg, sp_in[(i, a)].module, i):
                            inputs[(m, a)] = {"dim": _pl_str(r), "node": n.name}
                    elif r != p:
                        for m in _members(cg, q, i):
                            syncs[(m, a)] = {"to": _pl_str(p), "from_": _pl_str(r), "node": n.name, "layout": whole}
            in_loss = any(i in v.chain for v in cg.vocab_ce.values())  # replaced with the loss function
            for name, a in ([] if in_loss else view_attr_needs(n, combo, axes, cg.attr_resolver) or []):
                for m in _members(cg, n.module, i):
                    attrs[(m, name, a)] = n.name
            vce = cg.vocab_ce.get(i)  # NOTE [vocab-parallel loss] in extra_layouts.py
            for a, o in zip(axes, combo):
                if vce is not None and o.letter == vce.letter:
                    losses.append(Decision("set_attr", "", {"name": "loss_function", "ref": _VOCAB_LOSS,
                                                            "kwargs": {"axis": a, "causal": vce.causal}},
                                           f"vocab-parallel cross-entropy {n.name} of {vce.head}"))
            if (n.op_name in ("dropout", "native_dropout") or _sdpa_dropout(n)) and n.module:
                for a, o in zip(axes, combo):
                    if o.work_split:
                        for m in _members(cg, n.module, i):
                            rngs[(m, a)] = n.name
    out: list[Decision] = []
    # a dim split over several axes is sharded in mesh-axis order (the order slicing and layouts agree on)
    for (m, pname, dim, a, k), why in sorted(shards.items(), key=lambda kv: (*kv[0][:3], axes.index(kv[0][3]))):
        out.append(Decision("shard", m, {"names": pname, "dim": dim, "axis": a, **({"blocks": k} if k > 1 else {})},
                            why))
    for (m, a), d in sorted(syncs.items()):
        args = {"mode": "fwd_post", "to": d["to"], "from_": d["from_"], "axis": a}
        if d["layout"] is not None:
            args["layout"] = d["layout"]
        out.append(Decision("sync", m, args, d["node"]))
    for (m, a), d in sorted(inputs.items()):
        why = f"{d['node']} gathered here; its gradient reduce-scattered"
        out.append(Decision("sync", m, {"mode": "fwd_pre", "to": "R", "from_": d["dim"], "axis": a}, why))
        out.append(Decision("sync", m, {"mode": "bwd_post", "to": d["dim"], "from_": "P", "axis": a}, why))
    for (m, a), d in sorted(entries.items()):
        out.append(Decision("sync", m, {"mode": "fwd_pre", "to": d["to"], "from_": "R", "axis": a},
                            f"{d['node']} enters the blocks"))
    for (m, name, a), why in sorted(attrs.items()):
        out.append(Decision("shard_attr", m, {"name": name, "axis": a}, f"fixed size in {why}"))
    for (m, a), names in sorted(grads.items()):
        out.append(Decision("reduce_grads", m, {"axis": a, "names": sorted(names)},
                            "replicated parameter, sharded data"))
    for (m, a), why in sorted(rngs.items()):
        out.append(Decision("fork_rng", m, {"axis": a}, why))
    out += losses
    for t, c in sorted(ckpt.items()):
        info = cg.templates[t]
        for m in _spread(info.members, c):
            out.append(Decision("checkpoint", m, {}, f"{c} of {info.count} blocks like {info.path}"))
    if cg.roles.dp:
        out.append(Decision("data_parallel", "", data_parallel_args(cg.roles), str(cg.roles)))
    return out


def data_parallel_args(roles) -> dict:
    """`Schedule.data_parallel` keyword arguments for `roles` (a cost_graph.Roles with dp axes): one axis as
    a name, several as a list; ZeRO-3 names its shard axes, HSDP adds `replicate`, and
    ``reshard_after_forward=False`` only when set."""
    axes = list(roles.shard_axes if roles.zero else roles.dp)
    args: dict = {"axis": axes[0] if len(axes) == 1 else axes, "shard": roles.zero}
    if roles.replicate:
        args["replicate"] = roles.replicate[0] if len(roles.replicate) == 1 else list(roles.replicate)
    if roles.zero and not roles.reshard_after_forward:
        args["reshard_after_forward"] = False
    return args


def _sdpa_dropout(n) -> bool:
    """Attention with dropout inside (``dropout_p > 0``): on sharded heads each rank needs its own stream."""
    if "scaled_dot_product" not in n.op_name:
        return False
    names = [a.name for a in getattr(getattr(n.target, "_schema", None), "arguments", [])]
    pos = names.index("dropout_p") if "dropout_p" in names else None
    p = n.args[pos] if pos is not None and len(n.args) > pos else n.kwargs.get("dropout_p", 0.0)
    return isinstance(p, (int, float)) and p > 0


_VOCAB_LOSS = "treadle.runtime.losses:VocabParallelLoss"


def _pl_str(p: int) -> str:
    return "R" if p == R else "P" if p == P else f"S{p}"


def _placement(s: str):
    return Replicate() if s == "R" else Partial() if s == "P" else Shard(int(s[1:]))


def apply_decisions(sch, decisions: list[Decision], *, leaf_module: "callable[[str], bool]"):
    """Apply decisions to a Schedule (``treadle.create_schedule(model, mesh=...)``) and return it.

    A sync at a leaf the runtime shards (Linear, Conv1D, Embedding) derives its collective from the
    leaf's layout; elsewhere, and for a slice of a replicated output, the source layout is given (``from_``)."""
    shard_groups: dict[tuple[str, int, str, int], list[str]] = {}
    for d in decisions:
        if d.op == "shard":
            key = (d.path, d.args["dim"], d.args["axis"], int(d.args.get("blocks", 1)))
            shard_groups.setdefault(key, []).append(d.args["names"])
    for (path, dim, axis, blocks), names in shard_groups.items():
        sch[path].shard(names if len(names) > 1 else names[0], dim=dim, axis=axis,
                        **({"blocks": blocks} if blocks > 1 else {}))
    whole_done: set[tuple[str, str]] = set()
    for d in decisions:
        if d.op == "sync" and "layout" in d.args:  # one typed sync over every mesh axis (others Replicate)
            if (d.path, d.args["mode"]) not in whole_done:
                whole_done.add((d.path, d.args["mode"]))
                lay = d.args["layout"]
                sch[d.path].sync(d.args["mode"], to=[_placement(lay["to"].get(ax, "R")) for ax in sch.mesh.names],
                                 from_=[_placement(lay["from"].get(ax, "R")) for ax in sch.mesh.names])
        elif d.op == "sync":
            kw = {"to": _placement(d.args["to"]), "axis": d.args["axis"]}
            if (not leaf_module(d.path) or d.args["from_"] == "R"  # a replicated leaf has no rule-derived layout
                    or d.args["mode"] != "fwd_post"):  # an input's layout is never derived
                kw["from_"] = _placement(d.args["from_"])
            sch[d.path].sync(d.args["mode"], **kw)
        elif d.op == "reduce_grads":
            sch[d.path].reduce_grads(axis=d.args["axis"], names=list(d.args["names"]))
        elif d.op == "fork_rng":
            sch[d.path].fork_rng(axis=d.args["axis"])
        elif d.op == "shard_attr":
            sch[d.path].shard_attr(d.args["name"], axis=d.args["axis"])
        elif d.op == "checkpoint":
            sch[d.path].checkpoint()
        elif d.op == "set_attr":  # the Ref passes the gate a schedule file's Refs pass (NOTE [files are data])
            from .decision_check import decision_ref

            sch[d.path].set_attr(d.args["name"], decision_ref(d.args, where=f"decision set_attr at {d.path!r}"))
        elif d.op == "data_parallel":
            sch.data_parallel(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.args.items()})
        elif d.op != "shard":
            from ..errors import PlanError

            raise PlanError(f"apply_decisions: unknown decision op {d.op!r} at {d.path!r}; known: "
                            f"shard, sync, reduce_grads, fork_rng, shard_attr, checkpoint, set_attr, data_parallel")
    return sch


__all__ = ["Decision", "decisions_from_solution", "apply_decisions"]
