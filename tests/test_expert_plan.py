"""The planner weighs expert parallelism (NOTE [experts in the plan] in `treadle.forms.expert.plan`): the role
option, the experts' memory and exchanges in the cost graph against hand computation and the price, the MILP
against the exhaustive oracle, and a plan under a budget that does not hold every expert on each rank, which
picks the experts' split, fits as priced and verifies on 4 gloo ranks."""

from __future__ import annotations

import pytest

import treadle
from treadle.cost.cluster import parse_cluster
from treadle.cost.collective_cost import collective_time_s
from treadle.planner.capture import capture
from treadle.planner.cost_graph import build_cost_graph
from treadle.planner.roles import Roles, enumerate_roles

from test_moe import tiny_mixtral
from tiny_models import lm_inputs

BATCH, SEQ = 8, 16


@pytest.fixture(scope="module")
def graph():
    return capture(tiny_mixtral(), (), lm_inputs(BATCH, SEQ))


def test_the_expert_axis_is_a_data_parallel_axis_that_divides_the_experts():
    from treadle.mesh import Mesh

    facts = {"expert": {"experts": {"model.layers.0.mlp.experts": 4}}}
    roles = enumerate_roles(Mesh((2, 3), ("dp", "tp")), batch=12, facts=facts)
    with_ep = [r for r in roles if r.ep]
    assert with_ep and all(r.ep == "dp" and "dp" in r.dp for r in with_ep)  # 4 experts do not divide over 3
    assert {str(r) for r in with_ep} >= {"data-parallel dp; experts over dp; tensor tp"}
    assert not [r for r in enumerate_roles(Mesh((2, 3), ("dp", "tp")), batch=12) if r.ep]  # no experts, no option
    with pytest.raises(treadle.PlanError, match="expert axis 'tp' must be a data-parallel axis"):
        Roles(("dp",), False, ("tp",), ep="tp")


def test_the_exchanges_and_the_experts_memory_by_hand(graph):
    cl = parse_cluster("4x1:cpu")
    dp = build_cost_graph(graph, cl, Roles(("dp",), False, (), ("tp",)))
    ep = build_cost_graph(graph, cl, Roles(("dp",), False, (), ("tp",), ep="dp"))
    n, e, k, hidden = 4, 4, 2, 64
    rows = BATCH * SEQ // n * k  # this rank's routed pairs (balanced load)
    link = cl.link("dp")
    fwd = collective_time_s("all_to_all", e * 8, n, link) + 2 * collective_time_s("all_to_all", rows * hidden * 4, n,
                                                                                   link)
    bwd = 2 * collective_time_s("all_to_all", rows * hidden * 4, n, link)

    def totals(cg):
        choice = [0] * len(cg.units)  # the first strategy of every unit: all replicated here
        comm = sum(u.count * u.costs[0].comm_s for u in cg.units)
        static = sum(u.count * u.costs[0].static_bytes for u in cg.units)
        sync = sum(u.count * u.costs[0].dp_comm_s for u in cg.units)
        return choice, comm, static, sync

    _, comm_dp, static_dp, sync_dp = totals(dp)
    _, comm_ep, static_ep, sync_ep = totals(ep)
    assert comm_ep - comm_dp == pytest.approx(2 * (fwd + bwd), rel=1e-9)  # two MoE blocks
    experts = sum(m.numel for name, m in graph.params.items() if ".experts." in name)
    per = 2 * 4 + 8  # weight and gradient (fp32), AdamW's two moments
    assert static_dp - static_ep == pytest.approx(experts * per * (1 - 1 / n), rel=1e-9)
    assert sync_ep < sync_dp  # the experts' gradients left the data-parallel sync


def test_the_milp_agrees_with_the_exhaustive_oracle_under_an_expert_axis(graph):
    from treadle.planner.ilp import solve, solve_exhaustive

    cl = parse_cluster("4x1:cpu")
    cg = build_cost_graph(graph, cl, Roles(("dp",), False, (), ("tp",), ep="dp"))
    a = solve(cg, budget_bytes=None)
    b = solve_exhaustive(cg, budget_bytes=None)
    assert a.step_s == pytest.approx(b.step_s, rel=1e-6) and a.peak_bytes == pytest.approx(b.peak_bytes, rel=1e-6)


@pytest.mark.slow
def test_under_a_budget_the_plan_splits_the_experts_fits_as_priced_and_verifies():
    from treadle.planner import Plan, plan_model

    cl = parse_cluster("4x1:cpu")
    inputs = lm_inputs(BATCH, SEQ)
    free = plan_model(tiny_mixtral(), inputs, cluster=cl)
    assert "experts" not in free.roles  # without a budget the exchanges cost more than they save (this host)
    ddp = treadle.create_schedule(tiny_mixtral(), mesh=cl.mesh)
    ddp.data_parallel(axis="dp")
    budget = 0.7 * treadle.price(ddp, inputs, cl).peak_bytes  # DDP does not fit
    plan = plan_model(tiny_mixtral(), inputs, cluster=cl, memory_budget_bytes=budget)
    assert "experts over dp" in plan.roles, plan.solver["alternatives"]
    text = plan.schedule.to_python()
    assert "sch['model.layers.0.mlp.experts'].expert_parallel(axis='dp')" in text
    assert "sch['model.layers.1.mlp.experts'].expert_parallel(axis='dp')" in text
    priced = plan.estimate()
    assert priced.peak_bytes <= budget
    assert plan.estimated.peak_bytes == pytest.approx(priced.peak_bytes, rel=0.1)  # solver and price agree
    again = Plan.from_json(plan.to_json())  # a plan file holds the decisions and replays them
    assert again.schedule_for(tiny_mixtral()).to_python() == text
    assert treadle.verify(plan.schedule, inputs, steps=2, timeout_s=300).ok
