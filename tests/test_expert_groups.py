"""Expert parallelism over several mesh axes (`expert_parallel(axis=("dp", "tp"))`): the experts split over the
flattened group of those axes (row-major in mesh order), as DeepSeek-V3 trains EP 64 over 8 x 8. Numerics against
one process on gloo (DDP, FSDP2 with the experts' own unit), the primitive's record and refusals, the price's
exchanges on the group's link by hand."""

from __future__ import annotations

import pytest
import torch

import treadle
from treadle.cost.cluster import parse_cluster
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


def _family(name: str):
    """Tiny configs of MoE families whose blocks differ from Mixtral's: a gated shared expert (Qwen2-MoE), biased
    experts with clamped gated activations and sliding-window layers (gpt-oss), convolution layers beside
    attention and a dense first layer (LFM2-MoE)."""
    import transformers as T

    from tiny_models import VOCAB

    torch.manual_seed(0)
    ids = dict(vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    if name == "qwen2_moe":
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
            **ids))
    if name == "gpt_oss":
        return T.GptOssForCausalLM(T.GptOssConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], **ids))
    return T.Lfm2MoeForCausalLM(T.Lfm2MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, num_dense_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        layer_types=["full_attention", "conv", "full_attention"], **ids))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "lfm2_moe"])
def test_other_moe_families_verify_with_their_experts_over_a_group_on_4_ranks(family):
    model = _family(family)
    model.config.use_cache = False
    sch = _group_schedule(model, (2, 2), ("dp", "ep"), ("dp", "ep"), ("dp", "ep"), shard=family == "lfm2_moe")
    assert [r.op for r in sch.records].count("expert_parallel") == 2
    assert treadle.verify(sch, lm_inputs(8, 16), steps=2, timeout_s=300).ok


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


# ------------------------------------------------------------------------------------------ the planner
def test_the_planner_charges_an_expert_group_as_the_price_does():
    from treadle.planner.capture import capture
    from treadle.planner.cost_graph import build_cost_graph
    from treadle.planner.roles import Roles

    cl = parse_cluster("2x2:h100")
    a, b = cl.mesh.names
    inputs = lm_inputs(8, 16)
    graph = capture(tiny_mixtral(), (), inputs)
    cg = build_cost_graph(graph, cl, Roles((a, b), False, (), ep=(a, b)))
    assert str(cg.roles) == f"data-parallel {a},{b}; experts over {a},{b}"
    price = treadle.price(_group_schedule(tiny_mixtral(), cl.mesh.shape, cl.mesh.names, (a, b), (a, b)), inputs, cl)
    layer = "model.layers.0.mlp.experts"
    x = next(x for i, x in cg.form_terms["expert"].items() if cg.graph.nodes[i].module.startswith(layer))
    for phase, planned in (("fwd", x.fwd_s), ("bwd", x.bwd_s)):  # the same exchanges on the same group link
        priced = sum(c["time_s"] for c in price.collectives if c["source"] == "ep" and c["module"] == layer
                     and c["phase"] == phase)
        assert planned == pytest.approx(priced, rel=1e-9)
    # each rank keeps a quarter of the experts: the same static bytes as one expert axis of 4
    one = parse_cluster("4x1:h100")
    (c,) = one.mesh.names[:1]
    single = build_cost_graph(capture(tiny_mixtral(), (), inputs), one, Roles((c,), False, (), ep=c))

    def static(g):
        return sum(u.count * u.costs[0].static_bytes for u in g.units)

    assert static(cg) == pytest.approx(static(single), rel=1e-12)


@pytest.mark.slow
def test_a_budget_that_holds_one_expert_a_rank_plans_an_expert_group_that_fits_and_verifies_on_4_ranks():
    # DDP on 2 x 2 with 4 experts: split over one axis each rank holds 2 of them, which the budget does not
    # hold; over the group of both, 1 (the only data-parallel plan that fits)
    from treadle.planner import plan_model

    cl = parse_cluster("2x2:cpu")
    a, b = cl.mesh.names
    inputs = lm_inputs(8, 16)
    one_axis = treadle.price(_group_schedule(tiny_mixtral(), cl.mesh.shape, cl.mesh.names, b, (a, b)), inputs, cl)
    group = treadle.price(_group_schedule(tiny_mixtral(), cl.mesh.shape, cl.mesh.names, (a, b), (a, b)), inputs, cl)
    budget = (one_axis.peak_bytes + group.peak_bytes) / 2
    plan = plan_model(tiny_mixtral(), inputs, cluster=cl, dp_axis=(a, b), zero=False, memory_budget_bytes=budget)
    assert plan.roles == f"data-parallel {a},{b}; experts over {a},{b}", plan.solver["alternatives"]
    assert f"expert_parallel(axis=['{a}', '{b}'])" in plan.schedule.to_python()
    assert plan.estimate().peak_bytes == group.peak_bytes <= budget  # priced as built: the hand schedule's price
    assert treadle.verify(plan.schedule, inputs, steps=2, timeout_s=300).ok


# ------------------------------------------------------------------------------------------ the router's loss
def _router_logits_rank(rank: int, world: int, model):
    from tiny_models import lm_inputs as inputs

    out = model(**inputs(4, 16), output_router_logits=True)
    return type(out.router_logits).__name__, len(out.router_logits), float(out.aux_loss)


def test_a_model_sent_to_a_fresh_process_still_collects_its_router_logits():
    # NOTE [registrations lost in transport]: unpickled in a rank that never built a Mixtral, the model collected no
    # router logits (Hugging Face registers what to collect at construction), and its load-balancing loss failed
    from treadle.testing import spawn

    want = float(tiny_mixtral()(**lm_inputs(4, 16), output_router_logits=True).aux_loss)
    for kind, layers, aux in spawn(_router_logits_rank, 2, tiny_mixtral(), timeout_s=120):
        assert (kind, layers) == ("tuple", 2) and aux == pytest.approx(want, rel=1e-6)
    # a model that has collected its router logits holds the hooks that collect them, which pickle refuses: it is
    # sent as a copy without them (the caller's keeps them), and the rank installs its own
    used = tiny_mixtral()
    used(**lm_inputs(4, 16), output_router_logits=True)
    hooks = sum(len(m._forward_hooks) for m in used.modules())
    assert hooks > 0  # what collects the routers' logits (and hidden states, attentions)
    for kind, layers, aux in spawn(_router_logits_rank, 2, used, timeout_s=120):
        assert (kind, layers) == ("tuple", 2) and aux == pytest.approx(want, rel=1e-6)
    assert sum(len(m._forward_hooks) for m in used.modules()) == hooks


@pytest.mark.slow
def test_experts_over_a_group_with_the_models_load_balancing_loss_verify_on_4_ranks():
    # the router's auxiliary loss in the model's loss (each replica's, as the reference computes its slices')
    model = tiny_mixtral()
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.5
    model(**lm_inputs(8, 16))  # run once before: it holds the hooks that collect the logits (sent without them)
    sch = _group_schedule(model, (2, 2), ("dp", "ep"), ("dp", "ep"), ("dp", "ep"))
    report = treadle.verify(sch, lm_inputs(8, 16), steps=2, timeout_s=300)
    assert "model.layers.0.mlp.gate.weight" in {c.name for c in report.checks if c.kind == "param_grad"}
    assert report.ok


# ------------------------------------------------------------------------------------------ training and checkpoints
def test_a_rank_past_the_last_fsdp_chunk_loads_an_empty_piece_of_the_right_shape():
    # a router (4 experts x 64) under FSDP2 over 8 ranks: ranks 4..7 hold (0, 64); loading a checkpoint into them
    # handed them (0,), which copy_ refuses
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from treadle.mesh import Mesh
    from treadle.run.layout import ParamLayout

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        mesh = Mesh((2, 2, 2), ("x", "dp", "ep"))
        lay = ParamLayout("model.layers.0.mlp.gate.weight", (4, 64), (), fsdp_axes=("x", "dp", "ep"))
        full = torch.arange(4 * 64, dtype=torch.float32).reshape(4, 64)
        assert tuple(lay.local_from_full(full, torch.empty(0, 64), mesh).shape) == (0, 64)
    finally:
        dist.destroy_process_group()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (8, 16), generator=g) for _ in range(4)]


def _made(kind: str):
    from treadle.run.config import RunConfig
    from treadle.run.layout import fsdp_unit_axes, layouts, shards_by_name
    from treadle.run.optim import init_optimizer_state, make_optimizer

    torch.manual_seed(0)
    model = tiny_mixtral()
    model.config.use_cache = False
    if kind == "pp2-ep2-fsdp":  # PP2 x EP2 over ep, FSDP2 over (dp, ep): the experts' own units inside the stages
        sch = treadle.create_schedule(model, mesh=treadle.Mesh((2, 2, 2), ("pp", "dp", "ep")))
        sch["model.layers.0"].cut_pipeline_stage()
        expert_parallel_moe(sch, axis="ep")
        sch.data_parallel(axis=("dp", "ep"), shard=True)
        ids = torch.zeros(8, 16, dtype=torch.int64)
        sch.pipeline(axis="pp", schedule="1f1b", n_microbatches=2, example_inputs={"input_ids": ids, "labels": ids})
    else:  # EP 4 over the (dp, ep) group, FSDP2 over all three axes: the experts' units over x
        sch = treadle.create_schedule(model, mesh=treadle.Mesh((2, 2, 2), ("x", "dp", "ep")))
        expert_parallel_moe(sch, axis=("dp", "ep"))
        sch.data_parallel(axis=("x", "dp", "ep"), shard=True)
    before = shards_by_name(sch)
    built = treadle.build(sch)
    lay = layouts(built, before, sch.mesh, sch.view().data_parallel.shard_axes, fsdp_unit_axes(sch))
    opt = make_optimizer(built, lay, RunConfig(model="tiny-llama", data=["unused"], lr=1e-2, warmup_steps=0, steps=9))
    init_optimizer_state(opt)
    return sch, built, lay, opt, 2 if kind.startswith("pp") else 1


def _train_step(sch, built, lay, opt, mb, batch):
    from treadle.run.loop import train_step
    from treadle.run.setup import data_parallel_coords

    n, i = data_parallel_coords(sch)
    loss, norm = train_step(built, opt, lay, sch.mesh, list(batch.chunk(n)[i].chunk(mb)), clip_norm=1.0)
    return float(loss), float(norm)


def _reshard_rank(rank: int, world: int, path: str):
    from treadle.run import checkpoint as ckpt
    from treadle.run.layout import named_params

    batches = _batches()
    a = _made("pp2-ep2-fsdp")
    first = _train_step(*a, batches[0])
    _train_step(*a, batches[1])
    ckpt.Checkpointer(path).save(a[1], a[3], a[2], a[0].mesh, step=2)
    full_a = {n: a[2][n].gather_full(p, a[0].mesh) for n, p in named_params(a[1])}
    after_a = [_train_step(*a, b)[0] for b in batches[2:]]
    b_ = _made("ep4-group-fsdp")
    step = ckpt.load(ckpt.step_dir(path, 2), b_[1], b_[3], b_[2], b_[0].mesh)
    full_b = {n: b_[2][n].gather_full(p, b_[0].mesh) for n, p in named_params(b_[1])}
    after_b = [_train_step(*b_, b)[0] for b in batches[2:]]
    return first, step, {n: float((full_a[n] - full_b[n]).abs().max()) for n in full_a}, len(full_b), after_a, after_b


@pytest.mark.slow
def test_pp_x_experts_under_zero3_train_and_reshard_onto_an_expert_group_on_8_ranks(tmp_path):
    # the first step's loss and global gradient norm are one process's; a checkpoint of the pipeline loads bit-exact
    # into EP 4 over a group of two axes, and both go on alike
    from treadle.testing import spawn

    torch.manual_seed(0)
    ref = tiny_mixtral()
    ids = _batches()[0]
    loss = ref(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    n_params = len(list(ref.parameters()))
    for (loss0, norm0), step, diff, held, after_a, after_b in spawn(_reshard_rank, 8, str(tmp_path / "ck"),
                                                                   timeout_s=400):
        assert loss0 == pytest.approx(float(loss), rel=1e-5) and norm0 == pytest.approx(norm, rel=1e-5)
        assert step == 2 and held == n_params and diff and max(diff.values()) == 0.0, diff
        assert after_b == pytest.approx(after_a, rel=1e-5)


@pytest.mark.slow
def test_an_expert_group_with_each_expert_split_over_a_tensor_axis_verifies_under_zero3_on_8_ranks():
    # EP 4 over (dp, ep), each expert's weights split over tp (expert tensor parallelism), FSDP2 over (dp, ep)
    model = tiny_mixtral()
    model.config.use_cache = False
    sch = treadle.create_schedule(model, mesh=treadle.Mesh((2, 2, 2), ("dp", "ep", "tp")))
    expert_parallel_moe(sch, axis=("dp", "ep"), tensor="tp")
    sch.data_parallel(axis=("dp", "ep"), shard=True)
    assert "expert_parallel(axis=['dp', 'ep'], tensor='tp')" in sch.to_python()
    assert treadle.verify(sch, lm_inputs(8, 16), steps=2, timeout_s=300).ok


# ------------------------------------------------------------------------------------------ planned beside a pipeline
def _mixtral4():
    from transformers import MixtralConfig, MixtralForCausalLM

    from tiny_models import VOCAB

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                                             max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
                                             bos_token_id=0, eos_token_id=0, pad_token_id=0))
    model.config.use_cache = False
    return model


def _pp_cluster():
    from treadle.mesh import Mesh

    return parse_cluster("1x8:cpu").for_mesh(Mesh((2, 2, 2), ("pp", "dp", "ep")))


def test_zero3_beside_a_planned_pipeline_charges_the_experts_own_units_as_the_price_does():
    # NOTE [pipeline FSDP2 in the plan]: EP 2 over ep, FSDP2 over (dp, ep): a rank's experts (1/2 of them) are
    # FSDP2 units of their own over dp (m = 2); over the group of both axes FSDP2 leaves them alone
    from treadle.forms.pipeline import cuts, milp
    from treadle.forms.pipeline.zero import zero_terms
    from treadle.planner.capture import capture
    from treadle.planner.cost_graph import build_cost_graph
    from treadle.planner.roles import Roles

    cl, inputs = _pp_cluster(), lm_inputs(8, 16)
    graph = capture(_mixtral4(), (), inputs)

    def graph_of(ep):
        return build_cost_graph(graph, cl, Roles(("dp", "ep"), True, (), ep=ep, pp="pp", pp_schedule="1f1b",
                                                 pp_microbatches=2))

    cg = graph_of(("ep",))
    zt = zero_terms(cg)
    assert zt.experts is not None and zt.experts.m == 2 and zt.experts.per_block == 1.0
    model = _mixtral4()
    local = sum(t.numel() * 4 for t in model.model.layers[0].mlp.experts.parameters()) / 2
    experts_units = {u for u, ou in enumerate(zt.experts.gathered) if max(ou) > 0}  # the ops owning their weights
    assert sum(max(zt.experts.gathered[u]) for u in experts_units) == local  # one block of the template
    assert all(max(zt.gathered[u]) == 0 for u in experts_units)  # not in the blocks' own gathers
    assert zero_terms(graph_of(("dp", "ep"))).experts is None  # one expert a rank: FSDP2 leaves them alone
    # the solver's step and peak of a cut against the price of the same schedule as built
    lay = cuts._layout(cg, "1f1b")
    step, peak, _ = milp.evaluate(cg, lay, cuts._cut(cg, lay, ((0, 1), (2, 3))), [0] * len(cg.units), {})
    sch = treadle.create_schedule(_mixtral4(), mesh=cl.mesh)
    sch["model.layers.1"].cut_pipeline_stage()
    expert_parallel_moe(sch, axis="ep")
    sch.data_parallel(axis=("dp", "ep"), shard=True)
    sch.pipeline(axis="pp", schedule="1f1b", n_microbatches=2, example_inputs=inputs)
    priced = treadle.price(sch, inputs, cl)
    assert priced.step_s == pytest.approx(step, rel=0.10) and priced.peak_bytes == pytest.approx(peak, rel=0.10)


@pytest.mark.slow
def test_a_budget_plans_a_pipeline_beside_experts_under_zero3_that_verifies_on_8_ranks():
    from treadle.planner import plan_model

    cl, inputs = _pp_cluster(), lm_inputs(8, 16)
    free = plan_model(_mixtral4(), inputs, cluster=cl, pp_axis="pp", dp_axis=("dp", "ep"), zero=True, price_top=0)
    assert "experts over" not in free.roles  # without a budget the exchanges cost more than they save here
    budget = 0.7 * free.estimated.peak_bytes
    plan = plan_model(_mixtral4(), inputs, cluster=cl, pp_axis="pp", dp_axis=("dp", "ep"), zero=True,
                      memory_budget_bytes=budget)
    roles = plan.roles
    assert "pipeline pp" in roles and "experts over" in roles and ("HSDP" in roles or "ZeRO-3" in roles), roles
    text = plan.schedule.to_python()
    assert "expert_parallel(axis=" in text and "shard=True" in text and "cut_pipeline_stage()" in text
    assert plan.estimate().peak_bytes <= budget
    assert treadle.verify(plan.schedule, inputs, steps=2, timeout_s=300).ok


# ------------------------------------------------------------------------------------------ why a verify fails
class _Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x)).sum(-1)


def test_a_failed_verify_of_a_forward_that_draws_random_numbers_says_so():
    # NOTE [random draws in verify]: a sampling router (PhiMoE in training) or dropout cannot match one process under
    # data parallelism; the report names the drawing op and its module
    sch = treadle.create_schedule(_Noisy(), mesh=treadle.Mesh((2,), ("dp",)))
    sch.data_parallel(axis="dp")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    report = treadle.verify(sch, {"x": x}, steps=1, timeout_s=120, raise_on_mismatch=False)
    assert not report.ok
    import re

    assert any(re.search(r"draws random numbers \(aten\.\w+ in 'drop'\)", n) for n in report.notes), report.notes
    assert "note: the model's training forward draws random numbers" in report.summary()
    quiet = _Noisy()
    quiet.drop.p = 0.0  # no draw, no note; and it verifies
    sch = treadle.create_schedule(quiet, mesh=treadle.Mesh((2,), ("dp",)))
    sch.data_parallel(axis="dp")
    report = treadle.verify(sch, {"x": x}, steps=1, timeout_s=120, raise_on_mismatch=False)
    assert report.ok and report.notes == []
