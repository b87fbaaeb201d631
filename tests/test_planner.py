"""Planner: capture, dimension algebra, ILP against exhaustive search, the acceptance plans, Plan data and CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from treadle.cost.cluster import ClusterSpec
from treadle.cost.collective_cost import all_reduce_time_s
from treadle.cost.links import link_preset
from treadle.errors import PlanError
from treadle.mesh import Mesh
from treadle.planner.capture import capture
from treadle.planner.checkpoint_dp import ChainBlock, solve_chain
from treadle.planner.cost_graph import Roles, build_cost_graph
from treadle.planner.dims import P, R, axis_options, dim_spec, register_dims, unknown_ops
from treadle.planner.ilp import solve, solve_exhaustive
from treadle.planner import Plan, plan_model
from treadle.profile.roofline import op_time_s
from treadle.planner.capabilities import runtime_capabilities, shardable_fn as _shardable_fn


# ----------------------------------------------------------------------------- models
class GPTMLP(nn.Module):
    """LayerNorm, then a GPT-style MLP (fc -> GELU -> proj) with a residual."""

    def __init__(self, h: int):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.proj(self.act(self.fc(self.ln(x))))


class Stack(nn.Module):
    """An input projection, `n` identical blocks in a ModuleList, a head; returns a scalar loss."""

    def __init__(self, h: int, n: int, block=GPTMLP):
        super().__init__()
        self.inp = nn.Linear(h, h)
        self.blocks = nn.ModuleList([block(h) for _ in range(n)])
        self.head = nn.Linear(h, h)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


class TinyBlock(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.fc = nn.Linear(h, h, bias=False)

    def forward(self, x):
        return torch.relu(self.fc(x))


def fake_inputs(*shape):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.randn(*shape)


def cluster(shape, names, link="nvlink4", device="h100-sxm"):
    return ClusterSpec.uniform(Mesh(shape, names), link, device=device)


# ----------------------------------------------------------------------------- capture
def test_capture_paths_and_repeated_blocks():
    model = Stack(32, 5)
    g = capture(model, (torch.randn(2, 8, 32),))
    assert len(model.blocks) == 5  # restored after capture
    assert [(b.path, b.weight) for b in g.blocks] == [("blocks.0", 1), ("blocks.1", 4)]
    assert g.blocks[0].template == g.blocks[1].template == 0
    assert g.blocks[1].members == ["blocks.1", "blocks.2", "blocks.3", "blocks.4"]
    linears = [n for n in g.ops() if n.op_name == "linear"]
    assert [n.module for n in linears] == ["inp", "blocks.0.fc", "blocks.0.proj", "blocks.1.fc", "blocks.1.proj",
                                           "head"]
    assert g.params["blocks.1.fc.weight"].shape == (128, 32)
    assert g.n_real_params == sum(p.numel() for p in model.parameters())


def test_capture_failure_names_the_model():
    class Bad(nn.Module):
        def forward(self, x):
            return {1, 2}  # not a tensor output

    with pytest.raises(PlanError, match="capture of Bad"):
        capture(Bad(), (torch.randn(2),))


# ----------------------------------------------------------------------------- dimension algebra
def _node(g, op_name, module=None):
    return next(n for n in g.ops() if n.op_name == op_name and (module is None or n.module == module))


def test_linear_options_match_the_algebra():
    g = capture(Stack(16, 3), (torch.randn(4, 8, 16),))
    n = _node(g, "linear", "blocks.0.fc")  # x (4,8,16) @ w (64,16)^T + b (64)
    opts = axis_options(n, g.nodes, dim_spec(n, g.nodes), 2)
    got = {(o.ins, o.outs, o.work_split) for o in opts}
    # inputs (x, w, b): replicate; batch dims; column (n: w and b split); row (k: Partial output, bias whole,
    # added once after the reduction); no Partial-through x (the bias makes the op affine in x)
    assert got == {((R, R, R), (R,), False), ((0, R, R), (0,), True), ((1, R, R), (1,), True),
                   ((R, 0, 0), (2,), True), ((2, 1, R), (P,), True)}
    col = next(o for o in opts if o.outs == (2,))
    assert col.grad_partial == (True, False, False)  # Megatron's f: x's gradient is a pending sum


def test_row_parallel_and_partial_through_without_bias():
    g = capture(Stack(16, 3, TinyBlock), (torch.randn(4, 8, 16),))
    n = _node(g, "linear", "blocks.0.fc")
    outs = {(o.ins, o.outs) for o in axis_options(n, g.nodes, dim_spec(n, g.nodes), 4)}
    assert ((2, 1), (P,)) in outs  # contraction dim sharded: Partial output
    assert ((P, R), (P,)) in outs  # linear in x: Partial flows through
    relu = _node(g, "relu", "blocks.0")
    assert all(P not in o.ins for o in axis_options(relu, g.nodes, dim_spec(relu, g.nodes), 4))


def test_view_maps_leading_dim_only():
    class Heads(nn.Module):
        def forward(self, x):
            return x.view(4, 8, -1, 4).sum()

    g = capture(Heads(), (torch.randn(4, 8, 16),))
    n = _node(g, "view")
    pairs = {(o.ins[0], o.outs[0]) for o in axis_options(n, g.nodes, dim_spec(n, g.nodes), 2) if o.letter is not None}
    assert pairs == {(0, 0), (1, 1), (2, 2)}  # hidden -> heads; head_dim is never created sharded


def test_register_dims_rejects_duplicates_and_unknown_ops_are_reported():
    with pytest.raises(PlanError, match="'linear' is already registered"):
        register_dims("linear")(lambda n, ns: None)

    class Odd(nn.Module):
        def forward(self, x):
            return torch.kthvalue(x, 2, dim=-1).values.sum()

    g = capture(Odd(), (torch.randn(3, 5),))
    assert unknown_ops(g.nodes) == {"kthvalue": 1}
    n = _node(g, "kthvalue")
    assert len(axis_options(n, g.nodes, dim_spec(n, g.nodes), 2)) == 1  # replicate only


# ----------------------------------------------------------------------------- ILP vs exhaustive search
def _small_graph():
    model = Stack(64, 3, TinyBlock)
    g = capture(model, (fake_inputs(8, 64, 64),))
    assert sum(1 for _ in g.ops()) <= 12
    is_leaf, _ = runtime_capabilities(model)
    return g, is_leaf


@pytest.mark.parametrize("roles", [Roles("dp", False, ("tp",)), Roles("dp", True, ("tp",)),
                                   Roles(None, False, ("dp", "tp"))], ids=str)
def test_ilp_equals_exhaustive_on_2x2(roles):
    g, is_leaf = _small_graph()
    cl = cluster((2, 2), ("dp", "tp"), link="pcie4")
    cg = build_cost_graph(g, cl, roles, shardable=_shardable_fn(g, is_leaf, len(roles.tp)))
    free = solve_exhaustive(cg, budget_bytes=None)
    tightest = solve(cg, budget_bytes=None, minimise="memory").peak_bytes
    budgets = [None, free.peak_bytes * 0.999, (free.peak_bytes + tightest) / 2, tightest * 1.0001]
    for budget in budgets:
        ref = solve_exhaustive(cg, budget_bytes=budget)
        got = solve(cg, budget_bytes=budget)
        assert got.status == "optimal" and ref.status == "optimal", budget
        assert math.isclose(got.step_s, ref.step_s, rel_tol=1e-6, abs_tol=1e-12), (budget, got, ref)
        assert budget is None or got.peak_bytes <= budget * (1 + 1e-9)
    below = solve(cg, budget_bytes=tightest * 0.99)
    assert below.status == "infeasible" and solve_exhaustive(cg, budget_bytes=tightest * 0.99).status == "infeasible"


def test_exhaustive_space_limit_is_an_error():
    g, is_leaf = _small_graph()
    cg = build_cost_graph(g, cluster((2, 2), ("dp", "tp")), Roles(None, False, ("dp", "tp")),
                          shardable=_shardable_fn(g, is_leaf, 2))
    with pytest.raises(PlanError, match="exceed the limit 10"):
        solve_exhaustive(cg, budget_bytes=None, limit=10)


# ----------------------------------------------------------------------------- acceptance plans
def test_megatron_plan_on_a_1d_mesh():
    """Replicated input and output, fast axis, big hidden: column then row, one all-reduce each way."""
    h, b, s = 2048, 8, 1024
    model = Stack(h, 3)
    cl = cluster((8,), ("tp",))
    plan = plan_model(model, (fake_inputs(b, s, h),), cluster=cl, dp_axis=None)
    shards = {(d.path, d.args["names"], d.args["dim"]) for d in plan.decisions if d.op == "shard"}
    for i in range(3):
        assert (f"blocks.{i}.fc", "weight", 0) in shards and (f"blocks.{i}.fc", "bias", 0) in shards
        assert (f"blocks.{i}.proj", "weight", 1) in shards
    syncs = {(d.path, d.args["from_"], d.args["to"]) for d in plan.decisions if d.op == "sync"}
    assert {(f"blocks.{i}.proj", "P", "R") for i in range(3)} <= syncs
    assert not any(p.startswith("blocks.") for p, _, _ in syncs - {(f"blocks.{i}.proj", "P", "R") for i in range(3)})
    # each block communicates exactly: all-reduce of the (b, s, h) output forward, of the input grad backward,
    # each with the runtime's clone of its buffer, and the view Megatron's "f" hands forward (NOTE [copies])
    row = {r.path: r for r in plan.rows}
    nbytes = b * s * h * 4
    ar = all_reduce_time_s(nbytes, 8, link_preset("nvlink4"))
    hw = cl.rank_hardware()
    clone = op_time_s(0, 2 * nbytes, hw, torch.float32) + hw.op_overhead_s
    assert math.isclose(row["blocks.0.fc"].comm_s / 3 + row["blocks.0.proj"].comm_s / 3,
                        2 * ar + 2 * clone + hw.op_overhead_s, rel_tol=1e-9)
    # MFU from first principles: matmul FLOPs 2*T*in*out forward, twice that backward, except the input
    # gradient of the first linear (the user input needs none)
    T = b * s
    fwd = 2 * T * (h * h + 3 * (h * 4 * h * 2) + h * h)
    model_flops = 3 * fwd - 2 * T * h * h
    peak = cl.hardware().peak_for(torch.float32)
    assert math.isclose(plan.estimated.mfu, model_flops / 8 / plan.estimated.step_s / peak, rel_tol=1e-6)


def test_ample_memory_and_fast_axis_gives_data_parallel():
    model = Stack(512, 4)
    plan = plan_model(model, (fake_inputs(64, 512, 512),), cluster=cluster((4,), ("dp",)),
                      memory_budget_bytes=80 * 2**30)
    assert [d.op for d in plan.decisions] == ["data_parallel"]
    assert plan.decisions[0].args == {"axis": "dp", "shard": False}
    assert plan.estimate().comm_s == pytest.approx(0.0, abs=1e-9)  # every collective hidden
    assert plan.binding.startswith("none")


def test_tight_budget_gives_sharding_and_checkpointing_under_the_budget():
    model = Stack(1024, 6)
    x = fake_inputs(16, 1024, 1024)
    cl = cluster((2, 2), ("dp", "tp"), link="pcie4")
    free = plan_model(model, (x,), cluster=cl, pp_axis=None)  # sharding and checkpointing (pipelines: elsewhere)
    assert not any(d.op == "checkpoint" for d in free.decisions)
    budget = free.estimated.peak_bytes * 0.45
    plan = plan_model(model, (x,), cluster=cl, memory_budget_bytes=budget, pp_axis=None)
    ops = {d.op for d in plan.decisions}
    assert "checkpoint" in ops
    assert "shard" in ops or any(d.op == "data_parallel" and d.args["shard"] for d in plan.decisions)
    assert plan.estimated.peak_bytes <= budget
    assert plan.estimated.step_s >= free.estimated.step_s
    assert plan.binding.startswith("memory binds") or plan.estimated.peak_bytes <= budget
    two = plan_model(model, (x,), cluster=cl, memory_budget_bytes=budget, mode="two_stage", pp_axis=None)
    assert two.estimated.step_s >= plan.estimated.step_s * (1 - 1e-9)  # joint optimises over a superset


def test_infeasible_budget_states_the_smallest_budget():
    model = Stack(256, 3)
    x = fake_inputs(8, 256, 256)
    cl = cluster((2,), ("tp",))
    with pytest.raises(PlanError, match=r"smallest budget any plan meets is [0-9.]+ [MG]iB \((\d+) B\)") as info:
        plan_model(model, (x,), cluster=cl, memory_budget_bytes=1e5)
    smallest = float(info.value.args[0].split("iB (")[-1].split(" B)")[0])
    ok = plan_model(model, (x,), cluster=cl, memory_budget_bytes=smallest * 1.001)
    assert ok.estimated.peak_bytes <= smallest * 1.001


def test_pins_forbidden_axes_and_partial_schedule():
    from treadle.schedule.core import create_schedule

    model = Stack(1024, 3)
    x = fake_inputs(8, 512, 1024)
    cl = cluster((2, 2), ("dp", "tp"))
    plan = plan_model(model, (x,), cluster=cl, pins={"blocks.*.fc.weight": {"tp": "R"}})
    assert not any(d.op == "shard" and d.path.endswith(".fc") for d in plan.decisions)
    off = plan_model(model, (x,), cluster=cl, forbid_axes=("tp",))
    assert not any(d.args.get("axis") == "tp" for d in off.decisions)
    sch = create_schedule(Stack(1024, 3), mesh=cl.mesh)
    sch["blocks.0.proj"].shard("weight", dim=1, axis="tp")
    sch.data_parallel(axis="dp", shard=True)
    part = plan_model(model, (x,), cluster=cl, partial_schedule=sch)
    assert any(d.op == "shard" and d.path == "blocks.2.proj" and d.args["dim"] == 1 for d in part.decisions)
    assert part.roles == "data-parallel dp (ZeRO-3); tensor tp"
    with pytest.raises(PlanError, match="pin 'nope.weight' matches no parameter"):
        plan_model(model, (x,), cluster=cl, pins={"nope.weight": {"tp": 0}})


def test_plan_json_round_trip_diff_and_schedule():
    model = Stack(1024, 3)
    x = fake_inputs(8, 512, 1024)
    cl = cluster((2,), ("tp",))
    a = plan_model(model, (x,), cluster=cl, dp_axis=None, model_spec={"name": "stack"})
    b = plan_model(model, (x,), cluster=cl, dp_axis=None, pins={"blocks.*.fc.weight": {"tp": "R"}})
    d = json.loads(a.to_json())
    assert d["schedule"]["records"] and d["model"] == {"name": "stack"}
    back = Plan.from_json(a.to_json())
    assert [str(x) for x in back.decisions] == [str(x) for x in a.decisions]
    assert back.estimated == a.estimated and back.diff(a) == []
    changes = a.diff(b)
    assert any(c.startswith("- ") and "blocks.0.fc" in c for c in changes) and changes[-1].startswith("step ")
    groups = {(x.path, x.args["dim"], x.args["axis"]) for x in a.decisions if x.op == "shard"}
    assert a.schedule.to_python().count(".shard(") == len(groups) > 0
    with pytest.raises(PlanError, match="schedule_for"):
        back.schedule
    with pytest.raises(PlanError, match="loaded from JSON"):
        back.what_if(pins={})
    # "why not keep the MLP's first weight whole?": the same question answered by re-planning
    other, why = a.what_if(pins={"blocks.*.fc.weight": {"tp": "R"}})
    assert why == changes and other.estimated == b.estimated
    assert "binding constraint" in a.explain()


# ----------------------------------------------------------------------------- two-stage chain DP
def test_chain_dp_matches_brute_force():
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(40):
        blocks = [ChainBlock(rng.randint(1, 3), rng.uniform(1, 10), rng.uniform(0, 1), rng.uniform(0.1, 2))
                  for _ in range(rng.randint(1, 3))]
        base = rng.uniform(0, 5)
        budget = base + rng.uniform(0, sum(b.count * b.act_bytes for b in blocks) + 5)
        best = None
        for counts in itertools.product(*[range(b.count + 1) for b in blocks]):
            kept = sum((b.count - c) * b.act_bytes + c * b.input_bytes for b, c in zip(blocks, counts))
            peak = base + kept + max((b.act_bytes for b, c in zip(blocks, counts) if c), default=0.0)
            if peak <= budget:
                cost = sum(c * b.fwd_s for b, c in zip(blocks, counts))
                best = cost if best is None else min(best, cost)
        got = solve_chain(blocks, base_bytes=base, budget_bytes=budget)
        assert got.feasible == (best is not None)
        if best is not None:
            assert math.isclose(got.recompute_s, best, abs_tol=1e-12) and got.peak_bytes <= budget + 1e-9


# ----------------------------------------------------------------------------- CLI
def test_cli_plan_and_explain(tmp_path, capsys):
    from treadle.cli import main

    out = tmp_path / "plan.json"
    rc = main(["plan", "tiny-llama", "--cluster", "2x2:a100", "--mesh", "2x2", "--memory", "40GiB", "--batch", "4",
               "--seq", "16", "-o", str(out)])
    assert rc == 0
    saved = json.loads(out.read_text())
    assert saved["model"] == {"name": "tiny-llama", "batch": 4, "seq": 16, "dtype": "bf16"}  # the GPU default
    assert saved["schedule"]["mesh"] == {"shape": [2, 2], "names": ["dp", "tp"]}
    capsys.readouterr()
    assert main(["explain", str(out), "--python"]) == 0
    text = capsys.readouterr().out
    assert "binding constraint" in text and "model.layers.0" in text
    assert main(["plan", "tiny-llama", "--cluster", "2x2:a100", "--mesh", "2x2", "--memory", "1KiB", "--batch", "4",
                 "--seq", "16"]) == 2
    assert "smallest budget" in capsys.readouterr().err.replace("\n", "")


def test_joint_never_worse_than_two_stage_and_wins_where_sharding_saves_activations():
    """On a slow 2-way link, sharding costs a little time but halves a block's activations: under a budget
    that fits most blocks whole, the joint ILP shards some instead of checkpointing; two-stage cannot."""
    model = Stack(1024, 6)
    x = fake_inputs(16, 1024, 1024)
    cl = cluster((2,), ("tp",), link="pcie4")
    free = plan_model(model, (x,), cluster=cl, dp_axis=None, pp_axis=None)  # (a pipeline is solved whole in both)
    gains = []
    for frac in (0.9, 0.8, 0.6):
        budget = free.estimated.peak_bytes * frac
        joint = plan_model(model, (x,), cluster=cl, dp_axis=None, memory_budget_bytes=budget, pp_axis=None)
        two = plan_model(model, (x,), cluster=cl, dp_axis=None, memory_budget_bytes=budget, mode="two_stage",
                         pp_axis=None)
        assert joint.estimated.peak_bytes <= budget and two.estimated.peak_bytes <= budget
        assert joint.estimated.step_s <= two.estimated.step_s * (1 + 1e-9)
        gains.append(two.estimated.step_s / joint.estimated.step_s)
    assert max(gains) > 1.02, gains
