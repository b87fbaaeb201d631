"""The step time and peak memory of one choice of the planner's MILP, computed directly: the terms `ilp.py`
states with linear rows, summed without linearisation (the solver's report, the oracle's enumeration, the
explanation's split)."""

from __future__ import annotations

from ..form import forms
from . import policies, variants
from .cost_graph import CostGraph
from .grad_live import working_of


def evaluate(cg: CostGraph, choice: list[int], ckpt: dict[int, int],
             counts: dict[tuple[int, str], int] | None = None,
             pol: dict[tuple[int, str], int] | None = None) -> tuple[float, float, dict[str, float]]:
    """Step time and peak memory of a choice (`counts`: blocks per variant, NOTE [block variants]; `pol`: blocks
    per selective checkpoint policy, NOTE [checkpoint policies in the plan]), computed directly (no
    linearisation): the ILP's objective and memory constraint, in the same units. Also the split of the step time
    and memory by term."""
    compute = comm = 0.0
    static = act_out = 0.0
    for u, unit in enumerate(cg.units):
        c = unit.costs[choice[u]]
        compute += unit.count * c.compute_s
        comm += unit.count * c.comm_s
        static += unit.count * c.static_bytes
        if unit.template is None:
            act_out += c.act_bytes
    recompute = 0.0
    act_blocks = 0.0
    transient = 0.0
    for t, info in cg.templates.items():
        A = sum(cg.units[u].costs[choice[u]].act_bytes for u in info.units)
        F = sum(cg.units[u].costs[choice[u]].rec_s for u in info.units)
        In = info.input_bytes[choice[info.input_unit]] if info.input_unit is not None else 0.0
        c = ckpt.get(t, 0)
        recompute += c * (F + cg.ckpt_host_s.get(t, 0.0))
        act_blocks += (info.count - c) * A + c * In
        if c > 0:
            transient = max(transient, A)
    pol = {k: n for k, n in (pol or {}).items() if n}
    p_rec, p_act, p_trans = policies.evaluate(cg, choice, pol)
    recompute, act_blocks, transient = recompute + p_rec, act_blocks + p_act, max(transient, p_trans)
    transient = max(transient, working_of(cg, choice))  # NOTE [a backward's working set]
    counts = counts or {}
    var = variants.evaluate(cg, counts, ckpt)
    compute, comm, recompute = compute + var["compute_s"], comm + var["comm_s"], recompute + var["recompute_s"]
    static, act_out = static + var["static_bytes"], act_out + var["act_bytes"]
    acc = {"compute_s": compute, "comm_s": comm, "variants": counts}
    for f in forms():  # each form's terms (tensor parallelism: the input-gradient sums; sequence: the gathers'
        # credit; data: the exposed reductions, DDP's buffers)
        f.evaluate(cg, choice, acc)
    compute, comm = acc["compute_s"] + cg.host_s, acc["comm_s"]
    step = compute + comm + recompute
    peak = static + act_out + act_blocks + transient + cg.fixed_static_bytes
    # NOTE [the backward's end]: a form reads which templates have a block checkpointed, either way
    either = {t: ckpt.get(t, 0) + sum(n for (t2, _), n in pol.items() if t2 == t) for t in cg.templates}
    end = max((f.peak_bytes(cg, choice, either, counts) for f in forms()), default=0.0)
    if end > peak:
        transient += end - peak
        peak = end
    return step, peak, {"compute_s": compute, "comm_s": comm, "recompute_s": recompute,
                        "static_bytes": static, "activation_bytes": act_out + act_blocks,
                        "transient_bytes": transient, "fixed_bytes": cg.fixed_static_bytes}
