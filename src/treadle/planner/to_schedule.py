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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import PlanError
from ..form import forms
from ..placement import placement_of as _placement
from ..placement import placement_str
from .cost_graph import CostGraph
from .policies import pick, spread as _spread  # noqa: F401  (`_spread`: where checkpoints go, re-exported)

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


# Where decisions stand in a plan, by rank: the layouts (shards, exit syncs, sequence parallelism's gathers at a
# module's input and slices where the blocks start, shard_attr, reduce_grads, fork_rng), the vocab-parallel loss,
# the checkpoints, and data parallelism last. A form's buckets (`DecisionContext.bucket`) and its other decisions
# (`treadle.form.Form.decisions`) take their rank from here.
DECISION_RANKS = {"shards": 10, "syncs": 20, "sp_inputs": 30, "sp_entries": 40, "attrs": 50, "grads": 60,
                  "rngs": 70, "loss": 75, "checkpoint": 80, "cut_pipeline_stage": 85, "pipeline": 86,
                  "data_parallel": 90, "expert_parallel": 95, "float8": 96}


def _members(cg: CostGraph, module: str, node_index: int) -> list[str]:
    """Real module paths that one canonical module path stands for (every block of its template)."""
    n = cg.graph.nodes[node_index]
    if n.block is None:
        return [module]
    blk = cg.graph.blocks[n.block]
    rel = module[len(blk.path):]
    return [m + rel for b in cg.graph.blocks if b.template == blk.template for m in b.members]


@dataclass(slots=True)
class DecisionContext:
    """What the decision builder and the forms' `decide_node` share: the solution, and the buckets decisions are
    collected in before they are emitted (`bucket`): {key: what to emit}, each bucket with its rank and emitter.
    The core's own: ``shards`` {(module, parameter, dim, axis, blocks): node}, ``syncs`` {(module, axis): {to,
    from_, node, layout}}, ``attrs``, ``grads``, ``rngs``."""

    cg: CostGraph
    choice: list[int]
    axes: tuple[str, ...]
    buckets: dict[str, tuple[int, Callable, dict]] = field(default_factory=dict)
    memo: dict[str, Any] = field(default_factory=dict)

    def bucket(self, name: str, rank: int = 0, emit: Callable | None = None) -> dict:
        """The bucket `name` (made on first use with its `rank` and `emit(items) -> [Decision]`)."""
        if name not in self.buckets:
            if emit is None:
                raise PlanError(f"decision bucket {name!r} is used before it is made with an emitter")
            self.buckets[name] = (rank, emit, {})
        return self.buckets[name][2]


def decisions_from_solution(cg: CostGraph, choice: list[int], ckpt: dict[int, int], *,
                            leaf_param: "callable[[str], bool]", stages: Any = None,
                            variants: dict | None = None, policies: dict | None = None) -> list[Decision]:
    """The module-level decisions of a solution, in a stable order (shards, syncs, the forms' own, grads, rng,
    ckpt, dp: `DECISION_RANKS`). `stages`: a pipeline solution's stages (`Solution.stages`), for the pipeline
    form's decisions (``ctx.memo["stages"]``); `variants`: its blocks per variant (``ctx.memo["variants"]``,
    NOTE [block variants]); `policies`: its blocks per (template, selective checkpoint policy) (NOTE [checkpoint
    policies in the plan])."""
    from .cost_graph import block_chains, exit_module
    from .views import view_attr_needs

    g = cg.graph
    axes = cg.roles.tp
    ctx = DecisionContext(cg, choice, axes)
    ctx.memo["stages"] = stages
    ctx.memo["variants"] = dict(variants or {})
    shards = ctx.bucket("shards", DECISION_RANKS["shards"], _emit_shards(axes))
    syncs = ctx.bucket("syncs", DECISION_RANKS["syncs"], _emit_syncs)
    attrs = ctx.bucket("attrs", DECISION_RANKS["attrs"], _emit_attrs)
    grads = ctx.bucket("grads", DECISION_RANKS["grads"], _emit_grads)
    rngs = ctx.bucket("rngs", DECISION_RANKS["rngs"], _emit_rngs)
    chain_k = block_chains(g.nodes, g.ops())  # NOTE [blocked split] in dims.py
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
            # the forms state some changes of layout their own way (NOTE [sequence parallel]); the rest is a sync
            # at the module's exit
            stated: set[str] = set()
            for f in forms():
                stated |= f.decide_node(ctx, i, n, combo, raw, pub)
            if raw != pub and any(a not in stated and r != p for a, r, p in zip(axes, raw, pub)):
                q = exit_module(g, n)
                # several axes change at one exit: each sync also carries the whole layout, so build converts
                # them in one step from the true source (one axis's from_ alone would call the others Replicate)
                whole = ({"from": {a: _pl_str(r) for a, r in zip(axes, raw)},
                          "to": {a: _pl_str(p) for a, p in zip(axes, pub)}}
                         if sum(r != p for r, p in zip(raw, pub)) > 1 else None)
                for a, r, p in zip(axes, raw, pub):
                    if r != p and a not in stated:
                        for m in _members(cg, q, i):
                            syncs[(m, a)] = {"to": _pl_str(p), "from_": _pl_str(r), "node": n.name, "layout": whole}
            in_loss = i in cg.replaced  # replaced at build (by the loss function): no view of its own
            for name, a in ([] if in_loss else view_attr_needs(n, combo, axes, cg.attr_resolver) or []):
                for m in _members(cg, n.module, i):
                    attrs[(m, name, a)] = n.name
            if (n.op_name in ("dropout", "native_dropout") or _sdpa_dropout(n)) and n.module:
                for a, o in zip(axes, combo):
                    if o.work_split:
                        for m in _members(cg, n.module, i):
                            rngs[(m, a)] = n.name
    ranked: list[tuple[int, str, Decision]] = []
    for rank, emit, items in sorted(ctx.buckets.values(), key=lambda b: b[0]):
        ranked += [(rank, "", d) for d in emit(items)]
    for t in sorted(set(ckpt) | {t for t, _ in (policies or {})}):
        info, c = cg.templates[t], ckpt.get(t, 0)
        own = {p: n for (t2, p), n in (policies or {}).items() if t2 == t and n}
        for m, p in sorted(pick(info.members, c, own).items(), key=lambda x: info.members.index(x[0])):
            n = c if p == "full" else own[p]
            why = f"{n} of {info.count} blocks like {info.path}" + ("" if p == "full" else f", policy {p}")
            ranked.append((DECISION_RANKS["checkpoint"], "",
                           Decision("checkpoint", m, {} if p == "full" else {"policy": p}, why)))
    # each parallel form's other decisions, placed by rank (the vocab-parallel loss after the layouts, data
    # parallelism last); a stable sort keeps each rank's own order
    ranked += [x for f in forms() for x in f.decisions(cg, choice, ckpt, ctx)]
    return [d for _, _, d in sorted(ranked, key=lambda x: (x[0], x[1]))]


def _emit_shards(axes: tuple[str, ...]) -> Callable[[dict], list[Decision]]:
    def emit(shards: dict) -> list[Decision]:
        # a dim split over several axes is sharded in mesh-axis order (the order slicing and layouts agree on)
        return [Decision("shard", m, {"names": pname, "dim": dim, "axis": a, **({"blocks": k} if k > 1 else {})}, why)
                for (m, pname, dim, a, k), why in sorted(shards.items(),
                                                         key=lambda kv: (*kv[0][:3], axes.index(kv[0][3])))]
    return emit


def _emit_syncs(syncs: dict) -> list[Decision]:
    out = []
    for (m, a), d in sorted(syncs.items()):
        args = {"mode": "fwd_post", "to": d["to"], "from_": d["from_"], "axis": a}
        if d["layout"] is not None:
            args["layout"] = d["layout"]
        out.append(Decision("sync", m, args, d["node"]))
    return out


def _emit_attrs(attrs: dict) -> list[Decision]:
    return [Decision("shard_attr", m, {"name": name, "axis": a}, f"fixed size in {why}")
            for (m, name, a), why in sorted(attrs.items())]


def _emit_grads(grads: dict) -> list[Decision]:
    return [Decision("reduce_grads", m, {"axis": a, "names": sorted(names)}, "replicated parameter, sharded data")
            for (m, a), names in sorted(grads.items())]


def _emit_rngs(rngs: dict) -> list[Decision]:
    return [Decision("fork_rng", m, {"axis": a}, why) for (m, a), why in sorted(rngs.items())]


def _sdpa_dropout(n) -> bool:
    """Attention with dropout inside (``dropout_p > 0``): on sharded heads each rank needs its own stream."""
    if "scaled_dot_product" not in n.op_name:
        return False
    names = [a.name for a in getattr(getattr(n.target, "_schema", None), "arguments", [])]
    pos = names.index("dropout_p") if "dropout_p" in names else None
    p = n.args[pos] if pos is not None and len(n.args) > pos else n.kwargs.get("dropout_p", 0.0)
    return isinstance(p, (int, float)) and p > 0


def _pl_str(p: int) -> str:
    return placement_str(p, token=True)



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
        elif d.op == "checkpoint":  # a policy name is checked by the primitive (NOTE [checkpoint policies as ...])
            sch[d.path].checkpoint(policy=d.args.get("policy", "full"))
        elif d.op == "set_attr":  # the Ref passes the gate a schedule file's Refs pass (NOTE [files are data])
            from .decision_check import decision_ref

            sch[d.path].set_attr(d.args["name"], decision_ref(d.args, where=f"decision set_attr at {d.path!r}"))
        elif d.op == "data_parallel":
            sch.data_parallel(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.args.items()})
        elif d.op == "expert_parallel":
            sch[d.path].expert_parallel(axis=d.args["axis"], tensor=d.args.get("tensor"),
                                        load_imbalance=d.args.get("load_imbalance", 1.0))
        elif d.op == "float8":
            sch[d.path].float8(recipe=d.args["recipe"], all_gather=d.args["all_gather"], skip=d.args.get("skip", ()))
        elif d.op == "cut_pipeline_stage":
            sch[d.path].cut_pipeline_stage()
        elif d.op == "pipeline":  # the example inputs as a spec (shapes and dtypes: data, NOTE [files are data])
            sch.pipeline(axis=d.args["axis"], schedule=d.args["schedule"], n_microbatches=d.args["n_microbatches"],
                         example_inputs=d.args["example_inputs"], target=d.args.get("target"))
        elif d.op != "shard":
            from ..errors import PlanError

            raise PlanError(f"apply_decisions: unknown decision op {d.op!r} at {d.path!r}; known: "
                            f"shard, sync, reduce_grads, fork_rng, shard_attr, checkpoint, set_attr, data_parallel, "
                            f"expert_parallel, float8, cut_pipeline_stage, pipeline")
    return sch


def decisions_python(decisions: list[Decision]) -> list[str]:
    """Decisions as schedule calls (what `plan.schedule.to_python()` prints for the real model)."""
    lines = []
    for d in decisions:
        a = dict(d.args)
        if d.op == "shard":
            lines.append(f"sch[{d.path!r}].shard({a['names']!r}, dim={a['dim']}, axis={a['axis']!r})")
        elif d.op == "sync":
            lines.append(f"sch[{d.path!r}].sync({a.get('mode', 'fwd_post')!r}, to={_pl(a['to'])}, axis={a['axis']!r})"
                         f"  # from {a['from_']}")
        elif d.op == "reduce_grads":
            lines.append(f"sch[{d.path!r}].reduce_grads(axis={a['axis']!r}, names={a['names']!r})")
        elif d.op == "shard_attr":
            lines.append(f"sch[{d.path!r}].shard_attr({a['name']!r}, axis={a['axis']!r})")
        elif d.op == "fork_rng":
            lines.append(f"sch[{d.path!r}].fork_rng(axis={a['axis']!r})")
        elif d.op == "checkpoint":
            pol = f"policy={a['policy']!r}" if a.get("policy", "full") != "full" else ""
            lines.append(f"sch[{d.path!r}].checkpoint({pol})")
        elif d.op == "data_parallel":
            extra = "".join(f", {k}={a[k]!r}" for k in ("replicate", "reshard_after_forward") if k in a)
            axis = a["axis"] if isinstance(a["axis"], str) else tuple(a["axis"])
            lines.append(f"sch.data_parallel(axis={axis!r}, shard={a['shard']}{extra})")
        elif d.op == "expert_parallel":
            tensor = f", tensor={a['tensor']!r}" if "tensor" in a else ""
            load = f", load_imbalance={a['load_imbalance']!r}" if "load_imbalance" in a else ""
            lines.append(f"sch[{d.path!r}].expert_parallel(axis={a['axis']!r}{tensor}{load})")
        elif d.op == "float8":
            skip = f", skip={a['skip']!r}" if "skip" in a else ""
            lines.append(f"sch[{d.path!r}].float8(recipe={a['recipe']!r}, all_gather={a['all_gather']}{skip})")
        elif d.op == "cut_pipeline_stage":
            lines.append(f"sch[{d.path!r}].cut_pipeline_stage()")
        elif d.op == "pipeline":
            lines.append(f"sch.pipeline(axis={a['axis']!r}, schedule={a['schedule']!r}, "
                         f"n_microbatches={a['n_microbatches']}, example_inputs=..., target={a.get('target')!r})")
        elif d.op == "set_attr":
            kw = ", ".join(f"{k}={v!r}" for k, v in a["kwargs"].items())
            lines.append(f"sch[{d.path!r}].set_attr({a['name']!r}, Ref({a['ref']!r}, {kw}))")
    return lines


def _pl(s: str) -> str:
    return "Replicate()" if s == "R" else "Partial()" if s == "P" else f"Shard({s[1:]})"


__all__ = ["Decision", "decisions_from_solution", "apply_decisions", "decisions_python"]
