"""DualPipeV in the planner's search (`cuts.SCHEDULES`): weighed as torch runs it (its overlapped (forward, backward)
pairs one part after the other, whole backwards in them), its split backwards' share of the host cost read off the
schedule class's own order, by hand; a planned DualPipeV prices near its estimate and verifies on gloo."""

from __future__ import annotations

import pytest

import treadle
from treadle.cost.cluster import parse_cluster
from treadle.cost.collective_cost import send_recv_time_s
from treadle.forms.pipeline import cuts, milp
from treadle.forms.pipeline.facts import Action, action_order, overlap_pairs, stage_ranks
from treadle.forms.pipeline.timeline import simulate
from treadle.planner.cost_graph import build_cost_graph
from treadle.planner.roles import Roles

from test_pipeline_plan import _graph, _one_axis, planned_with_schedule


def test_dualpipev_splits_some_backwards_as_its_order_says():
    # torch's DualPipeV on 2 ranks over 4 micro-batches (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2):
    #   rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3
    #   rank 1: 1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3
    # its overlapped pairs (3B1 beside 0F3, ...) run whole backwards; only the warm-up's and the cool-down's split
    order = action_order("dualpipev", 4, 2, 4)
    assert [f"{a.stage}{a.kind}{a.mb}" for a in order[0]] == (
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3".split())
    assert cuts.split_shares("dualpipev", 4, 2, 4) == (0.5, 0.25, 0.25, 0.25)
    assert cuts.split_shares("zbv", 4, 2, 4) == (1.0,) * 4  # every backward split
    assert cuts.split_shares("interleaved_1f1b", 4, 2, 4) == (0.0,) * 4
    # with more micro-batches the steady state (whole backwards) is a larger part of the step
    assert cuts.split_shares("dualpipev", 4, 2, 16)[1] < 0.25
    # its class needs as many micro-batches as stages: weighed from 2p on
    model, g = _graph(n=4)
    cl = parse_cluster("1x2:cpu")
    pp = cl.mesh.names[1]
    kinds = ["1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"]
    assert milp.schedules(build_cost_graph(g, cl, Roles((), False, (), pp=pp, pp_microbatches=2))) == kinds
    assert milp.schedules(build_cost_graph(g, cl, Roles((), False, (), pp=pp, pp_microbatches=4))) == [
        *kinds, "dualpipev"]


def test_an_overlapped_pairs_forward_is_sent_when_the_pair_ends():
    # NOTE [an overlapped pair's sends]: torch runs 0F3 and 3B1 as one action and sends 0F3's output to stage 1
    # (rank 1) after both; the pairs are read off the schedule class's order
    order = action_order("dualpipev", 4, 2, 4)
    pairs = overlap_pairs("dualpipev", 4, 2, 4)
    assert {str(f): str(b) for f, b in pairs.items()} == {"0F3": "3B1", "3F2": "0B0", "3F3": "0B1", "2F2": "1B0",
                                                          "1F3": "2B1", "2F3": "1B1"}
    assert overlap_pairs("zbv", 4, 2, 4) == {}
    ranks = stage_ranks(order)
    unit = {(s, k): 1.0 for s in range(4) for k in "FBIW"}
    timed = simulate(order, unit, stage_rank=ranks, sent_after=pairs)
    at = {x.action: x for v in timed.slots.values() for x in v}
    for f, b in pairs.items():  # a forward's consumer on another rank starts after its pair ends
        nxt = Action(f.stage + 1, "F", f.mb)
        if f.stage < 3 and ranks[nxt.stage] != ranks[f.stage]:
            assert at[nxt].start_s >= at[b].end_s
    # with unit actions: 20 against 19 were each part sent when it ends
    assert (timed.makespan_s, simulate(order, unit, stage_rank=ranks).makespan_s) == (20.0, 19.0)


def test_a_dualpipev_cut_by_hand():
    # four blocks, one a stage, a V over 2 ranks and 4 micro-batches; every unit has one strategy. Each stage after
    # the first pays the split's host cost on the micro-batches whose backward its order splits (`split_shares`)
    cl, pp, cg, lay, cut, choice = _one_axis("dualpipev", ((0,), (1,), (2,), (3,)))
    assert lay.ranks() == [[0, 3], [1, 2]] and lay.split
    step, peak, terms = milp.evaluate(cg, lay, cut, choice, {})
    per_op = cl.rank_hardware().split_backward_op_s
    share = (0.5, 0.25, 0.25, 0.25)
    T, tail = [0.0] * 4, [0.0] * 4
    for u, unit in enumerate(cg.units):
        c = unit.costs[0]
        ops = sum(cg.graph.bwd_ops.get(i, 0) for i in unit.nodes)
        for s, n in cut.mult[u]:
            T[s] += n * (c.compute_s - c.opt_s + c.comm_s + (share[s] * ops * per_op if s > 0 else 0.0))
            tail[s] += n * (c.opt_s + c.dp_comm_s)
    info = next(iter(cg.templates.values()))
    send = send_recv_time_s(info.input_bytes[0], cl.link(pp))
    fill = cuts.fill_stages("dualpipev", 2, 4, lay.shares)
    R, Q = max(T[0] + T[3], T[1] + T[2]), max(tail[0] + tail[3], tail[1] + tail[2])
    assert step == pytest.approx(4 * R + fill / 4 * sum(T) + Q + 2 * 2 * send, rel=1e-9)
    assert terms["stage_s"] == pytest.approx(tuple(T), rel=1e-9)
    # its pairs run one part after the other, each pair's forward sent when the pair ends: a longer fill than ZBV's
    for p, m in ((2, 4), (4, 8), (8, 16)):
        assert cuts.fill_stages("dualpipev", p, m, (0.3, 0.4, 0.3)) > cuts.fill_stages("zbv", p, m, (0.3, 0.4, 0.3))


@pytest.mark.slow
def test_a_planned_dualpipev_prices_near_its_estimate_and_verifies():
    _, inputs, _, plan = planned_with_schedule("dualpipev")
    assert plan.solver["stages"]["n_microbatches"] >= 4  # its class needs as many as stages
    priced = plan.estimate()
    assert plan.estimated.step_s == pytest.approx(priced.step_s, rel=0.1)
    # the busiest rank's peak: the rows hold a stage's gradients from its first B (with the backward's transient
    # beside them, as the price counts its first backward's), so at most those gradients above the price
    ranks = plan.price["pipeline"]["ranks"]
    grads = max(sum(st["grad_bytes"] for st in plan.price["pipeline"]["stages"] if st["rank"] == int(r))
                for r in ranks)
    assert priced.peak_bytes * 0.98 <= plan.estimated.peak_bytes <= priced.peak_bytes + grads
    assert treadle.verify(plan.schedule, inputs, steps=2, timeout_s=300).ok
