"""Expert parallelism over several mesh axes (`expert_parallel(axis=("dp", "tp"))`): the experts split over the
flattened group of those axes (row-major in mesh order), as DeepSeek-V3 trains EP 64 over 8 x 8. Numerics against
one process on gloo (DDP, FSDP2 with the experts' own unit), the primitive's record and refusals, the price's
exchanges on the group's link by hand."""

from __future__ import annotations

import pytest

import treadle
from treadle.errors import PlanError, ScheduleError
from treadle.forms.expert import expert_parallel_moe

from test_expert_parallel import SkewedMoE, _toy_inputs
from test_moe import tiny_mixtral
from tiny_models import lm_inputs


def _group_schedule(model, shape, names, ep, dp, *, shard=False):
    sch = treadle.create_schedule(model, mesh=treadle.Mesh(shape, names))
    expert_parallel_moe(sch, axis=ep)
    sch.data_parallel(axis=dp, shard=shard)
    return sch


@pytest.mark.parametrize("shard", [False, True], ids=["ddp", "fsdp2"])
def test_experts_over_two_axes_match_one_process_on_4_ranks(shard):
    # 8 experts over the flattened (dp, ep) group of 4: rank (d, e) holds experts 2*(2d+e), 2*(2d+e)+1; the
    # skewed router sends most rows to rank (0, 0); every gradient (router's included) and a step compared
    sch = _group_schedule(SkewedMoE(drop=0.05), (2, 2), ("dp", "ep"), ("ep", "dp"), ("dp", "ep"), shard=shard)
    report = treadle.verify(sch, _toy_inputs(), steps=2, timeout_s=240)
    names = {c.name for c in report.checks if c.kind == "param_grad"}
    assert {"experts.up", "experts.down", "experts.bias", "router.weight"} <= names
    assert report.ok


def _placement_rank(rank: int, world: int):
    sch = _group_schedule(SkewedMoE(), (2, 2), ("dp", "ep"), ("dp", "ep"), ("dp", "ep"))
    built = treadle.build(sch)
    leaf = next(m._treadle_expert_leaf for _, m in built.named_modules() if hasattr(m, "_treadle_expert_leaf"))
    up = next(p for n, p in built.named_parameters() if n.endswith("experts.up"))
    return rank, leaf.rank, leaf.size, tuple(up.shape), float(up.detach().sum())


def test_each_rank_holds_the_experts_of_its_flattened_coordinate():
    from treadle.testing import spawn

    whole = SkewedMoE().experts.up.detach()
    for rank, group_rank, size, shape, total in spawn(_placement_rank, 4, timeout_s=120):
        assert (group_rank, size, shape) == (rank, 4, (2, 24, 16))  # the mesh is row-major: rank = 2 * dp + ep
        assert total == pytest.approx(float(whole[2 * rank:2 * rank + 2].sum()), rel=1e-6)


def test_the_primitive_records_the_axes_in_mesh_order_and_refuses_what_it_cannot_split():
    mesh = treadle.Mesh((2, 2, 3), ("dp", "ep", "tp"))
    sch = treadle.create_schedule(SkewedMoE(), mesh=mesh)
    sch["experts"].expert_parallel(axis=("ep", "dp"))
    assert "sch['experts'].expert_parallel(axis=['dp', 'ep'])" in sch.to_python()
    assert sch.view().extras["expert_parallel"] == {"experts": ("dp", "ep")}
    again = treadle.load_schedule(SkewedMoE(), sch.to_json(), mesh)
    assert again.to_python() == sch.to_python()
    with pytest.raises(ScheduleError, match=r"already expert-parallel over 'dp,ep'"):
        sch["experts"].expert_parallel(axis="dp")
    with pytest.raises(ScheduleError, match=r"sch\['experts'\] is expert-parallel over 'ep', which is not one of its"):
        sch.data_parallel(axis="dp")
    fresh = treadle.create_schedule(SkewedMoE(), mesh=mesh)
    with pytest.raises(ScheduleError, match=r"8 experts do not divide over the flattened mesh axes \['ep', 'tp'\] "
                                            r"of size 6"):
        fresh["experts"].expert_parallel(axis=("ep", "tp"))
    with pytest.raises(ScheduleError, match=r"axis must be a mesh axis name or a list of distinct ones"):
        fresh["experts"].expert_parallel(axis=("dp", "dp"))
    with pytest.raises(ScheduleError, match=r"mesh axes \['pp'\] do not exist"):
        fresh["experts"].expert_parallel(axis=("dp", "pp"))
    with pytest.raises(ScheduleError, match=r"tensor='ep' is an expert axis"):
        fresh["experts"].expert_parallel(axis=("dp", "ep"), tensor="ep")
    fresh.data_parallel(axis="dp")
    with pytest.raises(ScheduleError, match=r"mesh axis 'ep' is not data-parallel"):
        fresh["experts"].expert_parallel(axis=("dp", "ep"))


def test_a_plan_file_states_an_expert_group_as_a_list_of_axes():
    from treadle.planner.decision_check import check_decision

    check_decision("expert_parallel", "experts", {"axis": ["dp", "ep"]}, "", where="plan.json: decision 0")
    with pytest.raises(PlanError, match=r"argument 'axis' must be str\|strs, got 3"):
        check_decision("expert_parallel", "experts", {"axis": 3}, "", where="plan.json: decision 0")


def test_the_price_charges_the_exchanges_on_the_groups_link_by_hand():
    from treadle.cost.cluster import parse_cluster
    from treadle.cost.collective_cost import collective_time_s

    cl = parse_cluster("2x2:h100")  # an inter-node axis (InfiniBand) and an intra-node one (NVLink)
    a, b = cl.mesh.names
    inputs = lm_inputs(8, 16)
    p = treadle.price(_group_schedule(tiny_mixtral(), cl.mesh.shape, cl.mesh.names, (a, b), (a, b)), inputs, cl)
    ep = [c for c in p.collectives if c["source"] == "ep" and c["module"] == "model.layers.0.mlp.experts"]
    tokens, k, hidden = 8 // 4 * 16, 2, 64  # this rank's tokens (data-parallel over both axes)
    rows = tokens * k * hidden * 4
    assert [(c["kind"], c["axis"], c["nbytes"]) for c in ep if c["phase"] == "fwd"] == [
        ("all_to_all", f"{a},{b}", 8 * 4), ("all_to_all", f"{a},{b}", rows), ("all_to_all", f"{a},{b}", tokens * k * 4),
        ("all_to_all", f"{a},{b}", rows)]
    link = cl.group_link((a, b))  # the flattened group's: every pairwise step waits for the slower link
    def eff(x):
        return x.bandwidth_bytes_per_s * x.efficiency

    assert eff(link) == pytest.approx(eff(cl.link(a))) and eff(cl.link(a)) < eff(cl.link(b))
    for c in ep:
        assert c["time_s"] == pytest.approx(collective_time_s("all_to_all", c["nbytes"], 4, link))
    # each rank keeps a quarter of the experts, as EP 4 over one axis of 4 does
    one = parse_cluster("4x1:h100")
    p4 = treadle.price(_group_schedule(tiny_mixtral(), one.mesh.shape, one.mesh.names, one.mesh.names[0],
                                       one.mesh.names[0]), inputs, one)
    assert p.static_bytes == pytest.approx(p4.static_bytes, rel=1e-12)


@pytest.mark.slow
def test_experts_over_two_of_three_axes_under_zero3_on_8_ranks():
    # EP 4 over (ep, x), FSDP2 over (dp, ep, x): the experts' own unit is sharded over dp, the axis EP leaves
    sch = _group_schedule(SkewedMoE(), (2, 2, 2), ("dp", "ep", "x"), ("ep", "x"), ("dp", "ep", "x"), shard=True)
    units = treadle.form.get_form("expert").shard_units(sch.model, sch.view())
    assert [(u.path, u.shard_axes, u.replicate_axes) for u in units] == [("experts", ("dp",), ())]
    assert treadle.verify(sch, _toy_inputs(), steps=2, timeout_s=300).ok
