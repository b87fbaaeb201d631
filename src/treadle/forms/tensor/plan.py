"""Tensor parallelism in the planner: the input-gradient sums (Megatron's "f") a strategy needs, each stated once
in the MILP and charged once in a choice, and billed to one module in the explanation.

NOTE [shared input-gradient sum]: Megatron's "f" (the backward all-reduce of a replicated input read by
column-parallel ops) is keyed by (input node, tensor-axis index) -> seconds per execution in
`StrategyCost.grad_sums`, not in `comm_s`: the runtime sums the partial gradients of every column-parallel
leaf reading the very same tensor (q, k and v; gate and up) and reduces them once
(`treadle.runtime.build.Builder.shared_grad_all_reduce`), so the MILP charges each key once whichever
consumers need it (`ilp_rows`: y[key] >= s[u, k]). A node's own parameters (a norm's weight and bias) are
summed in one flat all-reduce (NOTE [one all-reduce per module] in `treadle.runtime.build`), keyed by the first
of them.
"""

from __future__ import annotations

import math

from ...cost.collective_cost import all_reduce_time_s
from ...cost.convert import grad_sum_ops
from ...planner.capture import Node, TensorMeta
from ...planner.ilp import _SECONDS
from ...planner.node_costs import _tensor_axes_divisor


def node_cost(b, n: Node, combo: tuple, pub: tuple, c, rec: str) -> None:
    """The input-gradient sums node `n` needs under `combo` (NOTE [shared input-gradient sum])."""
    # Megatron "f": a replicated input of an op sharded on a tensor axis gets a pending-sum gradient; this
    # op's parameters (a norm's weight and bias) are summed in one flat all-reduce (NOTE [one all-reduce per
    # module] in treadle.runtime.build), keyed by the first of them
    params: dict[int, tuple[int, float, int]] = {}  # tensor-axis index -> (first parameter node, bytes, count)
    for pos, j in enumerate(n.inputs):
        src = b.nodes[j]
        m = src.out
        if not isinstance(m, TensorMeta) or not b.rg[j]:
            continue
        pl = tuple(o.ins[pos] for o in combo)
        nbytes = m.nbytes / _tensor_axes_divisor(pl, b.tp_sizes) / b.dp_div(j)
        for k, o in enumerate(combo):
            if not o.grad_partial[pos]:  # NOTE [shared input-gradient sum]
                continue
            if src.kind == "param":
                first, total, count = params.get(k, (j, 0.0, 0))
                params[k] = (first, total + nbytes, count + 1)
            else:
                c.grad_sums[(b.canonical(j), k)] = _grad_sum_s(b, k, nbytes, 0)
    for k, (j, nbytes, count) in params.items():
        c.grad_sums[(b.canonical(j), k)] = _grad_sum_s(b, k, nbytes, count)


def _grad_sum_s(b, k: int, nbytes: float, n_params: int) -> float:
    """Seconds of one gradient sum over tensor axis `k`: the all-reduce and the runtime's local ops around it
    (`treadle.cost.convert.grad_sum_ops`), priced as `treadle.price` prices them."""
    fwd, bwd = grad_sum_ops(nbytes, n_params)
    return all_reduce_time_s(nbytes, b.tp_sizes[k], b.cluster.link(b.tp_axes[k])) + b.local_ops_s(fwd + bwd)


def grad_sum_keys(cg) -> dict[tuple[int, int, int], float]:
    """NOTE [shared input-gradient sum]: (input node, tensor axis, count) -> seconds of one execution's
    all-reduce, over every strategy that needs it."""
    out: dict[tuple[int, int, int], float] = {}
    for unit in cg.units:
        for c in unit.costs:
            for (j, k), t in c.grad_sums.items():
                key = (j, k, unit.count)
                out[key] = max(out.get(key, 0.0), t)
    return out


def chosen_grad_sums_s(cg, choice: list[int]) -> float:
    """Seconds of the input-gradient sums a choice needs, each distinct one once (times its count)."""
    keys: dict[tuple[int, int, int], float] = {}
    for u, unit in enumerate(cg.units):
        for (j, k), t in unit.costs[choice[u]].grad_sums.items():
            key = (j, k, unit.count)
            keys[key] = max(keys.get(key, 0.0), t)
    return math.fsum(n * t for (_, _, n), t in keys.items())


def ilp_rows(m, cg, s, shared: dict) -> None:
    """y[key] >= s[u,k] for every strategy that needs the gradient sum `key`; y costs count x seconds
    (family grad_sum). Hands the forms' rows ``shared["grad_sum_vars"]`` ({key: y variable}: a sequence-parallel
    gather replaces one) and ``shared["grad_sums"]`` ({y variable: count x seconds}: the data-parallel window)."""
    keys = grad_sum_keys(cg)
    ys = {key: m.var(ub=1.0, cost=key[2] * t * _SECONDS) for key, t in keys.items()}
    shared["grad_sum_vars"] = ys
    shared["grad_sums"] = {y: key[2] * keys[key] for key, y in ys.items()}
    for u, unit in enumerate(cg.units):
        for k, c in enumerate(unit.costs):
            for (j, a) in c.grad_sums:
                m.row({ys[(j, a, unit.count)]: 1.0, s[u, k]: -1.0}, 0.0, math.inf, "grad_sum")


def evaluate(cg, choice: list[int], acc: dict) -> None:
    """The sums a choice needs, each once: into ``acc["comm_s"]`` and, for the data-parallel window,
    ``acc["grad_sums_s"]``."""
    sums = chosen_grad_sums_s(cg, choice)
    acc["comm_s"] += sums
    acc["grad_sums_s"] = sums


def adjust_rows(cg, choice: list[int], rows: dict, shared: dict) -> None:
    """Bill each input-gradient sum once, to the module of the first unit that needs it; ``shared["billed"]``:
    (node, axis, count) -> the row path it went to (where a sequence-parallel gather's credit goes)."""
    billed = shared.setdefault("billed", {})
    for u, unit in enumerate(cg.units):
        c = unit.costs[choice[u]]
        parts = unit.parts[choice[u]] if unit.parts is not None else {unit.module: c}
        for module, part in parts.items():
            path = module or "<root>"
            for (j, a), t in part.grad_sums.items():
                if (j, a, unit.count) not in billed:
                    billed[(j, a, unit.count)] = path
                    rows[path].comm_s += unit.count * t
