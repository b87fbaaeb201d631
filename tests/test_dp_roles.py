"""Data parallelism on any set of mesh axes: DDP over several axes, FSDP2, HSDP, reshard_after_forward — the
schedule language, numerics on gloo against the single-process model, the price by hand, and the planner."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import treadle
from treadle import Mesh
from treadle.cost import collective_cost as cc
from treadle.cost.cluster import ClusterSpec, parse_cluster
from treadle.errors import PlanError, ScheduleError
from treadle.models.megatron import megatron
from treadle.planner import ilp
from treadle.planner.capture import capture
from treadle.planner.cost_graph import Roles, build_cost_graph
from treadle.planner import enumerate_roles, plan_model
from treadle.pricing import price
from treadle.forms.data.facts import fsdp_units
from treadle.verify.verify import verify
from treadle.forms.data.plan import terms as dp_terms

from test_price import Net  # the same 3-block MLP the price rules are checked on
from tiny_models import tiny_gpt2, tiny_llama



def _two_by_two() -> treadle.Schedule:
    return treadle.create_schedule(Net(), mesh=Mesh((2, 2), ("dp", "tp")))


def _cluster() -> ClusterSpec:
    """2 nodes x 2 H100: dp across nodes (InfiniBand), tp inside a node (NVLink): different links per axis."""
    return ClusterSpec.from_physical(2, 2, intra="nvlink4", inter="ib-ndr", device="h100-sxm")


# ------------------------------------------------------------------------------------------ schedule language
def test_ddp_over_two_axes_records_and_round_trips():
    sch = _two_by_two()
    sch.data_parallel(axis=("tp", "dp"))  # any order in; mesh order kept
    dp = sch._state.data_parallel
    assert (dp.axes, dp.shard_axes, dp.kind, dp.size(sch.mesh)) == (("dp", "tp"), (), "ddp", 4)
    # row-major over the axes in mesh order: coordinate (dp=1, tp=0) takes batch part 2
    assert [dp.index(sch.mesh.coordinate(r), sch.mesh) for r in range(4)] == [0, 1, 2, 3]
    assert "sch.data_parallel(axis=['tp', 'dp'], shard=False)" in sch.to_python()
    again = treadle.load_schedule(Net(), sch.to_json())
    assert again._state.data_parallel == dp and again.to_json() == sch.to_json()


def test_old_single_axis_form_and_json_stay_valid():
    sch = _two_by_two()
    sch.data_parallel(axis="dp", shard=True)
    doc = json.loads(sch.to_json())
    assert doc["records"][-1]["args"] == {"axis": "dp", "shard": True}  # unchanged record for the old form
    old = json.dumps({**doc, "records": [{"op": "data_parallel", "path": "", "args": {"axis": "dp", "shard": False}}]})
    st = treadle.load_schedule(Net(), old)._state
    assert (st.data_parallel.axes, st.data_parallel.kind) == (("dp",), "ddp")


def test_hsdp_and_reshard_after_forward_are_recorded():
    sch = _two_by_two()
    sch.data_parallel(axis="tp", shard=True, replicate="dp", reshard_after_forward=False)
    dp = sch._state.data_parallel
    assert (dp.shard_axes, dp.replicate_axes, dp.kind, dp.reshard_after_forward) == (("tp",), ("dp",), "hsdp", False)
    assert str(dp) == "hsdp: shard tp x replicate dp, no reshard after forward"
    assert treadle.load_schedule(Net(), sch.to_json())._state.data_parallel == dp


def _shard_then_dp():
    sch = _two_by_two()
    sch["inp"].shard("weight", dim=0, axis="tp")
    sch.data_parallel(axis=("dp", "tp"))


def _dp_then_shard():
    sch = _two_by_two()
    sch.data_parallel(axis=("dp", "tp"))
    sch["inp"].shard("weight", dim=0, axis="tp")


@pytest.mark.parametrize("call,message", [
    (lambda s: s.data_parallel(axis=("dp", "pp")), "mesh axes ['pp'] do not exist"),
    (lambda s: s.data_parallel(axis=("dp", "dp")), "mesh axes ['dp'] are named twice"),
    (lambda s: s.data_parallel(axis="dp", shard=True, replicate="dp"), "mesh axes ['dp'] are named twice"),
    (lambda s: s.data_parallel(axis="dp", replicate="tp"), "replicate=('tp',) needs shard=True"),
    (lambda s: s.data_parallel(axis="dp", reshard_after_forward=False), "reshard_after_forward=False applies to FSDP2"),
    (lambda s: s.data_parallel(axis=()), "axis names no mesh axis"),
    (lambda s: s.data_parallel(axis=3), "axis must be a mesh axis name or a tuple of them, got 3"),
    (lambda s: s["inp"].data_parallel(axis="dp"), "call it on the root schedule"),
], ids=["unknown", "twice", "twice-across", "replicate-ddp", "reshard-ddp", "empty", "type", "not-root"])
def test_data_parallel_refuses_bad_axes(call, message):
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        call(_two_by_two())


def test_data_parallel_refuses_an_axis_that_shards_parameters_either_way_round():
    with pytest.raises(ScheduleError, match=r"mesh axis 'tp' already shards parameters \['inp.weight'\]"):
        _shard_then_dp()
    with pytest.raises(ScheduleError, match="mesh axis 'tp' is the data-parallel axis"):
        _dp_then_shard()


# ------------------------------------------------------------------------------------------ numerics on gloo
def _ids(batch: int = 4, seq: int = 8) -> dict:
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _verify_all_grads(sch: treadle.Schedule, n_params: int) -> None:
    rep = verify(sch, _ids(), steps=1)
    assert rep.ok, rep.summary()
    grads = [c for c in rep.checks if c.kind == "param_grad"]
    assert len(grads) == n_params and all(c.diff.ok for c in grads)
    assert any(c.kind == "output" for c in rep.checks) and all(c.diff.ok for c in rep.checks if c.kind == "output")


@pytest.mark.slow
def test_ddp_over_both_axes_of_a_2x2_mesh_matches_the_original():
    model = tiny_gpt2(1)
    n_params = len(list(model.parameters()))
    sch = treadle.create_schedule(model, mesh=Mesh((2, 2), ("dp", "tp")))
    sch.data_parallel(axis=("dp", "tp"))  # 4 replicas: the batch of 4 splits into 4 rows
    _verify_all_grads(sch, n_params)


@pytest.mark.slow
def test_hsdp_shard_outer_replicate_inner_matches_the_original():
    model = tiny_gpt2(1)
    n_params = len(list(model.parameters()))
    sch = treadle.create_schedule(model, mesh=Mesh((2, 2), ("dp", "tp")))
    sch.data_parallel(axis="dp", shard=True, replicate="tp")  # the 2-D (replicate, shard) mesh against mesh order
    _verify_all_grads(sch, n_params)


@pytest.mark.slow
def test_tensor_parallel_x_fsdp2_without_reshard_matches_the_original():
    model = tiny_llama(1)
    n_params = len(list(model.parameters()))
    sch = treadle.create_schedule(model, mesh=Mesh((2, 2), ("dp", "tp")))
    megatron(sch, tp="tp", dp=None)
    sch.data_parallel(axis="dp", shard=True, reshard_after_forward=False)
    _verify_all_grads(sch, n_params)


# ------------------------------------------------------------------------------------------ price by hand
def test_price_ddp_over_two_axes_is_one_flat_group_on_the_slowest_link():
    torch.manual_seed(0)
    cl = _cluster()
    sch = _two_by_two()
    sch.data_parallel(axis=("dp", "tp"))
    p = price(sch, {"x": torch.randn(8, 16)}, cl)
    grad_bytes = sum(q.numel() * 4 for q in sch.model.parameters())
    (ddp,) = [c for c in p.collectives if c["source"] == "ddp"]  # < 1 MiB: one bucket
    flat = cc.flat_link([cl.link("dp"), cl.link("tp")])
    assert flat.bandwidth_bytes_per_s == min(cl.link("dp").effective_bytes_per_s, cl.link("tp").effective_bytes_per_s)
    assert (ddp["axis"], ddp["nbytes"]) == ("dp,tp", grad_bytes)
    assert ddp["time_s"] == pytest.approx(cc.all_reduce_time_s(grad_bytes, 4, flat))
    assert ddp["time_s"] == pytest.approx(cc.all_reduce_axes_time_s(grad_bytes, cluster=cl, axes=("dp", "tp"),
                                                                    algorithm="flat"))
    assert p.data_parallel == "ddp over dp,tp" and p.grad_bytes == grad_bytes
    # the batch splits over all 4 ranks: rank 0 executes half the FLOPs of DDP over dp alone, whose tp pair
    # computes the same thing twice; the useful FLOPs (and so the MFU at one step time) are the model's either way
    one = _two_by_two()
    one.data_parallel(axis="dp")
    p_one = price(one, {"x": torch.randn(8, 16)}, cl)
    assert p_one.executed_flops == pytest.approx(2 * p.executed_flops)
    assert p.executed_flops == pytest.approx(p.model_flops / 4) and p_one.model_flops == p.model_flops
    assert p_one.mfu * p_one.step_s == pytest.approx(p.mfu * p.step_s)


def test_price_hsdp_reduce_scatters_then_all_reduces_the_shard():
    torch.manual_seed(0)
    cl = _cluster()
    sch = _two_by_two()
    model = sch.model
    sch.data_parallel(axis="tp", shard=True, replicate="dp")
    p = price(sch, {"x": torch.randn(8, 16)}, cl)
    block = sum(q.numel() * 4 for q in model.blocks[0].parameters())
    root = sum(q.numel() * 4 for q in model.inp.parameters())
    fs = [c for c in p.collectives if c["source"] == "fsdp"]
    gathers = [(c["axis"], c["module"], c["phase"]) for c in fs if c["kind"] == "all_gather"]
    assert gathers == [("tp", "", "fwd")] + [("tp", f"blocks.{i}", "fwd") for i in range(3)] + \
        [("tp", f"blocks.{i}", "bwd") for i in (2, 1, 0)]
    for c in fs:
        if c["kind"] != "all_reduce":
            assert c["time_s"] == pytest.approx(getattr(cc, f"{c['kind']}_time_s")(c["nbytes"], 2, cl.link("tp")))
    rs = {c["module"]: c for c in fs if c["kind"] == "reduce_scatter"}
    ar = {c["module"]: c for c in fs if c["kind"] == "all_reduce"}
    assert sorted(ar) == sorted(rs) == ["", "blocks.0", "blocks.1", "blocks.2"]
    for u, c in ar.items():
        unit = root if u == "" else block
        assert (c["axis"], c["nbytes"], rs[u]["nbytes"]) == ("dp", unit / 2, unit)
        assert c["time_s"] == pytest.approx(cc.all_reduce_time_s(unit / 2, 2, cl.link("dp")))
        assert c["start_s"] >= rs[u]["end_s"] - 1e-15  # the shard is all-reduced once reduce-scattered
    n = sum(q.numel() for q in model.parameters())
    assert p.grad_bytes == n * 4 / 2  # sharded over tp only: replicated over dp
    assert p.data_parallel == "hsdp: shard tp x replicate dp"


def test_price_without_reshard_after_forward_skips_backward_gathers_and_keeps_units():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    prices = {}
    for keep in (True, False):
        torch.manual_seed(0)
        model = Net()
        sch = treadle.create_schedule(model, mesh=Mesh((2,), ("dp",)))
        sch.data_parallel(axis="dp", shard=True, reshard_after_forward=keep)
        prices[keep] = price(sch, {"x": x}, ClusterSpec.uniform(sch.mesh, "nvlink4", device="h100-sxm"))
    assert fsdp_units(model) == ["blocks.0", "blocks.1", "blocks.2", ""]
    block = sum(q.numel() * 4 for q in model.blocks[0].parameters())
    root = sum(q.numel() * 4 for q in model.inp.parameters())
    bwd_gathers = {k: [c for c in p.collectives if c["kind"] == "all_gather" and c["phase"] == "bwd"]
                   for k, p in prices.items()}
    assert len(bwd_gathers[True]) == 3 and bwd_gathers[False] == []
    # gathered bytes at the peak: the root and two blocks (prefetch) vs every unit, kept to backward
    assert prices[False].transient_bytes - prices[True].transient_bytes == pytest.approx(
        (root + 3 * block) - (root + 2 * block))
    assert prices[False].comm_s < prices[True].comm_s


# ------------------------------------------------------------------------------------------ the planner's costs
class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).pow(2).mean()


def test_cost_graph_prices_hsdp_and_multi_axis_ddp_by_hand():
    model, x = _MLP(), torch.randn(8, 64)
    cl = _cluster()
    g = capture(model, (x,))
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    link_dp, link_tp = cl.link("dp"), cl.link("tp")
    flat = cc.flat_link([link_dp, link_tp])

    def bw(fn, b, n, link):
        return fn(b, n, link) - fn(0.0, n, link)

    def dp_sum(roles):
        cg = build_cost_graph(g, cl, roles)
        return cg, sum(u.count * u.costs[0].dp_comm_s for u in cg.units), sum(u.costs[0].static_bytes for u in cg.units)

    cg, dp, _ = dp_sum(Roles(("dp", "tp"), False, ()))
    assert dp == pytest.approx(bw(cc.all_reduce_time_s, nbytes, 4, flat)  # + full buckets' latency per byte
                               + cc.all_reduce_time_s(0.0, 4, flat) * nbytes / (25 * 2**20))
    assert dp_terms(cg).latency_s == pytest.approx(cc.all_reduce_time_s(0.0, 4, flat))  # one bucket
    cg, dp, static_hsdp = dp_sum(Roles(("dp", "tp"), True, (), replicate=("dp",)))
    assert dp == pytest.approx(2 * bw(cc.all_gather_time_s, nbytes, 2, link_tp)
                               + bw(cc.reduce_scatter_time_s, nbytes, 2, link_tp)
                               + bw(cc.all_reduce_time_s, nbytes / 2, 2, link_dp))
    root = (cc.all_gather_time_s(0.0, 2, link_tp) + cc.reduce_scatter_time_s(0.0, 2, link_tp)
            + cc.all_reduce_time_s(0.0, 2, link_dp))
    assert dp_terms(cg).latency_s == pytest.approx(root)  # no repeated blocks: the root unit only
    # parameters + gradients + AdamW state (8 B) of the 1/2 shard
    assert static_hsdp == pytest.approx(nbytes / 4 / 2 * (2 * 4 + 8))
    _, dp, static_keep = dp_sum(Roles(("dp", "tp"), True, (), reshard_after_forward=False))
    assert dp == pytest.approx(bw(cc.all_gather_time_s, nbytes, 4, flat)
                               + bw(cc.reduce_scatter_time_s, nbytes, 4, flat))
    assert static_keep == pytest.approx(nbytes / 4 / 4 * (2 * 4 + 8) + nbytes)  # the gathered copy is kept
    sol = ilp.solve(build_cost_graph(g, cl, Roles(("dp", "tp"), True, (), replicate=("dp",))), budget_bytes=None)
    assert sol.status != "infeasible"


def test_roles_refuse_replicate_outside_the_dp_axes():
    with pytest.raises(PlanError, match=r"replicate axes \('tp',\) must be data-parallel axes \('dp',\)"):
        Roles("dp", True, ("tp",), replicate=("tp",))
    assert Roles("dp", False, ("tp",)).dp == ("dp",) and Roles(None, False, ("tp",)).dp == ()
    assert str(Roles("dp", True, ("tp",))) == "data-parallel dp (ZeRO-3); tensor tp"


def test_enumerate_roles_puts_data_parallelism_on_every_subset_of_axes():
    mesh = Mesh((2, 2), ("dp", "tp"))
    roles = enumerate_roles(mesh, batch=8)
    assert Roles(("dp", "tp"), False, ()) in roles  # pure DP over all 4 ranks
    assert Roles(("dp", "tp"), True, (), replicate=("dp",)) in roles  # HSDP, both ways round
    assert Roles(("dp", "tp"), True, (), replicate=("tp",)) in roles
    assert Roles("dp", False, ("tp",)) in roles and Roles((), False, ("dp", "tp")) in roles
    assert len(roles) == 9  # none; dp, tp (DDP, ZeRO-3 each); both (DDP, ZeRO-3, 2 HSDP)
    assert not any(len(r.dp) == 2 for r in enumerate_roles(mesh, batch=2))  # 4 replicas do not divide 2
    both = enumerate_roles(mesh, batch=8, dp_axis=("tp", "dp"), zero=True, reshard_after_forward=None)
    assert {(r.replicate, r.reshard_after_forward) for r in both} == {
        (rep, keep) for rep in ((), ("dp",), ("tp",)) for keep in (True, False)}
    with pytest.raises(PlanError, match="data-parallel axis 'pp' is not a live mesh axis"):
        enumerate_roles(mesh, batch=8, dp_axis=("dp", "pp"))


def test_planner_finds_pure_dp_over_a_2x2_mesh_and_emits_the_new_form():
    model, _ = tiny_gpt2(2), None
    inputs = _ids(batch=8, seq=16)
    cl = parse_cluster("2x2:cpu")
    auto = plan_model(model, inputs, cluster=cl)
    alt = {a["roles"]: a for a in auto.solver["alternatives"]}
    assert "data-parallel dp,tp" in alt and "data-parallel dp,tp (HSDP: shard dp, replicate tp)" in alt
    assert auto.estimated.step_s <= alt["data-parallel dp,tp"]["step_s"]
    forced = plan_model(model, inputs, cluster=cl, dp_axis=("dp", "tp"), zero=False)
    (d,) = [d for d in forced.decisions if d.op == "data_parallel"]
    assert d.args == {"axis": ["dp", "tp"], "shard": False}
    assert forced.schedule._state.data_parallel.axes == ("dp", "tp")
    hand = treadle.create_schedule(tiny_gpt2(2), mesh=cl.mesh)
    hand.data_parallel(axis=("dp", "tp"))
    p = price(hand, inputs, cl)
    assert p.data_parallel == "ddp over dp,tp"
    # the solver's estimate of the role and the price of the hand-written DDP schedule agree within 15%
    assert forced.estimated.step_s == pytest.approx(p.step_s, rel=0.15)
    assert alt["data-parallel dp,tp"]["step_s"] == pytest.approx(forced.estimated.step_s)


def test_planner_roles_become_the_data_parallel_call_they_price():
    from treadle.forms.data.plan import data_parallel_args
    from treadle.planner.to_schedule import Decision, apply_decisions

    cases = {Roles(("dp", "tp"), False, ()): {"axis": ["dp", "tp"], "shard": False},
             Roles("dp", True, ("tp",)): {"axis": "dp", "shard": True},
             Roles(("dp", "tp"), True, (), replicate=("dp",), reshard_after_forward=False):
                 {"axis": "tp", "shard": True, "replicate": "dp", "reshard_after_forward": False}}
    for roles, args in cases.items():
        assert data_parallel_args(roles) == args
        sch = apply_decisions(_two_by_two(), [Decision("data_parallel", "", args, str(roles))],
                              leaf_module=lambda p: True)
        spec = sch._state.data_parallel
        assert (spec.axes, spec.shard_axes, spec.reshard_after_forward) == (
            roles.dp, roles.shard_axes, roles.reshard_after_forward), roles
