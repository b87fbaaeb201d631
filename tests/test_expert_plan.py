"""The planner weighs expert parallelism (NOTE [experts in the plan] in `treadle.forms.expert.plan`): the role
option, the experts' memory and exchanges in the cost graph against hand computation and the price, the MILP
against the exhaustive oracle, and a plan under a budget that does not hold every expert on each rank, which
picks the experts' split, fits as priced and verifies on 4 gloo ranks."""

from __future__ import annotations

import pytest

import treadle
from treadle.cost.cluster import parse_cluster
from treadle.cost.collective_cost import collective_time_s
from treadle.profile.roofline import memory_time_s
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


def test_the_exchanges_and_the_experts_memory_by_hand(graph, monkeypatch):
    from treadle.forms.expert import plan as expert_plan

    cl = parse_cluster("4x1:cpu")
    dp = build_cost_graph(graph, cl, Roles(("dp",), False, (), ("tp",)))
    ep = build_cost_graph(graph, cl, Roles(("dp",), False, (), ("tp",), ep="dp"))
    n, e, k, hidden = 4, 4, 2, 64
    rows = BATCH * SEQ // n * k  # this rank's routed pairs (balanced load)
    link = cl.link("dp")
    # the rows there and back and their routing weights there (fp32), forward; their adjoints backward
    pairs = 2 * collective_time_s("all_to_all", rows * hidden * 4, n, link) + \
        collective_time_s("all_to_all", rows * 4, n, link)
    fwd = collective_time_s("all_to_all", e * 8, n, link) + pairs
    bwd = pairs
    # the dispatch's own memory traffic on compute: 7 + 6 reads or writes of every row (NOTE [expert dispatch])
    hw = cl.rank_hardware()
    work = (memory_time_s(7 * rows * hidden * 4, hw), memory_time_s(6 * rows * hidden * 4, hw))

    def totals(cg):
        choice = [0] * len(cg.units)  # the first strategy of every unit: all replicated here
        comm = sum(u.count * u.costs[0].comm_s for u in cg.units)
        static = sum(u.count * u.costs[0].static_bytes for u in cg.units)
        sync = sum(u.count * u.costs[0].dp_comm_s for u in cg.units)
        compute = sum(u.count * u.costs[0].compute_s for u in cg.units)
        return compute, comm, static, sync

    compute_dp, comm_dp, static_dp, sync_dp = totals(dp)
    compute_ep, comm_ep, static_ep, sync_ep = totals(ep)
    assert comm_ep - comm_dp == pytest.approx(2 * (fwd + bwd), rel=1e-9)  # two MoE blocks
    exchanges = ep.form_terms["expert"]
    assert len(exchanges) == 2
    for x in exchanges.values():
        assert (x.fwd_s, x.bwd_s) == pytest.approx((fwd, bwd), rel=1e-9)
        assert (x.work_fwd_s, x.work_bwd_s) == pytest.approx(work, rel=1e-9)
    # the dispatch's traffic is on compute, forward and backward, in each of the two MoE blocks
    monkeypatch.setattr(expert_plan, "dispatch_traffic", lambda pairs, row_bytes: (0.0, 0.0))
    compute_bare = totals(build_cost_graph(graph, cl, Roles(("dp",), False, (), ("tp",), ep="dp")))[0]
    assert compute_ep - compute_bare == pytest.approx(2 * sum(work), rel=1e-9)
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


def test_under_zero3_the_experts_unit_shards_over_the_other_axes_by_hand(graph):
    # 2x2 mesh, ZeRO-3 over both axes, experts over the second: FSDP2 shards the experts over the first as a unit
    # of its own (NOTE [experts in the plan]); the experts hold 1/4 of their bytes, as every other parameter
    from treadle.cost.collective_cost import all_gather_time_s, reduce_scatter_time_s
    from treadle.forms.data.facts import fsdp_copy_s, fsdp_host_s

    cl = parse_cluster("2x2:cpu")
    a, b = cl.mesh.names
    zero = build_cost_graph(graph, cl, Roles((a, b), True, ()))
    ep = build_cost_graph(graph, cl, Roles((a, b), True, (), ep=b))
    static = [sum(u.count * u.costs[0].static_bytes for u in cg.units) for cg in (zero, ep)]
    assert static[1] == pytest.approx(static[0], rel=1e-9)  # 1/2 (experts) x 1/2 (FSDP2) = 1/4 (FSDP4)
    link, hw = cl.group_link((a,)), cl.rank_hardware()
    units = list(ep.form_terms["expert"].values())
    assert len(units) == 2 and units[0] == units[1]  # one per MoE block
    x = units[0]
    local = sum(m.numel * 4 for name, m in graph.params.items()
                if name.startswith("model.layers.0.mlp.experts.")) / 2  # this rank's experts of one layer
    sync = 2 * (all_gather_time_s(local, 2, link) - all_gather_time_s(0.0, 2, link)) + (
        reduce_scatter_time_s(local, 2, link) - reduce_scatter_time_s(0.0, 2, link))
    assert x.fsdp_s == pytest.approx(sync, rel=1e-9)  # two gathers and a reduce-scatter of its own
    assert x.copy_s == pytest.approx(3 * fsdp_copy_s(local, 2, hw) + fsdp_host_s(1, 0, hw), rel=1e-9)
    lat = 2 * (2 * all_gather_time_s(0.0, 2, link) + reduce_scatter_time_s(0.0, 2, link))  # both layers' units
    assert ep.form_terms["data"].latency_s - zero.form_terms["data"].latency_s == pytest.approx(lat, rel=1e-9)
    # without a shard axis besides the expert axis (HSDP: shard the expert axis, replicate the other) no unit
    hsdp = build_cost_graph(graph, cl, Roles((a, b), True, (), replicate=(a,), ep=b))
    assert all(not x.fsdp_s for x in hsdp.form_terms["expert"].values())


@pytest.mark.slow
def test_a_budget_below_fsdp4_plans_experts_under_zero3_that_fit_as_priced_and_verify():
    # FSDP2 over four ranks gathers every block with all its experts; split over an expert axis, the experts
    # are gathered over the other axis only (NOTE [experts under FSDP2]): the plan that fits below FSDP4's peak
    from treadle.planner import plan_model

    cl = parse_cluster("2x2:cpu")
    a, b = cl.mesh.names
    inputs = lm_inputs(BATCH, SEQ)
    fsdp4 = treadle.create_schedule(tiny_mixtral(), mesh=cl.mesh)
    fsdp4.data_parallel(axis=[a, b], shard=True)
    budget = 0.97 * treadle.price(fsdp4, inputs, cl).peak_bytes
    plan = plan_model(tiny_mixtral(), inputs, cluster=cl, memory_budget_bytes=budget)
    assert "(ZeRO-3)" in plan.roles and "experts over" in plan.roles, plan.solver["alternatives"]
    text = plan.schedule.to_python()
    assert "expert_parallel(axis=" in text and "shard=True" in text
    assert plan.estimate().peak_bytes <= budget
    assert treadle.verify(plan.schedule, inputs, steps=2, timeout_s=300).ok
