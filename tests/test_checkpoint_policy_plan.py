"""Selective checkpoint policies in the planner's search (NOTE [ops a policy keeps] in `treadle.planner.policy_facts`,
NOTE [checkpoint policies in the plan] in `treadle.planner.policies`): what the capture measures each op keeps, the
MILP against the exhaustive oracle, the terms against the price, and a planned schedule that uses a policy built,
priced and verified."""

from __future__ import annotations

import pytest
import torch

import treadle
from treadle.cost.cluster import parse_cluster
from treadle.errors import PlanError
from treadle.planner.capture import capture
from treadle.planner.cost_graph import build_cost_graph
from treadle.planner.ilp import evaluate, solve, solve_exhaustive
from treadle.planner.policies import pick, spread
from treadle.planner.roles import Roles, TrainSpec

from tiny_models import lm_inputs, tiny_llama

SAC = "alternate-matmuls"
H100 = parse_cluster("1:h100")
LAYERS = 4


@pytest.fixture(scope="module")
def graph():
    return capture(tiny_llama(LAYERS), (), lm_inputs(8, 64))


def _cg(graph, cluster=H100, policies=(SAC,)):
    return build_cost_graph(graph, cluster, Roles((), False, ()), train=TrainSpec(checkpoint_policies=policies))


def test_the_policy_keeps_every_other_matmul_of_each_block_and_attention(graph):
    facts = graph.sac[SAC]
    for blk in graph.blocks[:2]:  # the alternation restarts in every block, as at run time
        linears = [i for i in blk.nodes if graph.nodes[i].op_name == "linear"]
        assert len(linears) == 7  # q k v o gate up down
        kept = [facts[i].kept_ops > 0 for i in linears]
        assert kept == [True, False, True, False, True, False, True]
        for i in linears:
            n = graph.nodes[i]
            if facts[i].kept_ops:  # the product's output, whole (fp32, no bias)
                assert facts[i].kept_bytes == n.out.nbytes
                assert facts[i].kept_share() == 1.0
            else:
                assert facts[i].kept_bytes == 0 and facts[i].kept_share() == 0.0
        (sdpa,) = [i for i in blk.nodes if graph.nodes[i].op_name == "scaled_dot_product_attention"]
        assert facts[sdpa].kept_ops == 1 and facts[sdpa].kept_bytes > 0
        assert facts[sdpa].kept_share() == pytest.approx(1.0, abs=1e-6)  # the kernel's FLOPs, not the mask's ops
        norms = [i for i in blk.nodes if graph.nodes[i].op_name == "rsqrt"]
        assert norms and all(facts[i].kept_ops == 0 for i in norms)


def test_without_policies_allowed_the_milp_has_none(graph):
    cg = _cg(graph, policies=())
    assert cg.policies == () and solve(cg, budget_bytes=None).policies == {}


@pytest.mark.parametrize("cluster", ["1:h100", "2x1:cpu"])
def test_the_milp_agrees_with_the_oracle_at_every_budget(graph, cluster):
    cl = parse_cluster(cluster)
    cg = build_cost_graph(graph, cl, Roles(("dp",) if cl.world_size > 1 else (), False, ()),
                          train=TrainSpec(checkpoint_policies=(SAC,)))
    free, least = solve(cg, budget_bytes=None), solve(cg, budget_bytes=None, minimise="memory")
    used = set()
    for frac in (0.0, 0.15, 0.3, 0.5, 0.7, 0.85):
        budget = least.peak_bytes + frac * (free.peak_bytes - least.peak_bytes)
        sol, oracle = solve(cg, budget_bytes=budget), solve_exhaustive(cg, budget_bytes=budget)
        assert sol.status == "optimal" and oracle.status == "optimal"
        assert sol.step_s == pytest.approx(oracle.step_s, rel=1e-6), (frac, sol.ckpt, sol.policies, oracle.ckpt,
                                                                      oracle.policies)
        assert sol.peak_bytes <= budget
        t = next(iter(cg.templates))
        assert sol.ckpt.get(t, 0) + sol.policies.get((t, SAC), 0) <= LAYERS
        used.add((sol.ckpt.get(t, 0), sol.policies.get((t, SAC), 0)))
    if cl.is_cpu():  # its dispatch modes cost ~10 us an op on a CPU: full checkpoints are cheaper there
        assert not any(p for _, p in used), used
    else:  # hidden behind a GPU: the policy is among the optima
        assert any(p for _, p in used), used


@pytest.mark.parametrize("cluster", ["1:h100", "1:cpu"])
def test_a_block_under_the_policy_costs_what_the_price_says(cluster):
    """One template's blocks all under the policy, all fully checkpointed, none: the solver's recompute and memory
    differences from none against the price's, on a small LLaMA on fake tensors (bf16; on the CPU preset with
    checkpointing's and the dispatch modes' host costs)."""
    from treadle.models.zoo import MODEL_CONFIGS, ModelConfig, _llama, named_model

    MODEL_CONFIGS.setdefault("test-small-llama", ModelConfig(family="llama", config=_llama(
        512, 1408, LAYERS, 8, 4, 4096, max_position_embeddings=4096)))
    build = lambda: named_model("test-small-llama", batch=2, seq=2048, fake=True, dtype=torch.bfloat16)  # noqa: E731
    cl = parse_cluster(cluster)
    model, inputs = build()
    g = capture(model, (), inputs, gpu_attention=not cl.is_cpu())
    cg = _cg(g, cl)
    t = next(iter(cg.templates))
    choice = solve(cg, budget_bytes=None).choice
    solver, priced = {}, {}
    for how in ("none", "full", SAC):
        ck = {t: LAYERS} if how == "full" else {}
        pol = {(t, SAC): LAYERS} if how == SAC else {}
        step, peak, _ = evaluate(cg, choice, ck, {}, pol)
        solver[how] = (step, peak)
        sch = treadle.create_schedule(build()[0], mesh=cl.mesh)
        if how != "none":
            sch["model.layers"].checkpoint_every(1, policy=how)
        p = treadle.price(sch, inputs, cl)
        priced[how] = (p.step_s, p.peak_bytes)
    deltas = {}
    for how in ("full", SAC):
        d_solver = [a - b for a, b in zip(solver[how], solver["none"])]
        d_price = [a - b for a, b in zip(priced[how], priced["none"])]
        deltas[how] = (d_solver, d_price)
    print(deltas)
    for how, (d_solver, d_price) in deltas.items():
        assert d_solver[0] > 0 and d_solver[1] < 0 and d_price[1] < 0
        assert d_solver[0] == pytest.approx(d_price[0], rel=0.2), (how, d_solver, d_price)
        assert d_solver[1] == pytest.approx(d_price[1], rel=0.15), (how, d_solver, d_price)
    # the policy sits between: less memory saved than full, and on a GPU less recompute
    assert solver["full"][1] < solver[SAC][1] < solver["none"][1]
    if not cl.is_cpu():
        assert solver["none"][0] < solver[SAC][0] < solver["full"][0]


@pytest.mark.parametrize("blocks", range(1, 9))
def test_the_blocks_picked_are_the_counts_and_block_0_is_checkpointed_whenever_any_is(blocks):
    members = [f"b.{i}" for i in range(blocks)]
    for full in range(blocks + 1):
        for n in range(blocks + 1 - full):
            got = pick(members, full, {SAC: n} if n else {})
            assert sorted(got.values()).count("full") == full and list(got.values()).count(SAC) == n
            assert set(b for b, p in got.items() if p == "full") == set(spread(members, full))
            assert (members[0] in got) == (full + n > 0)


def test_policy_names_are_checked():
    with pytest.raises(PlanError, match=r"checkpoint_policies: 'attention-core' is not a policy the planner "
                                        r"searches; known: \['full', 'alternate-matmuls'\]"):
        TrainSpec(checkpoint_policies=("attention-core",))
    with pytest.raises(PlanError, match=r"'os.system' is not a policy"):
        TrainSpec(checkpoint_policies=("os.system",))
    assert TrainSpec(checkpoint_policies=SAC).checkpoint_policies == (SAC,)  # one name, "full" dropped
    assert TrainSpec(checkpoint_policies=("full", SAC, SAC)).checkpoint_policies == (SAC,)


@pytest.mark.slow
def test_a_planned_policy_is_stated_priced_as_built_replayed_and_verified():
    from treadle.planner import Plan, plan_model

    cl = parse_cluster("2x1:h100")  # a GPU preset: the dispatch modes' host cost is hidden (on a CPU: refused)
    inputs = lm_inputs(8, 64)

    def hand(policy):
        sch = treadle.create_schedule(tiny_llama(LAYERS), mesh=cl.mesh)
        sch.data_parallel(axis="dp")
        if policy:
            sch["model.layers"].checkpoint_every(1, policy=policy)
        return treadle.price(sch, inputs, cl)

    none, full = hand(None), hand("full")
    # where two blocks under the policy fit and one fully checkpointed block does not (priced: 2 full blocks are
    # slower than 2 under the policy; at 0.7 one full block fits and is the fastest)
    budget = full.peak_bytes + 0.63 * (none.peak_bytes - full.peak_bytes)
    kw = dict(cluster=cl, memory_budget_bytes=budget, zero=False, pp_axis=None, dp_axis="dp")
    plain = plan_model(tiny_llama(LAYERS), inputs, **kw)
    plan = plan_model(tiny_llama(LAYERS), inputs, train=TrainSpec(checkpoint_policies=(SAC,)), **kw)
    text = plan.schedule.to_python()
    assert f"policy='{SAC}'" in text, text
    assert plan.solver["policies"] == {f"model.layers.0: {SAC}": text.count(f"policy='{SAC}'")}
    assert "policies" not in plain.solver and "policy=" not in plain.schedule.to_python()
    priced, priced_plain = plan.estimate(), plain.estimate()
    assert priced.peak_bytes <= budget
    assert priced.step_s <= priced_plain.step_s  # the policy is chosen where it is faster as built
    again = Plan.from_json(plan.to_json())
    assert again.schedule_for(tiny_llama(LAYERS)).to_python() == text
    lines = "\n".join(plan.python_lines())
    assert f".checkpoint(policy='{SAC}')" in lines
    report = treadle.verify(plan.schedule, inputs, steps=2, timeout_s=300)
    assert report.ok, report


def test_a_plan_file_names_only_known_policies():
    from treadle.planner.decision_check import check_decision

    check_decision("checkpoint", "model.layers.0", {"policy": SAC}, "", where="plan.json: decision 0")
    with pytest.raises(PlanError, match=r"plan.json: decision 0 \(checkpoint at 'model.layers.0'\): argument "
                                        r"'policy' must be policy name, got 'os.system'"):
        check_decision("checkpoint", "model.layers.0", {"policy": "os.system"}, "", where="plan.json: decision 0")


# NOTE [checkpoint policies in a pipeline's stages]
@pytest.mark.parametrize("cluster", ["1x2:h100", "1x2:cpu"])
@pytest.mark.parametrize("kind", ["1f1b", "interleaved_1f1b"])
def test_each_pipeline_stage_weighs_the_policy_and_the_milp_agrees_with_the_oracle(graph, cluster, kind):
    from treadle.forms.pipeline import cuts, milp
    from treadle.forms.pipeline import oracle as pipeline_oracle

    cl = parse_cluster(cluster)
    pp = cl.mesh.names[1]
    cg = build_cost_graph(graph, cl, Roles((), False, (), pp=pp, pp_microbatches=2),
                          train=TrainSpec(checkpoint_policies=(SAC,)))
    lay = cuts._layout(cg, kind)
    stages = cuts.partitions(cg, lay)[0]
    cut = cuts._cut(cg, lay, stages)
    kw = dict(checkpoint=True, time_limit_s=30, rel_gap=1e-9, min_ckpt={})
    free = pipeline_oracle.solve_exhaustive(cg, stages, budget_bytes=None, schedule=kind)
    low, *_ = milp._solve_cut(cg, lay, cut, budget_bytes=None, minimise="memory", **kw)
    least = milp.evaluate(cg, lay, cut, *low[:3])[1]
    used = []
    for frac in (0.0, 0.2, 0.4, 0.6, 0.8):
        budget = least + frac * (free.peak_bytes - least)
        oracle = pipeline_oracle.solve_exhaustive(cg, stages, budget_bytes=budget, schedule=kind)
        (choice, counts, pcounts, status, _), *_ = milp._solve_cut(cg, lay, cut, budget_bytes=budget,
                                                                  minimise="time", **kw)
        step, peak, _ = milp.evaluate(cg, lay, cut, choice, counts, pcounts)
        assert status == "optimal" and peak <= budget * (1 + 1e-9)
        assert step == pytest.approx(oracle.step_s, rel=1e-6), (frac, counts, pcounts, oracle.stages)
        for (t, st), n in counts.items():  # each stage's blocks: full checkpoints and the policy's, at most its own
            assert n + sum(v for (t2, s2, _), v in pcounts.items() if (t2, s2) == (t, st)) <= cut.n[st][t]
        used += [n for n in pcounts.values() if n]
        # the choice as data: each block once, under the policy or fully checkpointed as the counts say
        sc = milp._choice_of(cg, lay, cut, counts, {"stage_s": (), "rank_peak_bytes": (), "bubble_s": 0.0},
                             pcounts)
        for st in range(lay.n_stages):
            under = [p for p, _ in (sc.policies[st] if sc.policies else ())]
            assert len(under) == sum(n for (_, s2, _), n in pcounts.items() if s2 == st)
            assert not set(under) & set(sc.checkpointed[st]) and set(under) <= set(sc.blocks[st])
    if cl.is_cpu():  # the dispatch modes' ~10 us an op: full checkpoints are cheaper on a CPU core
        assert not used
    else:  # hidden behind a GPU: some budget runs blocks of a stage under the policy
        assert used


@pytest.mark.slow
def test_a_planned_pipeline_runs_blocks_under_the_policy_priced_as_built_and_verified():
    from treadle.planner import Plan, plan_model

    cl = parse_cluster("1x2:h100")  # a GPU preset: the dispatch modes' host cost is hidden
    pp = cl.mesh.names[1]
    inputs = lm_inputs(8, 64)
    kw = dict(cluster=cl, pp_axis=pp, pp_schedule="1f1b", price_top=1)
    budget = 0.85 * plan_model(tiny_llama(LAYERS), inputs, **kw).estimate().peak_bytes
    plain = plan_model(tiny_llama(LAYERS), inputs, memory_budget_bytes=budget, **kw)
    plan = plan_model(tiny_llama(LAYERS), inputs, memory_budget_bytes=budget,
                      train=TrainSpec(checkpoint_policies=(SAC,)), **kw)
    text = plan.schedule.to_python()
    assert "cut_pipeline_stage()" in text and f"policy='{SAC}'" in text, text
    under = [p for st in plan.solver["stages"]["policies"] for p, _ in st]
    assert under and text.count(f"policy='{SAC}'") == len(under)
    assert f"under {SAC}" in plan.explain()
    priced, priced_plain = plan.estimate(), plain.estimate()
    assert priced.peak_bytes <= budget and priced.step_s <= priced_plain.step_s
    again = Plan.from_json(plan.to_json())
    assert again.schedule_for(tiny_llama(LAYERS)).to_python() == text
    assert treadle.verify(plan.schedule, inputs, steps=2, timeout_s=300).ok
