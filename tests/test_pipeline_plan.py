"""The planner's pipeline role (NOTE [pipeline in the plan] in `treadle.forms.pipeline.plan`): the role options and
pins, the proposed cuts, the micro-batches in flight read off the schedule classes' own order, the MILP of one cut
against the exhaustive oracle and by hand, per-stage checkpoints under a budget, the solver against the price, and a
planned pipeline that verifies on gloo and replays from its plan file."""

from __future__ import annotations

import copy
import itertools
import math
import pytest
import torch
from torch import nn

import treadle
from treadle.cost.cluster import ClusterSpec, parse_cluster
from treadle.errors import PlanError
from treadle.forms.pipeline import cuts, milp
from treadle.forms.pipeline import oracle as pipeline_oracle
from treadle.forms.pipeline.kinds import price_variants
from treadle.forms.pipeline.plan import PipelineChoice, capture_facts, microbatch_counts
from treadle.mesh import Mesh
from treadle.models.zoo import named_model
from treadle.planner import Plan, plan_model
from treadle.planner.capabilities import runtime_capabilities, shardable_fn, tied_leaf_holders
from treadle.planner.capture import capture
from treadle.planner.cost_graph import build_cost_graph
from treadle.planner.ilp import solve
from treadle.planner.roles import Roles, enumerate_roles


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 2 * h)
        self.proj = nn.Linear(2 * h, h)

    def forward(self, x):
        return x + self.proj(torch.relu(self.fc(self.ln(x))))


class Stack(nn.Module):
    """An input projection, `n` blocks in a ModuleList, a head; returns a scalar loss."""

    def __init__(self, h: int, n: int):
        super().__init__()
        self.inp = nn.Linear(h, h)
        self.blocks = nn.ModuleList([Block(h) for _ in range(n)])
        self.head = nn.Linear(h, h)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def _graph(h=32, n=4, batch=8):
    torch.manual_seed(0)
    model = Stack(h, n)
    x = torch.randn(batch, 8, h)
    return model, capture(model, (x,))


# ----------------------------------------------------------------------------- roles
def test_the_pipeline_role_is_offered_on_each_live_axis_and_pinned_or_forbidden_by_pp_axis():
    facts = {"pipeline": {"container": "blocks", "blocks": 4}}
    mesh = Mesh((2, 2), ("a", "b"))
    roles = enumerate_roles(mesh, batch=8, facts=facts)
    piped = [r for r in roles if r.pp]
    assert {r.pp for r in piped} == {"a", "b"}
    # one assignment per micro-batch count (1F1B needs at least p); the schedule is the pipeline solve's choice
    assert {(r.pp_schedule, r.pp_microbatches) for r in piped} == {(None, m) for m in (2, 4, 8)}  # 16 > batch 8
    assert all(r.pp not in r.dp and r.pp not in r.tp for r in piped)
    # FSDP2 / HSDP beside the pipeline: with reshard after forward only (NOTE [pipeline FSDP2 in the plan])
    assert any(r.zero for r in piped) and all(r.reshard_after_forward for r in piped if r.zero)
    from treadle.forms.pipeline.plan import keep_roles

    assert keep_roles({"pp": "a", "dp": ("b",), "zero": True, "ep": ("b",)})  # experts' own units in stages too
    assert "pipeline a (2 micro-batches)" in {part for r in piped for part in str(r).split("; ")}
    assert not [r for r in enumerate_roles(mesh, batch=8, facts=facts, pp_axis=None) if r.pp]  # forbidden
    # without reshard after forward too, where the request leaves the flag open (NOTE [pipeline FSDP2 in the plan])
    both = [r for r in enumerate_roles(mesh, batch=8, facts=facts, reshard_after_forward=None) if r.pp and r.zero]
    assert {r.reshard_after_forward for r in both} == {True, False}
    assert not keep_roles({"pp": "a", "dp": ("a", "b"), "zero": True})  # the pipeline axis is not data-parallel
    pinned = enumerate_roles(mesh, batch=8, facts=facts, pp_axis="b")
    assert pinned and all(r.pp == "b" for r in pinned)  # pinned: every assignment pipelines over b
    with pytest.raises(PlanError, match="pipeline axis 'c' is not a live mesh axis"):
        enumerate_roles(mesh, batch=8, facts=facts, pp_axis="c")
    with pytest.raises(PlanError, match="no sequential container"):
        enumerate_roles(mesh, batch=8, facts={}, pp_axis="a")
    pinned = enumerate_roles(mesh, batch=8, facts=facts, pp_schedule="interleaved_1f1b", pp_microbatches=4)
    assert {(r.pp_schedule, r.pp_microbatches) for r in pinned if r.pp} == {("interleaved_1f1b", 4)}
    assert microbatch_counts(4, 12) == [4]  # 8, 16 and 32 do not divide 12


def test_capture_facts_name_the_largest_sequential_container():
    model = Stack(8, 5)
    assert capture_facts(model) == {"container": "blocks", "blocks": 5, "use_cache": False}
    assert capture_facts(nn.Linear(2, 2)) is None


def test_a_batch_that_does_not_split_into_micro_batches_skips_the_role_with_a_reason():
    model, g = _graph(batch=8)
    cl = parse_cluster("2x2:cpu")
    a, b = cl.mesh.names
    with pytest.raises(PlanError, match="does not split into 2 replicas x 8 micro-batches"):
        build_cost_graph(g, cl, Roles((b,), False, (), pp=a, pp_microbatches=8))


def test_the_solve_weighs_each_schedule_the_blocks_allow():
    model, g = _graph(n=3)  # three blocks: no interleaved stages on 2 ranks (2 x 2 = 4 stages)
    cl = parse_cluster("1x2:cpu")
    cg = build_cost_graph(g, cl, Roles((), False, (), pp=cl.mesh.names[1], pp_microbatches=2))
    assert milp.schedules(cg) == ["1f1b"]
    model, g = _graph(n=4)
    cg = build_cost_graph(g, cl, Roles((), False, (), pp=cl.mesh.names[1], pp_microbatches=2))
    # the zero-bubble schedules too (not DualPipeV: its class needs as many micro-batches as stages, 4)
    kinds = ["1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"]
    assert milp.schedules(cg) == kinds
    sol = solve(cg, budget_bytes=None)
    per = {k: milp.solve(build_cost_graph(g, cl, Roles((), False, (), pp=cl.mesh.names[1], pp_schedule=k,
                                                         pp_microbatches=2)), budget_bytes=None, checkpoint=True,
                         time_limit_s=30, rel_gap=1e-9, min_ckpt={}, minimise="time") for k in kinds}
    best = min(per, key=lambda k: per[k].step_s)
    assert sol.stages.schedule == best and sol.step_s == pytest.approx(per[best].step_s)
    # the ways the final choice by price prices on its own: each weighed schedule pinned, the solution's own
    # flagged (NOTE [each schedule priced on its own]); none once pinned; under a budget the split backward too
    # (without checkpoints: NOTE [zero-bubble schedules in the plan])
    assert sorted(sol.stages.weighed) == sorted(kinds)
    ways = price_variants(cg, sol)
    assert [(w.roles.pp_schedule, own) for w, own in ways] == [(k, k == best) for k in sol.stages.weighed]
    assert all(w.units is cg.units for w, _ in ways) and price_variants(ways[0][0], per[best]) == []
    under = solve(cg, budget_bytes=sol.peak_bytes * 2)
    assert sorted(under.stages.weighed) == sorted(kinds)


def test_a_pinned_pipeline_over_blocks_the_capture_does_not_repeat_says_so():
    # two blocks of different kinds: a container to cut, but no repeated block template for the stages; the error
    # says why every role assignment was refused (it blamed the memory of an unlimited budget)
    class Other(Block):
        def forward(self, x):
            return x + self.proj(torch.tanh(self.fc(self.ln(x))))

    torch.manual_seed(0)
    model = Stack(16, 2)
    model.blocks[1] = Other(16)
    cl = parse_cluster("1x2:cpu")
    with pytest.raises(PlanError, match=r"each of the \d+ role assignments was refused before its costs: pipeline "
                                        r"over '.*': the capture found no repeated blocks to cut into stages$"):
        plan_model(model, (torch.randn(8, 4, 16),), cluster=cl, pp_axis=cl.mesh.names[1], dp_axis=None)


def test_a_pipeline_is_weighed_on_the_slowest_link_unless_pinned():
    from treadle.planner.candidates import pipeline_on_slowest_link as _pipeline_on_slowest_link

    cl = ClusterSpec.from_physical(2, 4, intra="nvlink4", inter="ib-ndr", device="h100-sxm")  # (2 nodes, 4 each)
    across, inside = cl.mesh.names
    assert _pipeline_on_slowest_link(cl, Roles((), False, (inside,), pp=across, pp_microbatches=2))
    assert not _pipeline_on_slowest_link(cl, Roles((across,), False, (), pp=inside, pp_microbatches=4))
    assert _pipeline_on_slowest_link(parse_cluster("2x2:cpu"), Roles(("dp",), False, (), pp="tp", pp_microbatches=2))


# ----------------------------------------------------------------------------- cuts and micro-batches in flight
def _layout(g, cl, roles):
    cg = build_cost_graph(g, cl, roles)
    return cg, cuts._layout(cg, "1f1b")


def test_the_min_max_cut_is_exact_and_the_even_cut_is_proposed_beside_it():
    model, g = _graph(n=6)
    cl = parse_cluster("1x2:cpu")
    cg, lay = _layout(g, cl, Roles((), False, (), pp=cl.mesh.names[1], pp_microbatches=2))
    per, head, tail = cuts._weights(cg, lay)
    proposed = cuts.partitions(cg, lay)
    w = [per[t] for _, t in lay.blocks]

    def worst(stages):
        return max(sum(w[i] for i in st) + (head if s == 0 else 0) + (tail if s == len(stages) - 1 else 0)
                   for s, st in enumerate(stages))

    every = [(tuple(range(0, k)), tuple(range(k, 6))) for k in range(1, 6)]
    assert worst(proposed[0]) == pytest.approx(min(worst(c) for c in every))  # exact min-max
    assert ((0, 1, 2), (3, 4, 5)) in proposed  # the even cut
    assert all(sorted(i for st in c for i in st) == list(range(6)) for c in proposed)


@pytest.mark.parametrize("seed", range(6))
def test_the_min_max_dynamic_programme_is_exact_against_every_cut(seed):
    """`cuts._minmax` (a stage at a time over every (i, j) at once) against every contiguous cut: stage-dependent
    costs (a first stage that keeps more micro-batches, a last stage with the head), pinned boundaries kept, stages
    whose every cut costs inf refused or None."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n, S = int(rng.integers(4, 9)), int(rng.integers(2, 5))
    w = rng.uniform(0.5, 2.0, n)
    pre = np.concatenate([[0.0], np.cumsum(w)])
    scale = rng.uniform(1.0, 3.0, S)  # per stage (1F1B's first stages keep the most in flight)
    pinned = set(int(x) for x in rng.choice(n - 1, size=int(rng.integers(0, 2)), replace=False))
    cap = float(np.quantile(w, 0.9)) * 3.0

    def cost(s_):
        span = pre[None, :] - pre[:, None]
        return np.where(span * scale[s_] <= cap * 2.5, span * scale[s_], math.inf)

    def every():
        for ends in itertools.combinations(range(1, n), S - 1):
            b = (0, *ends, n)
            yield tuple(tuple(range(b[k], b[k + 1])) for k in range(S))

    def worst(stages):
        if any(st[0] <= k < st[-1] for st in stages for k in pinned):
            return math.inf
        return max(cost(s_)[st[0], st[-1] + 1] for s_, st in enumerate(stages))

    truth = min((worst(c) for c in every()), default=math.inf)
    got = cuts._minmax(n, S, pinned, cost, must=False)
    if math.isinf(truth):
        assert got is None
        with pytest.raises(PlanError, match=f"no cut of {n} blocks into {S} stages"):
            cuts._minmax(n, S, pinned, cost)
    else:
        assert got is not None and [i for st in got for i in st] == list(range(n)) and len(got) == S
        assert all(st for st in got) and worst(got) == pytest.approx(truth, rel=1e-12)


def test_1f1b_keeps_p_minus_s_micro_batches_in_flight_and_interleaved_reads_the_schedule_class():
    lay = cuts._Layout([], [], [], p=4, m=8, schedule="1f1b")
    got = cuts.inflight(lay)
    assert {r: [x for x in v] for r, v in got.items()} == {r: [{r: 4 - r}] for r in range(4)}
    lay2 = cuts._Layout([], [], [], p=2, m=4, schedule="interleaved_1f1b")
    from treadle.forms.pipeline.facts import action_order

    order = action_order("interleaved_1f1b", 4, 2, 4)
    for r, moments in cuts.inflight(lay2).items():
        # every undominated moment is a real moment of the order, and none is dominated by another
        cur, seen = {}, []
        for a in order[r]:
            if a.kind == "F":
                cur[a.stage] = cur.get(a.stage, 0) + 1
                seen.append({s: k for s, k in cur.items() if k})
            elif a.kind == "B":
                cur[a.stage] -= 1
        assert all(m in seen for m in moments)
        assert all(any(all(m.get(s, 0) >= k for s, k in x.items()) for m in moments) for x in seen)


# ----------------------------------------------------------------------------- the MILP
@pytest.mark.parametrize("kind", ["1f1b", "zbv", "interleaved_zb"])
def test_the_milp_of_a_cut_agrees_with_the_exhaustive_oracle_with_and_without_a_budget(kind):
    model, g = _graph(h=32, n=4)
    cl = parse_cluster("2x2:cpu")
    a, b = cl.mesh.names
    shardable = shardable_fn(g, runtime_capabilities(model)[0], 1, tied_leaf_holders(model))
    cg = build_cost_graph(g, cl, Roles((), False, (b,), pp=a, pp_microbatches=2), shardable=shardable)
    lay = cuts._layout(cg, kind)
    stages = cuts.partitions(cg, lay)[0]
    free_oracle = pipeline_oracle.solve_exhaustive(cg, stages, budget_bytes=None, schedule=kind)
    cut = cuts._cut(cg, lay, stages)
    got, *_ = milp._solve_cut(cg, lay, cut, budget_bytes=None, checkpoint=True, time_limit_s=30, rel_gap=1e-9,
                              min_ckpt={}, minimise="time")
    step, peak, _ = milp.evaluate(cg, lay, cut, got[0], got[1])
    assert step == pytest.approx(free_oracle.step_s, rel=1e-6)
    budget = free_oracle.peak_bytes * 0.8
    tight_oracle = pipeline_oracle.solve_exhaustive(cg, stages, budget_bytes=budget, schedule=kind)
    got, *_ = milp._solve_cut(cg, lay, cut, budget_bytes=budget, checkpoint=True, time_limit_s=30, rel_gap=1e-9,
                              min_ckpt={}, minimise="time")
    if tight_oracle.choice:
        step, peak, _ = milp.evaluate(cg, lay, cut, got[0], got[1])
        assert step == pytest.approx(tight_oracle.step_s, rel=1e-6) and peak <= budget
        assert tight_oracle.step_s >= free_oracle.step_s
    else:
        assert got is None


def _one_axis(kind: str, stages: tuple) -> tuple:
    """Four blocks cut as `stages` on one axis of 2 ranks over 4 micro-batches under `kind`, no tensor axis (every
    unit has one strategy): (cluster, pp axis, cost graph, layout, cut, the one choice)."""
    model, g = _graph(h=32, n=4)
    cl = parse_cluster("1x2:cpu")
    pp = cl.mesh.names[1]
    cg = build_cost_graph(g, cl, Roles((), False, (), pp=pp, pp_microbatches=4))
    lay = cuts._layout(cg, kind)
    return cl, pp, cg, lay, cuts._cut(cg, lay, stages), [0] * len(cg.units)


def test_the_step_of_a_cut_by_hand():
    # one axis of 2 ranks, no tensor axis: every unit has one strategy; 1F1B over M = 4 micro-batches
    cl, pp, cg, lay, cut, choice = _one_axis("1f1b", ((0, 1), (2, 3)))
    step, peak, terms = milp.evaluate(cg, lay, cut, choice, {})
    T = [0.0, 0.0]
    tail = [0.0, 0.0]
    static = [0.0, 0.0]
    for u, unit in enumerate(cg.units):
        c = unit.costs[0]
        for s, n in cut.mult[u]:
            T[s] += n * (c.compute_s - c.opt_s + c.comm_s)
            tail[s] += n * (c.opt_s + c.dp_comm_s)
            static[s] += n * c.static_bytes
    info = next(iter(cg.templates.values()))
    send = treadle.cost.collective_cost.send_recv_time_s(info.input_bytes[0], cl.link(pp))
    # M R + (p - 1)/p sum T + the slowest tail + the first micro-batch's two sends
    assert step == pytest.approx(4 * max(T) + 0.5 * sum(T) + max(tail) + 2 * send, rel=1e-9)
    # rank 0 keeps 2 micro-batches of stage 0 (p - s), rank 1 one of stage 1
    A = [0.0, 0.0]
    at = sum(cg.units[u].costs[0].act_bytes for u in info.units)
    for s in (0, 1):
        A[s] = 2 * at + sum(cg.units[u].costs[0].act_bytes for u in (lay.head if s == 0 else lay.tail))
    fixed = cg.fixed_static_bytes
    # and the largest backward working set of each rank's units (NOTE [a backward's working set])
    W = [max(cg.units[u].costs[0].work_bytes for u, sts in cut.mult.items() if any(s_ == s for s_, _ in sts))
         for s in (0, 1)]
    assert W[1] > 0  # the loss's, on the last stage
    assert peak == pytest.approx(max(static[0] + 2 * A[0] + W[0], static[1] + A[1] + W[1]) + fixed, rel=1e-9)
    # checkpointing both blocks of stage 0 recomputes them (its time grows) and keeps their inputs instead
    t = next(iter(cg.templates))
    step2, peak2, _ = milp.evaluate(cg, lay, cut, choice, {(t, 0): 2})
    rec = sum(cg.units[u].costs[0].rec_s for u in info.units) + cg.ckpt_host_s[t]
    T2 = [T[0] + 2 * rec, T[1]]
    assert step2 == pytest.approx(4 * max(T2) + 0.5 * sum(T2) + max(tail) + 2 * send, rel=1e-9)
    A0 = 2 * info.input_bytes[0] + sum(cg.units[u].costs[0].act_bytes for u in lay.head)
    assert peak2 == pytest.approx(max(static[0] + 2 * A0 + max(at, W[0]), static[1] + A[1] + W[1]) + fixed,
                                  rel=1e-9)  # + one block, or the working set


def test_the_fill_is_timed_from_the_schedule_class_order():
    # 1F1B, and interleaved 1F1B with M >= p: p - 1 stage-seconds, however a stage's second splits into F, I, W
    for p in (2, 4):
        for m in (p, 2 * p, 4 * p):
            for shares in ((1, 1, 1), (0.3, 0.45, 0.25)):
                assert cuts.fill_stages("1f1b", p, m, shares) == pytest.approx(p - 1)
                assert cuts.fill_stages("interleaved_1f1b", p, m, shares) == pytest.approx(p - 1)
    # torch's interleaved order with fewer micro-batches than ranks idles longer than p - 1
    assert cuts.fill_stages("interleaved_1f1b", 8, 4, (1, 1, 1)) > 7.5
    # ZBV on 2 ranks, 2 micro-batches, F = I = W = 1 a stage (stage 0: I empty, W = 2), by hand from torch's order
    # rank 0: 0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1; rank 1: 1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1
    #   rank 1: 1F0 [1,2] 2F0 [2,3] 1F1 [3,4] 2F1 [4,5] | 2I0 waits 3I0 (5): [5,6] 2W0 [6,7] 1I0 [7,8] 1W0 [8,9]
    #           2I1 waits 3I1 (8): [9,10] 2W1 [10,11] 1I1 [11,12] 1W1 [12,13]
    #   rank 0: 0F0 [0,1] 0F1 [1,2] 3F0 waits 2F0: [3,4] 3I0 [4,5] 3W0 [5,6] 3F1 waits 2F1: [6,7] 3I1 [7,8] 3W1 [8,9]
    #           0I0 [9,9] 0W0 [9,11] 0I1 waits 1I1 (12): [12,12] 0W1 [12,14]
    # makespan 14 against 12 of work: a fill of 2 seconds, 2/3 of a stage's 3
    assert cuts.fill_stages("zbv", 2, 2, (1, 1, 1)) == pytest.approx(2 / 3, abs=0.02)
    # W fills the bubbles: the zero-bubble schedules' fill is well under 1F1B's p - 1
    for kind in ("interleaved_zb", "zbv"):
        assert cuts.fill_stages(kind, 4, 16, (1, 1, 1)) < 0.5 * 3
    # DualPipeV as torch runs it (each overlapped pair's forward sent when the pair ends): 2 of 1F1B's 3
    assert cuts.fill_stages("dualpipev", 4, 16, (1, 1, 1)) == pytest.approx(2.0)


def test_a_zero_bubble_v_schedule_by_hand():
    # ZBV on 2 ranks over 4 micro-batches: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (a V); the boundary
    # between stages 1 and 2 is inside rank 1 (no send); every stage after the first pays the split's host cost
    cl, pp, cg, lay, cut, choice = _one_axis("zbv", ((0,), (1,), (2,), (3,)))
    assert lay.ranks() == [[0, 3], [1, 2]] and lay.split
    step, peak, terms = milp.evaluate(cg, lay, cut, choice, {})
    per_op = cl.rank_hardware().split_backward_op_s
    assert per_op > 0
    T, tail = [0.0] * 4, [0.0] * 4
    for u, unit in enumerate(cg.units):
        c = unit.costs[0]
        ops = sum(cg.graph.bwd_ops.get(i, 0) for i in unit.nodes)
        for s, n in cut.mult[u]:
            T[s] += n * (c.compute_s - c.opt_s + c.comm_s + (ops * per_op if s > 0 else 0.0))
            tail[s] += n * (c.opt_s + c.dp_comm_s)
    info = next(iter(cg.templates.values()))
    send = treadle.cost.collective_cost.send_recv_time_s(info.input_bytes[0], cl.link(pp))
    fill = cuts.fill_stages("zbv", 2, 4, lay.shares)
    R, Q = max(T[0] + T[3], T[1] + T[2]), max(tail[0] + tail[3], tail[1] + tail[2])
    assert step == pytest.approx(4 * R + fill / 4 * sum(T) + Q + 2 * 2 * send, rel=1e-9)
    assert terms["stage_s"] == pytest.approx(tuple(T), rel=1e-9)
    # against interleaved 1F1B's fill of p - 1 = 1 stage-second: W fills most of the bubble
    assert cuts.fill_stages("interleaved_1f1b", 2, 4, lay.shares) == pytest.approx(1.0) and fill < 0.5


def test_the_zero_bubble_schedules_are_weighed_only_where_build_runs_them():
    model, inputs = named_model("tiny-gpt2", batch=8, seq=16, dropout=False)  # a tied embedding and head
    g = capture(model, (), inputs)
    cl = parse_cluster("1x2:cpu")
    pp = cl.mesh.names[1]
    cg = build_cost_graph(g, cl, Roles((), False, (), pp=pp, pp_microbatches=4))
    # a V puts the first and last stage on rank 0: their shared weight under a split backward is refused by build
    assert milp.schedules(cg) == ["1f1b", "interleaved_1f1b", "interleaved_zb"]  # no zbv
    pinned = build_cost_graph(g, cl, Roles((), False, (), pp=pp, pp_microbatches=4, pp_schedule="zbv"))
    with pytest.raises(PlanError, match=r"pipeline: schedule 'zbv' places stages 0 and 3 on one rank and both read "
                                        r"the tied embedding and head; its split backward"):  # build's own words
        milp.schedules(pinned)
    cl2 = parse_cluster("2x2:cpu")
    a, b = cl2.mesh.names
    model, inputs = named_model("tiny-llama", batch=8, seq=16, dropout=False)
    g = capture(model, (), inputs)
    for reshard, kinds in ((True, ["1f1b", "interleaved_1f1b"]),
                           (False, ["1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"])):
        roles = Roles((b,), True, (), pp=a, pp_microbatches=2, reshard_after_forward=reshard)
        # ZeRO-3 that reshards after forward computes wrong weight gradients under a split backward (torch 2.13)
        assert milp.schedules(build_cost_graph(g, cl2, roles)) == kinds


def test_under_a_budget_the_first_stage_checkpoints_more_than_the_last():
    # 1F1B: stage 0 keeps p micro-batches in flight, the last stage one; a budget binds on the first rank first
    torch.manual_seed(0)
    model = Stack(64, 8)
    x = torch.randn(16, 512, 64)
    cl = ClusterSpec.uniform(Mesh((4,), ("pp",)), "nvlink4", device="h100-sxm")
    free = plan_model(model, (x,), cluster=cl, pp_axis="pp", dp_axis=None)
    budget = free.estimated.peak_bytes * 0.6
    plan = plan_model(model, (x,), cluster=cl, pp_axis="pp", dp_axis=None, memory_budget_bytes=budget)
    sp = plan.solver["stages"]
    assert plan.estimated.peak_bytes <= budget
    ck = [len(s) for s in sp["checkpointed"]]
    assert ck == sorted(ck, reverse=True) and ck[0] > ck[-1], sp  # the earlier the stage, the more it keeps


def test_each_schedule_of_a_pipelined_role_assignment_is_priced_on_its_own():
    # NOTE [each schedule priced on its own]: under a budget each schedule is re-solved by its own price's error;
    # here the solver ranks 1F1B first, and interleaved 1F1B, re-solved at its own corrected budget, prices faster
    model, inputs = named_model("tiny-llama", batch=8, seq=32, dropout=False)
    cl = parse_cluster("2x2:cpu")
    a = cl.mesh.names[0]
    free = plan_model(model, inputs, cluster=cl, pp_axis=a, dp_axis=None, price_top=1)
    budget = 0.5 * free.price["peak_bytes"]
    plan = plan_model(named_model("tiny-llama", batch=8, seq=32, dropout=False)[0], inputs, cluster=cl, pp_axis=a,
                      dp_axis=None, price_top=1, memory_budget_bytes=budget)
    rows = plan.solver["priced"]
    kinds = [r["roles"].split("(")[1].split(",")[0] for r in rows]
    # one role assignment, each schedule its own row (the zero-bubble ones too, without checkpoints)
    assert {"1f1b", "interleaved_1f1b"} <= set(kinds) and len(kinds) == len(set(kinds)), rows
    assert {r["roles"].replace(f"{k}, ", "") for r, k in zip(rows, kinds)} == {plan.roles}  # the label unpinned
    fits = [r for r in rows if r["peak_bytes"] <= budget]
    assert plan.price["step_s"] == min(r["step_s"] for r in fits) and plan.price["peak_bytes"] <= budget
    chosen = plan.solver["stages"]["schedule"]
    assert chosen != kinds[0] and rows[kinds.index(chosen)]["step_s"] < rows[0]["step_s"]  # the price overruled it


# ----------------------------------------------------------------------------- end to end
def _peak_near_price(plan, priced) -> None:
    """The MILP's peak against the price's: within 10%, or above it by at most the gradients. The MILP holds a
    stage's gradients at every moment; the price from its first backward on (NOTE [a stage's gradients at its peak]),
    so with few micro-batches, whose peak is the warm-up before any backward, the MILP is above it by them."""
    grads = max(sum(st["grad_bytes"] for st in plan.price["pipeline"]["stages"] if st["rank"] == int(r))
                for r in plan.price["pipeline"]["ranks"])
    assert priced.peak_bytes * 0.9 <= plan.estimated.peak_bytes <= (priced.peak_bytes + grads) * 1.02, grads


@pytest.mark.slow
def test_a_planned_pipeline_prices_near_its_estimate_replays_from_its_file_and_verifies():
    model, inputs = named_model("tiny-llama", batch=8, seq=32, dropout=False)
    cl = parse_cluster("2x2:cpu")
    a, b = cl.mesh.names
    plan = plan_model(model, inputs, cluster=cl, pp_axis=a, price_top=1)
    assert plan.roles.startswith("data-parallel") and f"pipeline {a}" in plan.roles, plan.roles
    text = plan.schedule.to_python()
    assert "cut_pipeline_stage()" in text and f"sch.pipeline(axis={a!r}" in text
    priced = plan.estimate()
    assert plan.estimated.step_s == pytest.approx(priced.step_s, rel=0.15)  # the MILP's step against the price
    _peak_near_price(plan, priced)
    again = Plan.from_json(plan.to_json())
    assert again.schedule_for(named_model("tiny-llama", batch=8, seq=32, dropout=False)[0]).to_python() == text
    report = treadle.verify(plan.schedule, inputs, steps=2, timeout_s=300)
    assert report.ok
    # treadle.train runs a pipeline by its own step: the losses of one process's training of the same model
    piped = treadle.train(plan.schedule, inputs, steps=2, timeout_s=300).losses
    single = treadle.create_schedule(copy.deepcopy(model), mesh=Mesh((1,), ("x",)))
    assert piped == pytest.approx(treadle.train(single, inputs, steps=2).losses, rel=1e-4)


def planned_with_schedule(kind: str) -> tuple:
    """Tiny LLaMA planned on 1 x 2 CPU ranks with its pipeline's schedule pinned to `kind` (a V: 4 stages):
    (model, inputs, cluster, plan)."""
    model, inputs = named_model("tiny-llama", batch=8, seq=32, dropout=False)
    cl = parse_cluster("1x2:cpu")
    plan = plan_model(model, inputs, cluster=cl, pp_axis=cl.mesh.names[1], pp_schedule=kind, price_top=1)
    sp = plan.solver["stages"]
    assert sp["schedule"] == kind and len(sp["blocks"]) == 4, sp
    assert f"schedule={kind!r}" in plan.schedule.to_python()
    return model, inputs, cl, plan


@pytest.mark.slow
def test_a_planned_zero_bubble_v_pipeline_prices_near_its_estimate_and_verifies():
    # the schedule pinned (`pp_schedule`), the rest planned: a V over 2 ranks (4 stages), each backward split into
    # input and weight gradients; forward, every gradient and an optimizer step against one process
    model, inputs, cl, plan = planned_with_schedule("zbv")
    pp = cl.mesh.names[1]
    priced = plan.estimate()
    assert plan.estimated.step_s == pytest.approx(priced.step_s, rel=0.15)
    _peak_near_price(plan, priced)
    assert treadle.verify(plan.schedule, inputs, steps=2, timeout_s=300).ok
    with pytest.raises(PlanError, match="pipeline schedule 'dualpipe': the planner plans"):
        plan_model(model, inputs, cluster=cl, pp_axis=pp, pp_schedule="dualpipe")
    # under a budget its price meets (no checkpointed block: a split backward would run their forwards again)
    fit = plan_model(model, inputs, cluster=cl, pp_axis=pp, pp_schedule="zbv", memory_budget_bytes=priced.peak_bytes,
                     price_top=1)
    assert fit.solver["stages"]["schedule"] == "zbv" and fit.estimate().peak_bytes <= priced.peak_bytes
    assert "checkpoint()" not in fit.schedule.to_python()
    with pytest.raises(PlanError, match="pipeline schedule 'zbv': a split-backward schedule is planned without "
                                        "checkpointed blocks"):
        ckpt = treadle.create_schedule(model, mesh=cl.mesh)
        ckpt["model.layers.0"].checkpoint()  # a required checkpoint
        plan_model(model, inputs, cluster=cl, pp_axis=pp, pp_schedule="zbv", partial_schedule=ckpt)
    with pytest.raises(PlanError, match=r"plan_model: pp_schedule='zbv' pins a pipeline's schedule, but pp_axis=None "
                                        r"plans no pipeline"):
        plan_model(model, inputs, cluster=cl, pp_axis=None, pp_schedule="zbv")
    part = treadle.create_schedule(model, mesh=cl.mesh)
    part["model.layers.1"].cut_pipeline_stage()
    part.pipeline(axis=pp, schedule="1f1b", n_microbatches=4, example_inputs=inputs)
    with pytest.raises(PlanError, match=r"pp_schedule='zbv', but the partial schedule's pipeline\(...\) states '1f1b'"):
        plan_model(model, inputs, cluster=cl, partial_schedule=part, pp_schedule="zbv")


@pytest.mark.slow
def test_a_planned_gpt2_pipeline_with_tied_embedding_and_checkpoints_verifies():
    model, inputs = named_model("tiny-gpt2", batch=8, seq=32, dropout=False)
    cl = ClusterSpec.uniform(Mesh((2, 2), ("pp", "dp")), "nvlink4", device="h100-sxm")
    free = plan_model(model, inputs, cluster=cl, pp_axis="pp", dp_axis="dp", zero=False)
    plan = plan_model(model, inputs, cluster=cl, pp_axis="pp", dp_axis="dp", zero=False,
                      memory_budget_bytes=0.7 * free.estimate().peak_bytes)
    assert "pipeline pp" in plan.roles and any(d.op == "checkpoint" for d in plan.decisions), plan.decisions
    assert plan.estimate().peak_bytes <= 0.7 * free.estimate().peak_bytes
    assert treadle.verify(plan.schedule, inputs, steps=2, timeout_s=300).ok


def test_a_plan_file_pipeline_decision_is_checked_as_data():
    from treadle.planner.to_schedule import Decision

    good = {"axis": "pp", "schedule": "1f1b", "n_microbatches": 2,
            "example_inputs": {"input_ids": {"shape": [8, 16], "dtype": "int64"}}, "target": "labels"}
    Decision.from_dict({"op": "pipeline", "path": "", "args": good})
    bad = dict(good, example_inputs={"input_ids": {"shape": [8, -1], "dtype": "int64"}})
    with pytest.raises(PlanError, match="argument 'example_inputs' must be inputs"):
        Decision.from_dict({"op": "pipeline", "path": "", "args": bad})
    with pytest.raises(PlanError, match="unknown arguments"):
        Decision.from_dict({"op": "cut_pipeline_stage", "path": "model.layers.0", "args": {"x": 1}})
    assert PipelineChoice("pp", "1f1b", 2, (("b.0",), ("b.1",)), ((), ())).n_stages == 2


def test_a_partial_schedule_pins_stage_boundaries_and_the_pipeline():
    model, inputs = named_model("tiny-llama", batch=8, seq=32, dropout=False)
    cl = parse_cluster("2x2:cpu")
    a, b = cl.mesh.names
    part = treadle.create_schedule(model, mesh=cl.mesh)
    part["model.layers.0"].cut_pipeline_stage()  # an uneven cut: stage 0 holds one block, stage 1 three
    part.pipeline(axis=a, schedule="1f1b", n_microbatches=4, example_inputs=inputs)
    plan = plan_model(model, inputs, cluster=cl, partial_schedule=part)
    sp = plan.solver["stages"]
    assert sp["blocks"] == (("model.layers.0",), ("model.layers.1", "model.layers.2", "model.layers.3"))
    assert (sp["axis"], sp["schedule"], sp["n_microbatches"]) == (a, "1f1b", 4)
    assert "pipeline" in plan.roles and f"pipeline {a}" in plan.roles
    # a boundary alone: every pipelined plan keeps it (the others chosen), an unpipelined plan may still win
    roles = enumerate_roles(cl.mesh, batch=8, facts={"pipeline": {"container": "model.layers", "blocks": 4}},
                            pp_cuts=("model.layers.2",))
    assert any(not r.pp for r in roles) and all(r.pp_cuts == ("model.layers.2",) for r in roles if r.pp)
    only = treadle.create_schedule(model, mesh=cl.mesh)
    only["model.layers.2"].cut_pipeline_stage()
    piped = plan_model(model, inputs, cluster=cl, partial_schedule=only, pp_axis=a)
    assert any(st[-1] == "model.layers.2" for st in piped.solver["stages"]["blocks"])
    with pytest.raises(PlanError, match="pinned stage boundary 'model.layers.9'"):
        enumerate_roles(cl.mesh, batch=8, facts={"pipeline": {"container": "model.layers", "blocks": 4}},
                        pp_cuts=("model.layers.9",))


def test_the_cuts_beside_a_cut_move_one_boundary_by_one_block_and_keep_the_pinned_ones():
    # 6 blocks in 3 stages (0 1 | 2 3 4 | 5): each of the two boundaries one block either way, no stage left empty
    got = cuts.neighbours(((0, 1), (2, 3, 4), (5,)), 6, set())
    assert got == [((0,), (1, 2, 3, 4), (5,)), ((0, 1, 2), (3, 4), (5,)), ((0, 1), (2, 3), (4, 5))]
    # a stage pinned to end after block 1 keeps that boundary; one-block stages cannot give a block away
    assert cuts.neighbours(((0, 1), (2, 3, 4), (5,)), 6, {1}) == [((0, 1), (2, 3), (4, 5))]
    assert cuts.neighbours(((0,), (1,), (2,)), 3, set()) == []


@pytest.mark.parametrize("n", [6, 8])
@pytest.mark.parametrize("block", ["relu", "gelu"])
def test_the_proposed_cuts_find_the_best_cut_of_all_under_a_budget(n, block):
    # every contiguous cut of n blocks into 4 stages, each solved exhaustively (choices and per-stage checkpoint
    # counts), against the MILP over the proposed cuts and the cuts beside the best of them (NOTE [cuts beside the
    # proposed ones]). Under a budget the memory-aware cut matters: the first stages of 1F1B keep the most
    # micro-batches, so the best cut gives them fewer blocks. The proposals alone are not every cut: on the GELU
    # stack (test_planner's: 4h-wide MLPs) at 60% of the free peak with 6 blocks the best of them is 2.3% slower
    # than the best cut, two boundaries one block off through a cut level with it; the walk reaches it
    from test_planner import Stack as GeluStack

    torch.manual_seed(0)
    model = Stack(32, n) if block == "relu" else GeluStack(32, n)
    g = capture(model, (torch.randn(8, 64, 32),))
    cl = parse_cluster("1x4:cpu")
    cg = build_cost_graph(g, cl, Roles((), False, (), pp=cl.mesh.names[1], pp_schedule="1f1b", pp_microbatches=4))
    kw = dict(checkpoint=True, time_limit_s=30, rel_gap=1e-9, min_ckpt={}, minimise="time")
    free = milp.solve(cg, budget_bytes=None, **kw)
    for frac in (None, 0.8, 0.6):
        budget = None if frac is None else free.peak_bytes * frac
        got = milp.solve(cg, budget_bytes=budget, **kw)
        best = math.inf
        for bounds in itertools.combinations(range(1, n), 3):
            edges = (0, *bounds, n)
            stages = tuple(tuple(range(edges[i], edges[i + 1])) for i in range(4))
            best = min(best, pipeline_oracle.solve_exhaustive(cg, stages, budget_bytes=budget).step_s)
        assert got.step_s == pytest.approx(best, rel=1e-3), (frac, got.stages.blocks if got.stages else None)


# ----------------------------------------------------------------------------- ZeRO-3 beside the pipeline
def test_zero3_beside_the_pipeline_by_hand():
    # NOTE [pipeline FSDP2 in the plan]: each micro-batch gathers a stage's units twice; the stage takes the longer of
    # its compute and its gathers where the device overlaps; the reduce-scatter ends the step in the tail; a rank
    # holds its stages' full gradients and gathered parameters beside the sharded state
    from treadle.forms.pipeline.zero import zero_terms

    model, g = _graph(h=32, n=4)
    cl = parse_cluster("2x2:cpu")
    a, b = cl.mesh.names
    cg = build_cost_graph(g, cl, Roles((b,), True, (), pp=a, pp_schedule="1f1b", pp_microbatches=2))
    zt = zero_terms(cg)
    assert zt is not None and zt.n == 2
    head = next(i for i, n in enumerate(g.nodes) if n.kind == "op" and n.module == "head" and n.op_name == "linear")
    assert zt.gathered[cg.unit_of[head][0]][0] == (32 * 32 + 32) * 4  # the head's weight and bias, fp32, whole
    lay = cuts._layout(cg, "1f1b")
    cut = cuts._cut(cg, lay, ((0, 1), (2, 3)))
    choice = [0] * len(cg.units)
    step, peak, _ = milp.evaluate(cg, lay, cut, choice, {})
    T, G, tail, static = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
    for u, unit in enumerate(cg.units):
        c = unit.costs[0]
        for s_, k in cut.mult[u]:
            T[s_] += k * (c.compute_s - c.opt_s + c.comm_s)
            G[s_] += k * 2 * zt.ag_per_byte * zt.gathered[u][0]
            tail[s_] += k * (c.opt_s + zt.rs_per_byte * zt.gathered[u][0])
            static[s_] += k * (c.static_bytes + zt.grads[u][0] / 2 + zt.gathered[u][0])
    units = [3, 3]  # each stage: its two blocks and a root (the embedding on stage 0, norm and head on stage 1)
    stage = [(max(T[i], G[i] + 2 * units[i] * zt.ag_lat_s) if zt.overlap else T[i] + G[i] + 2 * units[i] * zt.ag_lat_s)
             + units[i] * zt.unit_host_s for i in (0, 1)]
    info = next(iter(cg.templates.values()))
    send = treadle.cost.collective_cost.send_recv_time_s(info.input_bytes[0], cl.link(a))
    want = 2 * max(stage) + 0.5 * sum(stage) + max(tail[i] + units[i] * zt.rs_lat_s for i in (0, 1)) + 2 * send
    assert step == pytest.approx(want, rel=1e-9)
    assert peak > max(static)  # plus the micro-batches in flight


def test_zero3_without_reshard_beside_the_pipeline_by_hand():
    # NOTE [pipeline FSDP2 in the plan]: kept gathered, a stage gathers each unit once a step (in the rank's tail,
    # with the reduce-scatter), nothing per micro-batch; the gathered bytes are the cost graph's static bytes
    from treadle.forms.pipeline.zero import zero_terms

    model, g = _graph(h=32, n=4)
    cl = parse_cluster("2x2:cpu")
    a, b = cl.mesh.names
    roles = Roles((b,), True, (), pp=a, pp_schedule="1f1b", pp_microbatches=2, reshard_after_forward=False)
    cg = build_cost_graph(g, cl, roles)
    zt = zero_terms(cg)
    assert not zt.reshard
    lay = cuts._layout(cg, "1f1b")
    cut = cuts._cut(cg, lay, ((0, 1), (2, 3)))
    choice = [0] * len(cg.units)
    step, peak, _ = milp.evaluate(cg, lay, cut, choice, {})
    T, tail, static = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
    assert sum(unit.costs[0].fsdp_s for unit in cg.units) > 0  # FSDP2's copies and per-parameter host cost
    for u, unit in enumerate(cg.units):
        c = unit.costs[0]
        for s_, k in cut.mult[u]:  # FSDP2's copies and per-parameter host cost once a step, not per micro-batch
            T[s_] += k * (c.compute_s - c.opt_s + c.comm_s - c.fsdp_s)
            tail[s_] += k * (c.opt_s + c.fsdp_s + (zt.rs_per_byte + zt.ag_per_byte) * zt.gathered[u][0])
            static[s_] += k * (c.static_bytes + zt.grads[u][0] / 2)
    units = [3, 3]
    # per micro-batch FSDP2's hooks on gathered units only; the gather's bookkeeping once, in the tail
    assert 0 < zt.kept_host_s < zt.unit_host_s
    stage = [T[i] + units[i] * zt.kept_host_s for i in (0, 1)]
    info = next(iter(cg.templates.values()))
    send = treadle.cost.collective_cost.send_recv_time_s(info.input_bytes[0], cl.link(a))
    once = zt.rs_lat_s + zt.ag_lat_s + zt.unit_host_s - zt.kept_host_s
    want = 2 * max(stage) + 0.5 * sum(stage) + max(tail[i] + units[i] * once for i in (0, 1)) + 2 * send
    assert step == pytest.approx(want, rel=1e-9)
    assert peak > max(static)
    # the same cut resharding after forward: slower by the gathers per micro-batch, the same parameters held
    cg2 = build_cost_graph(g, cl, Roles((b,), True, (), pp=a, pp_schedule="1f1b", pp_microbatches=2))
    lay2 = cuts._layout(cg2, "1f1b")
    step2, peak2, _ = milp.evaluate(cg2, lay2, cuts._cut(cg2, lay2, ((0, 1), (2, 3))), choice, {})
    assert step < step2 and peak == pytest.approx(peak2, rel=1e-9)


@pytest.mark.parametrize("reshard", [True, False])
def test_the_milp_with_zero3_beside_agrees_with_the_oracle_and_a_planned_pp_x_fsdp2_verifies(reshard):
    model, g = _graph(h=32, n=4)
    cl = parse_cluster("2x2:cpu")
    a, b = cl.mesh.names
    cg = build_cost_graph(g, cl, Roles((b,), True, (), pp=a, pp_schedule="1f1b", pp_microbatches=2,
                                       reshard_after_forward=reshard))
    lay = cuts._layout(cg, "1f1b")
    stages = cuts.partitions(cg, lay)[0]
    cut = cuts._cut(cg, lay, stages)
    kw = dict(checkpoint=True, time_limit_s=30, rel_gap=1e-9, min_ckpt={}, minimise="time")
    for budget in (None, 0.8 * pipeline_oracle.solve_exhaustive(cg, stages, budget_bytes=None).peak_bytes):
        oracle = pipeline_oracle.solve_exhaustive(cg, stages, budget_bytes=budget)
        got, *_ = milp._solve_cut(cg, lay, cut, budget_bytes=budget, **kw)
        if not oracle.choice:
            assert got is None
            continue
        assert milp.evaluate(cg, lay, cut, got[0], got[1])[0] == pytest.approx(oracle.step_s, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [True, None])
def test_a_planned_pipeline_beside_fsdp2_prices_near_its_estimate_and_verifies(reshard):
    model, inputs = named_model("tiny-llama", batch=8, seq=64, dropout=False)
    cl = parse_cluster("2x2:cpu")
    a, b = cl.mesh.names
    plan = plan_model(model, inputs, cluster=cl, pp_axis=a, dp_axis=b, zero=True, price_top=0,
                      reshard_after_forward=reshard)
    assert "(ZeRO-3)" in plan.roles and f"pipeline {a}" in plan.roles, plan.roles
    assert "shard=True" in plan.schedule.to_python()
    # left open, the planner keeps the stages gathered: one gather a step, not two a micro-batch, the same peak
    assert ("reshard_after_forward=False" in plan.schedule.to_python()) == (reshard is None)
    priced = plan.estimate()
    assert plan.estimated.step_s == pytest.approx(priced.step_s, rel=0.15)
    _peak_near_price(plan, priced)
    assert treadle.verify(plan.schedule, inputs, steps=2, timeout_s=300).ok


def _tiny_3axis_search(price_top: int):
    """The search of a tiny LLaMA on 8 nodes x 2 devices over meshes of up to 3 axes, captured, not yet solved."""
    from treadle.planner import search as S
    from treadle.planner.meshes import search_clusters

    model, inputs = named_model("tiny-llama", batch=16, seq=16, dropout=False)
    clusters = search_clusters(parse_cluster("8x2:h100"), max_axes=3)
    assert any(c.mesh.ndim == 3 for c in clusters)
    given = dict(cluster=clusters, memory_budget_bytes=None, mode="joint", pins=None, dp_axis="auto", zero=None,
                 reshard_after_forward=True, forbid_axes=(), partial_schedule=None, train=S.TrainSpec(),
                 time_limit_s=30, model_spec=None, checkpoint="auto", progress=None, loss_fn=None,
                 price_top=price_top, pp_axis="auto")
    args, kwargs = S._split_inputs(inputs)
    return S.capture_model(model, args, kwargs, S.make_request(model, given))


_UNCUT: dict = {}


def _solved_without_cutoff(search, cl, roles):
    """A candidate's solution with no cutoff, or None where its cost graph cannot be built. Solved once per
    candidate for the tests of this file: a solution without cutoff reads nothing of `price_top`, the only thing
    that differs between their searches (it sets the cutoff; `search.cutoff_for`)."""
    from treadle.planner import search as S

    key = (str(cl.mesh), repr(cl.links), repr(roles))
    if key not in _UNCUT:
        try:
            cg = S.cost_graph_for(search, cl, roles, S.pins_for(search.graph, search.req.pins, roles))
        except PlanError:
            _UNCUT[key] = None
        else:
            _UNCUT[key] = S.solve_for(search, cg, None)
    return _UNCUT[key]


def test_role_assignments_that_solve_alike_are_solved_once():
    """NOTE [role assignments that solve alike]: every candidate of a 3-axis search on 8 nodes x 2 devices (the
    pipeline over either outer axis of (2, 2, 2), or over the 4 of (4, 2) and (2, 4, ...)) solved, each group of
    candidates the search merges gives the same step and peak; the search solves one of each."""
    from treadle.planner import search as S

    search = _tiny_3axis_search(0)
    every = S.candidates(search, distinct=False)
    kept = S.candidates(search)
    groups: dict = {}
    for cl, roles in every:
        groups.setdefault(S.alike_key(cl, roles), []).append((cl, roles))
    merged = [g for g in groups.values() if len(g) > 1]
    assert len(kept) == len(groups) < len(every) and merged
    assert kept == [g[0] for g in groups.values()]  # the first of each, in search order
    assert any(r.pp for g in merged for _, r in g) and any(
        len({tuple(c.mesh.shape) for c, _ in g}) > 1 for g in merged)  # across meshes, and pipelined
    for group in merged:
        sols = [_solved_without_cutoff(search, cl, roles) for cl, roles in group]
        got = {None if x is None else (x.status, round(x.step_s, 15), round(x.peak_bytes)) for x in sols}
        assert len(got) == 1, (group[0][1], got)


@pytest.mark.parametrize("price_top", [0, 1])
def test_a_cutoff_from_the_best_plan_found_prunes_only_what_could_not_be_chosen(price_top):
    """NOTE [a cutoff from the best plan found]: every pruned role assignment, solved without the cutoff, is slower
    than (or as slow as) the plan the search keeps in its place (with price_top 0 the chosen plan; with K = 1 the
    best of its own kind, pipelined), or does not fit; the chosen plan is the best of every candidate solved
    without cutoffs."""
    from treadle.planner import search as S

    search = _tiny_3axis_search(price_top)
    results, unbuilt = S.solve_roles(search)
    assert search.pruned, "nothing pruned: the test no longer exercises the cutoff"
    pruned = {(p["mesh"], p["roles"]) for p in search.pruned}
    kept = {(str(c.cluster.mesh), str(c.roles)): s.step_s for s, c in results if s.status != "infeasible"}
    uncut = {}
    for cl, roles in S.candidates(search):
        sol = _solved_without_cutoff(search, cl, roles)
        if sol is not None:
            uncut[(str(cl.mesh), str(roles))] = (sol.step_s if sol.status != "infeasible" else math.inf,
                                                 roles.pp is not None)
    assert pruned <= set(uncut) and not pruned & set(kept)
    for key, (step, piped) in uncut.items():
        if key in kept:
            assert kept[key] == pytest.approx(step, rel=1e-6), key
    if price_top == 0:
        best = min(step for step, _ in uncut.values())
        sol, cg, _, priced = S.choose(search, results, unbuilt, None)
        plan = S.emit(search, sol, cg, None, priced, results, planning_s=0.0)
        assert plan.estimated.step_s == pytest.approx(best, rel=1e-6)
        assert f"pruned: {len(plan.solver['pruned'])} pipelined role assignments" in plan.explain()
        assert all(uncut[k][0] >= best * (1 - 1e-6) for k in pruned)
    else:
        for kind in (False, True):
            best_kind = min(kept[k] for k in kept if uncut[k][1] == kind)
            assert all(uncut[k][0] >= best_kind * (1 - 1e-6) for k in pruned if uncut[k][1] == kind)
