"""The expert load a schedule states (NOTE [expert load in a rehearsal]): `expert_parallel(load_imbalance=f)`
charges the busiest rank of the expert axis f times the mean routed rows, in the price (its exchanges at the larger
of the buffers it sends and receives, its experts' compute and saved activations) and in the planner (the same
terms in the cost graph; the plan states it), checked against hand computation; the value `treadle.run` logs
(`ExpertLoad.rank_imbalance`) against a count by hand; and the refusals."""

from __future__ import annotations

import math

import pytest

import treadle
from treadle.cost.cluster import parse_cluster
from treadle.cost.collective_cost import collective_time_s
from treadle.forms.expert import expert_parallel_moe
from treadle.forms.expert.runtime import ExpertLoad
from treadle.planner.capture import capture
from treadle.planner.cost_graph import build_cost_graph
from treadle.planner.roles import Roles
from treadle.schedule.replay import load_schedule

from test_moe import tiny_mixtral
from tiny_models import lm_inputs

BATCH, SEQ = 8, 16
LAYERS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")


def _ep(load: float = 1.0):
    cl = parse_cluster("4x1:cpu")
    sch = treadle.create_schedule(tiny_mixtral(), mesh=cl.mesh)
    sch.data_parallel(axis="dp")
    expert_parallel_moe(sch, axis="dp", load_imbalance=load)
    return sch, cl


def test_the_price_charges_the_busiest_rank_the_stated_load_by_hand():
    inputs = lm_inputs(BATCH, SEQ)
    (even, cl), (skew, _) = _ep(), _ep(1.5)
    p1, p2 = treadle.price(even, inputs, cl), treadle.price(skew, inputs, cl)
    tokens, k, hidden, n = BATCH // 4 * SEQ, 2, 64, 4  # this rank's tokens, top-2, 4 experts over 4 ranks
    got = 1.5 * tokens * k  # the busiest rank receives 1.5x the mean routed rows
    rows, weights = got * hidden * 4, got * 4  # fp32 rows and routing weights
    for layer in LAYERS:
        ep = [c for c in p2.collectives if c.get("source") == "ep" and c["module"] == layer]
        fwd = [(c["kind"], c["nbytes"]) for c in ep if c["phase"] == "fwd"]
        # the counts (unchanged), the rows and weights there (received: 1.5x), the results back (sent: 1.5x)
        assert fwd == [("all_to_all", 4 * 8), ("all_to_all", rows), ("all_to_all", weights), ("all_to_all", rows)]
        bwd = sorted((c["kind"], c["nbytes"]) for c in ep if c["phase"] == "bwd")
        assert bwd == sorted([("all_to_all", rows), ("all_to_all", weights), ("all_to_all", rows)])
        assert ep[1]["time_s"] == pytest.approx(collective_time_s("all_to_all", rows, n, cl.link("dp")))
    # the experts' products run on 1.5x the rows: 0.5x their balanced FLOPs more, forward and backward;
    # tiny Mixtral's expert: gate|up (2I x H) and down (H x I), I = 128
    inter = 128
    extra = 0.5 * tokens * k * 2 * (hidden * 2 * inter + inter * hidden) * 3 * len(LAYERS)  # fwd + 2x bwd
    assert p2.executed_flops - p1.executed_flops == pytest.approx(extra, rel=1e-9)
    assert p1.model_flops == p2.model_flops  # useful work is the model's, whatever the load
    for layer in LAYERS:
        row1 = next(r for r in p1.rows if r.module == layer and r.phase == "fwd")
        row2 = next(r for r in p2.rows if r.module == layer and r.phase == "fwd")
        assert row2.compute_s > row1.compute_s and row2.saved_bytes > row1.saved_bytes
    assert p2.step_s > p1.step_s and p2.activation_bytes > p1.activation_bytes
    assert p2.static_bytes == p1.static_bytes


def test_a_stated_load_is_recorded_as_data_and_replays():
    sch, _ = _ep(1.25)
    text = sch.to_python()
    assert "expert_parallel(axis='dp', load_imbalance=1.25)" in text
    again = load_schedule(tiny_mixtral(), sch.to_json())  # a schedule file states it as data
    assert again.to_python() == text
    assert again.view().extras["expert_load"] == {layer: 1.25 for layer in LAYERS}
    plain, _ = _ep()
    assert "load_imbalance" not in plain.to_python()  # balanced: nothing recorded, files as before


@pytest.mark.parametrize("bad", [0.5, math.nan, math.inf, True, "2"])
def test_a_load_imbalance_that_is_no_finite_number_at_least_1_is_refused(bad):
    sch = treadle.create_schedule(tiny_mixtral(), mesh=treadle.Mesh((4,), ("dp",)))
    sch.data_parallel(axis="dp")
    with pytest.raises(treadle.ScheduleError, match=r"expert_parallel at .*model\.layers\.0\.mlp\.experts.*"
                                                     r"load_imbalance must be a finite number >= 1"):
        sch["model.layers.0.mlp.experts"].expert_parallel(axis="dp", load_imbalance=bad)
    from treadle.planner import plan_model

    with pytest.raises(treadle.PlanError, match="plan_model: load_imbalance must be a finite number >= 1"):
        plan_model(tiny_mixtral(), lm_inputs(BATCH, SEQ), cluster=parse_cluster("4x1:cpu"),
                   expert_load_imbalance=bad)


def test_the_cost_graph_charges_the_stated_load_by_hand():
    graph = capture(tiny_mixtral(), (), lm_inputs(BATCH, SEQ))
    cl = parse_cluster("4x1:cpu")
    even = build_cost_graph(graph, cl, Roles(("dp",), False, (), ("tp",), ep="dp"))
    skew = build_cost_graph(graph, cl, Roles(("dp",), False, (), ("tp",), ep="dp", ep_load=2.0))
    n, e, k, hidden = 4, 4, 2, 64
    got = 2.0 * BATCH * SEQ // n * k
    link = cl.link("dp")
    pairs = 2 * collective_time_s("all_to_all", got * hidden * 4, n, link) + \
        collective_time_s("all_to_all", got * 4, n, link)
    for x in skew.form_terms["expert"].values():
        assert (x.fwd_s, x.bwd_s) == pytest.approx((collective_time_s("all_to_all", e * 8, n, link) + pairs, pairs))
    # the dispatch's own traffic is on the rows this rank routes: unchanged
    assert [(x.work_fwd_s, x.work_bwd_s) for x in skew.form_terms["expert"].values()] == \
        [(x.work_fwd_s, x.work_bwd_s) for x in even.form_terms["expert"].values()]

    three = build_cost_graph(graph, cl, Roles(("dp",), False, (), ("tp",), ep="dp", ep_load=3.0))

    def total(cg, field, only=None):  # first strategy of every unit (all replicated here)
        units = [u for u in cg.units if only is None or only(cg, u)]
        return sum(u.count * getattr(u.costs[0], field) for u in units)

    def touches(cg, u):  # a unit holding a node of an experts module
        return any(cg.graph.nodes[i].module.startswith(LAYERS) for i in u.nodes)

    def within(cg, u):  # a unit of experts-module nodes only, not the one whose first node dispatches
        return all(cg.graph.nodes[i].module.startswith(LAYERS) for i in u.nodes) and \
            not any(i in cg.form_terms["expert"] for i in u.nodes)

    for field in ("compute_s", "act_bytes"):
        # the experts modules' own work and saved bytes, C, are charged load x C: affine in the load, and C lies
        # between the units of experts nodes only and every unit that holds one
        c = total(skew, field) - total(even, field)
        assert total(three, field) - total(even, field) == pytest.approx(2 * c, rel=1e-9)
        assert total(even, field, within) <= c * (1 + 1e-9) and c <= total(even, field, touches) * (1 + 1e-9)
        assert c > 0
    # the exchanges are communication, not compute: comm grows by the exchanges' difference only
    dx = sum((x.fwd_s + x.bwd_s) - (y.fwd_s + y.bwd_s) for x, y in zip(skew.form_terms["expert"].values(),
                                                                       even.form_terms["expert"].values()))
    assert total(skew, "comm_s") - total(even, "comm_s") == pytest.approx(dx, rel=1e-9)
    assert str(skew.roles) == "data-parallel dp; experts over dp (busiest rank 2x the mean); off tp"
    with pytest.raises(treadle.PlanError, match="expert load imbalance .* without an expert axis"):
        Roles(("dp",), False, (), ep_load=2.0)


@pytest.mark.slow
def test_the_planner_weighs_the_stated_load_and_its_plan_states_and_prices_it():
    from treadle.planner import Plan, plan_model

    cl = parse_cluster("4x1:cpu")
    inputs = lm_inputs(BATCH, SEQ)
    ddp = treadle.create_schedule(tiny_mixtral(), mesh=cl.mesh)
    ddp.data_parallel(axis="dp")
    budget = 0.7 * treadle.price(ddp, inputs, cl).peak_bytes  # DDP does not fit: the experts must split
    plan = plan_model(tiny_mixtral(), inputs, cluster=cl, memory_budget_bytes=budget, expert_load_imbalance=1.5)
    assert "experts over dp (busiest rank 1.5x the mean)" in plan.roles, plan.solver["alternatives"]
    text = plan.schedule.to_python()
    for layer in LAYERS:
        assert f"sch['{layer}'].expert_parallel(axis='dp', load_imbalance=1.5)" in text
    priced = plan.estimate()  # the price reads the stated load from the schedule, as the solver charged it
    assert priced.peak_bytes <= budget
    assert plan.estimated.peak_bytes == pytest.approx(priced.peak_bytes, rel=0.1)
    assert plan.estimated.step_s == pytest.approx(priced.step_s, rel=0.25)
    even, diff = plan.what_if(expert_load_imbalance=1.0)  # "what if the router balanced its load?"
    assert plan.estimated.step_s > even.estimated.step_s  # the busiest rank is slower than the balanced one
    assert "load_imbalance" not in even.schedule.to_python() and diff
    again = Plan.from_json(plan.to_json())  # the plan file holds the load as data and replays it
    assert again.schedule_for(tiny_mixtral()).to_python() == text
    for bad in ("0.5", '"2"', "true"):  # a plan file stating a load that is no number >= 1 is refused on load
        tampered = plan.to_json().replace('"load_imbalance": 1.5', f'"load_imbalance": {bad}')
        assert tampered != plan.to_json()
        with pytest.raises(treadle.PlanError, match=r"expert_parallel at 'model\.layers\.0\.mlp\.experts'\): "
                                                     r"argument 'load_imbalance' must be load"):
            Plan.from_json(tampered)


def test_rank_imbalance_groups_the_experts_as_expert_parallel_places_them():
    load = ExpertLoad("m", (10, 30, 20, 20, 0, 40, 10, 30), ranks=4)
    assert load.imbalance == pytest.approx(40 / 20)
    assert load.rank_imbalance(4) == pytest.approx(max(40, 40, 40, 40) / 40)  # (10+30, 20+20, 0+40, 10+30)
    assert load.rank_imbalance(2) == pytest.approx(80 / 80)
    assert load.rank_imbalance(8) == load.imbalance  # one expert a rank
    assert ExpertLoad("m", (60, 20, 10, 10)).rank_imbalance(2) == pytest.approx(80 / 50)
    with pytest.raises(ValueError, match="4 experts of 'm' do not split over 3 ranks"):
        ExpertLoad("m", (1, 2, 3, 4)).rank_imbalance(3)


def test_the_price_says_what_load_it_assumed(tmp_path, capsys):
    from treadle.cli import main
    from treadle.models.zoo import named_model
    from treadle.schedule.expert_primitive import load_assumption

    plain, _ = _ep()
    assert load_assumption(plain.view().extras) == (
        "experts: 2 expert-parallel modules priced at a balanced load (assumed; state expert_parallel("
        "load_imbalance=) with the busiest / mean rank treadle.run logs)")
    assert load_assumption(treadle.create_schedule(tiny_mixtral(), mesh=treadle.Mesh((4,), ("dp",))).view().extras) \
        is None
    model, _ = named_model("tiny-mixtral", batch=8, seq=16)
    sch = treadle.create_schedule(model, mesh=treadle.Mesh((4,), ("dp",)))
    sch.data_parallel(axis="dp")
    sch["model.layers.0.mlp.experts"].expert_parallel(axis="dp", load_imbalance=1.5)
    sch["model.layers.1.mlp.experts"].expert_parallel(axis="dp")
    f = tmp_path / "schedule.json"
    f.write_text(sch.to_json())
    assert main(["price", str(f), "--model", "tiny-mixtral", "--cluster", "4x1:cpu", "--batch", "8",
                 "--seq", "16"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("experts: the busiest rank of the expert axis priced at 1.5x the mean routed rows in 1 of 2 "
            "expert-parallel modules (stated: load_imbalance)") in out
