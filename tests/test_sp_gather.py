"""NOTE [gather with a reduce-scatter backward] (treadle/forms/sequence/gather.py): which gathers qualify, the credit the ILP
gives them against a hand computation, and that `evaluate` agrees with the solver. The emitted form is verified
numerically in test_planner_vocab_sp.py (GPT-2 and LLaMA on gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from treadle.cost.collective_cost import all_reduce_time_s, reduce_scatter_time_s
from treadle.cost.convert import grad_sum_ops, runtime_ops
from treadle.planner import ilp
from treadle.planner.capture import capture
from treadle.planner.cost_graph import Roles
from treadle.forms.sequence.gather import active, consumer_module
from treadle.profile.roofline import op_time_s

from test_planner_vocab_sp import _cost_graph, cluster, inputs, llama  # noqa: E402


def _exit(g, module: str) -> int:
    """The last node of `module` read outside it (its output; an RMSNorm's no-op cast of its input is too)."""
    return max(n.index for n in g.nodes if n.kind == "op" and n.module == module
               and any(not g.nodes[u].module.startswith(module) for u in n.users))


def test_the_consumer_module_reads_no_other_value_with_a_gradient_from_outside():
    g = capture(llama(n_layer=4, kv=4), (), inputs(seq=64))
    norm1, norm2 = _exit(g, "model.layers.0.input_layernorm"), _exit(g, "model.layers.0.post_attention_layernorm")
    real = {n.index for n in g.nodes if n.kind == "op"}  # every op output "needs a gradient" below

    def no_tables(i: int) -> bool:  # the rotary tables and the mask need none
        return i in real and "rotary" not in g.nodes[i].module and g.nodes[i].module != "model"

    assert consumer_module(g, norm1, no_tables) == "model.layers.0.self_attn"
    assert consumer_module(g, norm2, no_tables) == "model.layers.0.mlp"
    # were the rotary tables differentiable, self_attn would read two such values: j may not be its input
    assert consumer_module(g, norm1, lambda i: i in real) is None
    assert consumer_module(g, norm2, lambda i: i in real) == "model.layers.0.mlp"
    # a value read inside its own producer's module, or outside the blocks, has none
    assert consumer_module(g, _exit(g, "model.embed_tokens"), lambda i: True) is None


def test_the_credit_is_all_reduce_minus_reduce_scatter_of_the_gathered_gradient():
    g, cg = _cost_graph(llama(n_layer=4, kv=4), inputs(seq=64), cluster(), Roles((), False, ("tp",)))
    sol = ilp.solve(cg, budget_bytes=None)
    act = active(cg, sol.choice)
    assert {(g.nodes[a.j].module, a.module) for a in act} == {
        ("model.layers.0.input_layernorm", "model.layers.0.self_attn"),
        ("model.layers.0.post_attention_layernorm", "model.layers.0.mlp")}
    link, nbytes = cluster().link("tp"), 8 * 64 * 128 * 4  # (B, T, E) fp32, whole on the tensor axis
    hw = cluster().rank_hardware()

    def ops(xs) -> float:  # the runtime's local ops (NOTE [copies]), priced as the price prices them
        return sum(op_time_s(0, 2 * x, hw, torch.float32) + hw.op_overhead_s for x in xs)

    for a in act:
        # the all-reduce of the summed gradient (a view forward, a clone backward) and the exit gather's backward
        # split, against the reduce-scatter with its packing
        plain = (all_reduce_time_s(nbytes, 2, link) + ops(sum(grad_sum_ops(nbytes), ()))
                 + ops(runtime_ops("all_gather", a.dim, nbytes / 2, 2)[1]))
        assert a.saving_s == pytest.approx(plain - reduce_scatter_time_s(nbytes, 2, link)
                                           - ops(runtime_ops("reduce_scatter", a.dim, nbytes, 2)[0]))
        assert a.count == 4 and a.dim in (0, 1)  # four real blocks; the row split the plan chose
    step, _, terms = ilp.evaluate(cg, sol.choice, {})
    assert sol.step_s == pytest.approx(step)
    cg.form_terms.pop("sequence")  # the same choice without the credit
    step0, _, terms0 = ilp.evaluate(cg, sol.choice, {})
    assert terms0["comm_s"] - terms["comm_s"] == pytest.approx(sum(a.count * a.saving_s for a in act))


def test_explain_rows_carry_the_credit_where_the_gradient_sum_was_billed():
    """`Plan.rows` bill each realised gather's credit to the row its input-gradient sum went to, so the rows'
    communication adds up to the solver's (no data parallelism here: nothing else in the total)."""
    from treadle.planner.rows import plan_rows as _rows

    g, cg = _cost_graph(llama(n_layer=4, kv=4), inputs(seq=64), cluster(), Roles((), False, ("tp",)))
    sol = ilp.solve(cg, budget_bytes=None)
    act = active(cg, sol.choice)
    assert act
    rows = _rows(cg, sol)
    assert sum(r.comm_s for r in rows) == pytest.approx(sol.terms["comm_s"])
    by_path = {r.path: r for r in rows}
    assert all(r.comm_s >= 0 for r in rows), {r.path: r.comm_s for r in rows if r.comm_s < 0}
    cg.form_terms.pop("sequence")  # without the credit the same rows carry the full all-reduces
    rows0 = {r.path: r for r in _rows(cg, sol)}
    moved = {p: rows0[p].comm_s - by_path[p].comm_s for p in by_path if rows0[p].comm_s != by_path[p].comm_s}
    assert sum(moved.values()) == pytest.approx(sum(a.count * a.saving_s for a in act))
    assert all(p.startswith(("model.layers.0.self_attn", "model.layers.0.mlp")) for p in moved), moved


def test_a_pipeline_credits_each_gather_on_the_stages_its_blocks_run_in(monkeypatch):
    # NOTE [pipeline in the plan]: the pipeline MILP states its own objective; each realised gather's credit comes
    # off the stages its blocks run in (k blocks of a stage: k x the credit a micro-batch), as `evaluate` does
    from treadle.forms.pipeline import cuts, milp
    from treadle.forms.sequence import SequenceParallelForm

    _, cg = _cost_graph(llama(n_layer=4, kv=4), inputs(seq=64), cluster((2, 2), ("pp", "tp")),
                        Roles((), False, ("tp",), pp="pp", pp_microbatches=2))
    lay = cuts._layout(cg, "1f1b")
    cut = cuts._cut(cg, lay, ((0, 1), (2, 3)))
    kw = dict(budget_bytes=None, checkpoint=True, time_limit_s=30, rel_gap=1e-9, min_ckpt={}, minimise="time")
    (choice, counts, *_), *_ = milp._solve_cut(cg, lay, cut, **kw)
    on = active(cg, choice)
    assert on  # on the slow tensor link Megatron's reduce-scatter pays inside the stages too
    step, _, terms = milp.evaluate(cg, lay, cut, choice, counts)
    with monkeypatch.context() as mp:
        mp.setattr(milp, "sp_active", lambda cg_, c_: [])
        plain = milp.evaluate(cg, lay, cut, choice, counts)
    credit = [sum(k_n * g.saving_s for g in on for st_, k_n in cut.mult.get(g.unit, []) if st_ == st)
              for st in range(2)]
    assert all(c > 0 for c in credit)
    assert [a - b for a, b in zip(plain[2]["stage_s"], terms["stage_s"])] == pytest.approx(credit, rel=1e-9)
    assert step < plain[0]
    # the MILP weighs it: without its credit rows it finds no plan faster by `evaluate`, which credits both
    with monkeypatch.context() as mp:
        mp.setattr(SequenceParallelForm, "ilp_rows", lambda self, m, cg_, s, shared: None)
        (blind, blind_counts, *_), *_ = milp._solve_cut(cg, lay, cut, **kw)
    assert milp.evaluate(cg, lay, cut, blind, blind_counts)[0] >= step * (1 - 1e-6)


def test_a_gather_read_through_a_reshape_is_credited_by_the_milp_as_by_evaluate():
    """GPT-2's Conv1D reads a flattened view of the norm's output: the input-gradient sum it replaces is keyed on
    that view (as the tensor form keys it). The credit once looked for the norm's own key, found no such sum in
    the MILP and was left out there, while `evaluate` granted it: plans the MILP ranked by one figure were
    reported by another. Now every candidate's sums exist, and the MILP's optimum realises the credit."""
    from treadle.forms.sequence.gather import terms
    from treadle.forms.tensor.plan import grad_sum_keys

    from test_planner_vocab_sp import gpt2

    g, cg = _cost_graph(gpt2(n_layer=4), inputs(seq=64), cluster(), Roles((), False, ("tp",)))
    keys = grad_sum_keys(cg)
    cands = terms(cg)
    assert cands and all(key in keys for c in cands for key in c.sums)
    assert any(key[0] != c.j for c in cands for key in c.sums)  # keyed on the reshape, not the norm
    sol = ilp.solve(cg, budget_bytes=None)
    assert {a.module for a in active(cg, sol.choice)} >= {"transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc"}
    # no plan under a budget is faster than the optimum without one (the MILP and evaluate agree)
    tight = ilp.solve(cg, budget_bytes=0.93 * sol.peak_bytes)
    assert tight.status == "optimal" and tight.step_s >= sol.step_s
