"""Float8 in the planner (NOTE [execution and float8 in the plan] in `treadle.planner.validate`): the role option
`Roles.float8`, the linears it converts, the strategies they may take, and the `float8` decision.

Which linears: every `nn.Linear` of the repeated blocks (the blocks `treadle.run --compile` compiles:
`treadle.pricing.compiled.compiled_units`, one rule) whose dims the float8 kernels take and whose weight is its
own (the primitive's own checks, `treadle.schedule.float8_primitive`); the model's other linears (an output
projection, a router of odd width) stay in high precision, as torchtitan leaves them. The solver does not price
float8 (its terms are the same with and without it), and the price of the plans as built weighs the rest
(`treadle.planner.candidates.priced_candidates`: the best plans with and without float8 are both priced). Under the
role, a converted linear's ops on a tensor axis either stay replicated or split its weight (column or row parallel:
the tensorwise recipe only, NOTE [float8 under tensor parallelism]); never its tokens alone, whose amaxes build
does not reduce (`tensor_parallel_refusal`)."""

from __future__ import annotations

import math

from torch import nn

from ...planner.dims import R
from ...planner.to_schedule import DECISION_RANKS, Decision
from ...pricing.compiled import compiled_units
from ...schedule.float8_primitive import FLOAT8_ALIGN, float8_refusal, tensor_parallel_refusal, weight_users
from ...schedule.tree import within

DECISION_RANK = DECISION_RANKS["float8"]


def capture_facts(model: nn.Module) -> dict | None:
    """{"linears": {linear path: its block list's path}, "skip": {block list path: [the other linears in it]}}, or
    None when no block holds a linear float8 can take."""
    units = compiled_units(model)
    users = weight_users(model)
    linears: dict[str, str] = {}
    skip: dict[str, list[str]] = {}
    for path, m in model.named_modules():
        unit = next((u for u in units if within(path, u)), None)
        if unit is None or not isinstance(m, nn.Linear):
            continue
        lists = unit.rpartition(".")[0]
        if float8_refusal(m, users.get(id(m.weight), [])) is None:  # the primitive's own rule
            linears[path] = lists
        else:
            skip.setdefault(lists, []).append(path)
    if not linears:
        return None
    return {"linears": linears, "skip": {k: v for k, v in skip.items() if k in set(linears.values())}}


def _linears(facts) -> dict[str, str]:
    return ((facts or {}).get("float8") or {}).get("linears") or {}


def role_options(mesh, live, *, batch, request) -> list[dict] | None:
    """With float8 requested: each assignment with and without it (only with, when a partial schedule states it)."""
    if request.float8 is None or not _linears(request.facts):
        return None
    recipe, forced = request.float8
    return [{"float8": recipe}] if forced else [{}, {"float8": recipe}]


def keep_roles(options: dict) -> bool:
    return not (options.get("float8") and options.get("pp"))  # build refuses float8 with a pipeline


def role_label(roles) -> str | None:
    return f"float8 {roles.float8}" if roles.float8 else None


def keep_strategy(b, n, spec, combo: tuple) -> bool:
    """Under float8, a converted linear's ops on each tensor axis: replicated (no split input, output or work), or,
    with the tensorwise recipe, splitting the weight (NOTE [float8 under tensor parallelism])."""
    if b.roles.float8 is None or not combo:
        return True
    if not _inside(n.module, _linears(b.g.facts)):
        return True
    split_ok = tensor_parallel_refusal(b.roles.float8) is None
    return all(_replicated(o) or (split_ok and _splits_weight(b.g.nodes, n, o, k))
               for o, k in zip(combo, b.tp_sizes))


def _replicated(o) -> bool:
    return not o.work_split and all(p == R for p in o.ins + o.outs)


def _splits_weight(nodes, n, o, k: int) -> bool:
    """Whether option `o` of node `n` on an axis of size `k` splits an input made of parameters only (the weight,
    its transpose) into slices the float8 kernels take (`FLOAT8_ALIGN`, the build's check)."""
    split = [(p, nodes[j]) for p, j in zip(o.ins, n.inputs) if p != R and _of_params(nodes, j)]
    return bool(split) and all(p >= 0 and w.out.shape[p] % (k * FLOAT8_ALIGN) == 0 for p, w in split)


def _of_params(nodes, j: int, depth: int = 3) -> bool:
    node = nodes[j]
    if node.kind == "param":
        return True
    return (depth > 0 and node.kind == "op" and bool(node.inputs)
            and all(_of_params(nodes, i, depth - 1) for i in node.inputs))


def _owners(module: str) -> list[str]:
    """`module` and each of its ancestors."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _inside(module: str, linears: dict[str, str]) -> bool:
    return any(p in linears for p in _owners(module))


def decisions(cg, choice, ckpt, ctx) -> list:
    """``float8(recipe=, all_gather=, skip=[...])`` on each block list that holds a converted linear: FSDP2 gathers the
    weights in float8 under ZeRO-3 with the tensorwise recipe; skip names the list's other linears."""
    recipe = cg.roles.float8
    if recipe is None:
        return []
    facts = cg.graph.facts.get("float8") or {}
    mesh = cg.cluster.mesh
    gather = (cg.roles.zero and recipe == "tensorwise"
              and math.prod(mesh.size(a) for a in cg.roles.shard_axes) > 1)
    out = []
    for lists in sorted(set(facts.get("linears", {}).values())):
        args = {"recipe": recipe, "all_gather": bool(gather)}
        if facts.get("skip", {}).get(lists):
            args["skip"] = list(facts["skip"][lists])
        n = sum(1 for v in facts["linears"].values() if v == lists)
        out.append((DECISION_RANK, lists, Decision("float8", lists, args, f"{n} linears of the blocks in float8 "
                                                   f"(NOTE [execution and float8 in the plan])")))
    return out
