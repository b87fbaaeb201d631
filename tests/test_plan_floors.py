"""The bounds that let the search skip work without changing its answer: the memory floor of a role assignment
before its costs (NOTE [a memory floor before the costs] in `treadle.planner.floors`; a pipeline's: NOTE [a
memory floor of the stages] in `treadle.forms.pipeline.floors`), and the pipeline MILP's time floors and per-cut
memory floor (NOTE [a lower bound before the MILP]). Each floor is held under what the solver finds, and a search
with them finds the plan a search without them finds."""

from __future__ import annotations

import re

import pytest

from treadle.cost.cluster import parse_cluster
from treadle.errors import PlanError
from treadle.forms.pipeline import cuts, floors, milp
from treadle.forms.pipeline.zero import zero_terms
from treadle.models.zoo import named_model
from treadle.planner import plan_model
from treadle.planner import search as S
from treadle.planner.explain import explain_text
from treadle.planner.floors import OverMemoryFloor
from treadle.planner.ilp import solve
from treadle.planner.pins import pins_for

GiB = 2**30


def _search(cluster: str = "2x2:a100"):
    model, inputs = named_model("tiny-llama", batch=8, seq=32, fake=True)
    req = S.make_request(model, dict(
        cluster=parse_cluster(cluster), memory_budget_bytes=None, mode="joint", pins=None, dp_axis="auto", zero=None,
        reshard_after_forward=True, forbid_axes=(), partial_schedule=None, train=S.TrainSpec(), time_limit_s=30,
        model_spec=None, checkpoint="auto", progress=None, loss_fn=None, price_top=0, pp_axis="auto",
        execution="eager", float8=None, expert_load_imbalance=1.0))
    return model, inputs, S.capture_model(model, (), inputs, req)


def _graphs(search):
    """(roles, cost graph, its memory floor) of every candidate whose cost graph builds."""
    out = []
    for cl, roles in S.candidates(search):
        pins = pins_for(search.graph, search.req.pins, roles)
        try:
            cg = S.cost_graph_for(search, cl, roles, pins)
        except PlanError:
            continue  # e.g. a batch that does not split into the micro-batches
        with pytest.raises(OverMemoryFloor) as exc:  # one byte: every floor is over it, and says what it is
            S.cost_graph_for(search, cl, roles, pins, 1.0)
        assert "every plan needs at least" in str(exc.value) and str(roles) in str(exc.value)
        out.append((roles, cg, exc.value.floor_bytes))
    return out


@pytest.fixture(scope="module")
def graphs():
    return _graphs(_search()[2])


def test_the_memory_floor_is_under_the_smallest_peak_the_solver_finds_and_not_trivial(graphs):
    piped = [g for g in graphs if g[0].pp]
    assert piped and len(piped) < len(graphs)  # both kinds: the core's floor and the pipeline form's
    ratios = []
    for roles, cg, floor in graphs:
        low = solve(cg, budget_bytes=None, time_limit_s=30, minimise="memory")  # a pipeline: over its proposed cuts
        assert cg.fixed_static_bytes < floor <= low.peak_bytes * (1 + 1e-9), roles
        ratios.append(floor / low.peak_bytes)
    # a floor that says something: on this model between 0.44 and 0.81 of the smallest peak (measured)
    assert min(ratios) > 0.3 and sorted(ratios)[len(ratios) // 2] > 0.6


def test_the_pipeline_floors_are_under_every_solved_cut(graphs):
    checked, ratios, tighter = 0, [], 0
    for roles, cg, _ in graphs:
        if not roles.pp:
            continue
        zt = zero_terms(cg)
        mins, mem = floors._unit_mins(cg, zt), floors._memory_mins(cg, zt)
        # NOTE [a block's floors under the layout match]: never below the plain floors, held like them below
        plain = mins, mem
        mins, mem = floors.coupled_mins(cg, milp.base_model(cg), milp.unit_coefs(cg, zt), mins, mem)
        assert all(a >= b for a, b in zip(mins[0], plain[0][0])) and all(a >= b for a, b in zip(mem[0], plain[1][0]))
        tighter += sum(mins[0]) > sum(plain[0][0]) * (1 + 1e-6) or sum(mem[0]) > sum(plain[1][0]) * (1 + 1e-6)
        for kind in milp.schedules(cg):
            lay = cuts._layout(cg, kind)
            role_floor = floors._role_floor(cg, lay, mins)
            for stages in cuts.partitions(cg, lay):
                cut = cuts._cut(cg, lay, stages)
                got, *_ = milp._solve_cut(cg, lay, cut, budget_bytes=None, checkpoint=True, time_limit_s=30,
                                          rel_gap=1e-9, min_ckpt={}, minimise="time")
                step, peak, _ = milp.evaluate(cg, lay, cut, got[0], got[1])
                floor = floors._objective_floor(cg, lay, cut, zt, mins)
                # the MILP's objective is the step without the tied parameters' all-reduce
                assert role_floor <= floor * (1 + 1e-9) and floor <= (step - milp._tied_s(cg, lay)) * (1 + 1e-9)
                ratios.append(floor / step)
                assert floors._memory_floor_of_cut(cg, lay, cut, mem) <= peak * (1 + 1e-9)
                low, *_ = milp._solve_cut(cg, lay, cut, budget_bytes=None, checkpoint=True, time_limit_s=30,
                                          rel_gap=1e-9, min_ckpt={}, minimise="memory")
                assert floors._memory_floor_of_cut(cg, lay, cut, mem) <= milp.evaluate(cg, lay, cut, *low[:2])[1] * (
                    1 + 1e-9)
                checked += 1
    assert checked >= 6 and tighter >= 1, (checked, tighter)
    # a bound that says something: 0.14 to 0.90 of the step here (measured; the sends and the recomputes it
    # leaves out weigh most on a tiny model)
    assert min(ratios) > 0.1 and max(ratios) > 0.8


def test_the_recomputation_a_budget_forces_is_under_every_solved_cut(graphs):
    # NOTE [the recomputation a budget forces]: between a cut's smallest peak and its free plan's, the time floor
    # with the forced recomputation stays under the MILP's objective, and it is None only where nothing fits
    checked, forced, nothing = 0, 0, 0
    for roles, cg, _ in graphs:
        if not roles.pp:
            continue
        zt = zero_terms(cg)
        mins, mem = floors._unit_mins(cg, zt), floors._memory_mins(cg, zt)
        tm = floors.template_mins(cg, mem)
        mins, mem = floors.coupled_mins(cg, milp.base_model(cg), milp.unit_coefs(cg, zt), mins, mem)
        for kind in ("1f1b", "interleaved_1f1b"):
            if kind not in milp.schedules(cg):
                continue
            lay = cuts._layout(cg, kind)
            for stages in cuts.partitions(cg, lay):
                cut = cuts._cut(cg, lay, stages)
                kw = dict(checkpoint=True, time_limit_s=30, rel_gap=1e-9, min_ckpt={})
                free, *_ = milp._solve_cut(cg, lay, cut, budget_bytes=None, minimise="time", **kw)
                low, *_ = milp._solve_cut(cg, lay, cut, budget_bytes=None, minimise="memory", **kw)
                top, bottom = (milp.evaluate(cg, lay, cut, *x[:2])[1] for x in (free, low))
                for budget in (bottom + f * (top - bottom) for f in (0.0, 0.3, 0.7)):
                    got, *_ = milp._solve_cut(cg, lay, cut, budget_bytes=budget, minimise="time", **kw)
                    rec = floors._recompute_floor(cg, lay, cut, mem, tm, budget, True)
                    if got is None:
                        nothing += rec is None
                        continue
                    assert rec is not None, (roles, kind, stages, budget)
                    step = milp.evaluate(cg, lay, cut, got[0], got[1])[0]
                    floor = floors._objective_floor(cg, lay, cut, zt, mins, rec)
                    assert floor <= (step - milp._tied_s(cg, lay)) * (1 + 1e-9), (roles, kind, stages, budget)
                    forced += floor > floors._objective_floor(cg, lay, cut, zt, mins) * (1 + 1e-9)
                    checked += 1
                # under the smallest peak nothing fits, and no checkpoints make it fit by the floor either
                assert floors._recompute_floor(cg, lay, cut, mem, tm, 0.5 * bottom, True) is None
    assert checked >= 12 and forced >= 3, (checked, forced, nothing)


def _unfloored(monkeypatch):
    """The search without the floor before the costs (every cost graph built, the solver decides)."""
    built = S.cost_graph_for
    monkeypatch.setattr(S, "cost_graph_for", lambda search, cl, roles, pins, budget_bytes=None:
                        built(search, cl, roles, pins))


def test_a_search_with_the_floors_finds_the_plan_one_without_them_finds(graphs, monkeypatch):
    model, inputs, _ = _search()
    floors = sorted(f for _, _, f in graphs)
    budget = floors[len(floors) // 2]  # about half the role assignments cannot fit
    kw = dict(cluster=parse_cluster("2x2:a100"), memory_budget_bytes=budget, price_top=0)
    plan = plan_model(model, inputs, **kw)
    skipped = [a for a in plan.solver["alternatives"] if "memory_floor_bytes" in a]
    assert skipped and all(a["status"] == "infeasible" and a["memory_floor_bytes"] > budget for a in skipped)
    with monkeypatch.context() as mp:
        _unfloored(mp)
        plain = plan_model(model, inputs, **kw)
    assert (plan.roles, str(plan.cluster.mesh)) == (plain.roles, str(plain.cluster.mesh))
    assert plan.estimated.step_s == plain.estimated.step_s and plan.estimated.peak_bytes == plain.estimated.peak_bytes
    assert [(d.op, d.path, d.args) for d in plan.decisions] == [(d.op, d.path, d.args) for d in plain.decisions]
    # what the floor skipped, the solver found infeasible (or, a pipeline, cut off before it: NOTE [a cutoff from
    # the best plan found]); both searches account for the same role assignments
    solved = {a["roles"]: a["status"] for a in plain.solver["alternatives"]}
    solved.update({a["roles"]: "pruned" for a in plain.solver["pruned"]})
    assert all(solved[a["roles"]] in ("infeasible", "pruned") for a in skipped)
    assert any(solved[a["roles"]] == "infeasible" for a in skipped)
    mine = [a["roles"] for a in plan.solver["alternatives"]] + [a["roles"] for a in plan.solver["pruned"]]
    assert sorted(mine) == sorted(solved)
    least = min(a["memory_floor_bytes"] for a in skipped)
    assert re.search(rf"memory floor: {len(skipped)} role assignments cannot fit the budget and were not built "
                     rf"\(the least needs at least [0-9.]+ [KMG]iB: ", explain_text(plan))
    assert least > budget


def test_where_nothing_fits_the_error_names_the_smallest_budget_of_every_solve(graphs, monkeypatch):
    model, inputs, _ = _search()
    budget = min(f for _, _, f in graphs) * 0.9  # under every floor: no cost graph is built by the search
    kw = dict(cluster=parse_cluster("2x2:a100"), memory_budget_bytes=budget, price_top=0)
    with pytest.raises(PlanError, match="the smallest budget any plan meets") as floored:
        plan_model(model, inputs, **kw)
    with monkeypatch.context() as mp:
        _unfloored(mp)
        with pytest.raises(PlanError, match="the smallest budget any plan meets") as plain:
            plan_model(model, inputs, **kw)
    assert floored.value.smallest_budget_bytes == plain.value.smallest_budget_bytes > budget
    assert str(floored.value) == str(plain.value)


def test_the_collector_is_paused_while_planning_and_restored_as_it_was():
    """NOTE [the collector paused while planning]: off during the search, back as it was after, also on error."""
    import gc

    model, inputs = named_model("tiny-llama", batch=8, seq=32, fake=True)
    cluster = parse_cluster("1x2:a100")
    was = gc.isenabled()
    try:
        for state in (True, False):
            (gc.enable if state else gc.disable)()
            seen: list[bool] = []
            plan_model(model, inputs, cluster=cluster, progress=lambda _: seen.append(gc.isenabled()))
            assert seen and not any(seen) and gc.isenabled() is state
            with pytest.raises(PlanError, match="smallest budget"):
                plan_model(model, inputs, cluster=cluster, memory_budget_bytes=1024)
            assert gc.isenabled() is state
    finally:
        (gc.enable if was else gc.disable)()
