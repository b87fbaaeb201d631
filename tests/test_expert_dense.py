"""Expert parallelism of experts modules that run every expert on every row (NOTE [dense experts]: Llama 4's MoE
hands its experts E groups of the tokens, each weighted by its routing score). Found by data flow, split over
expert axes (one, or a group), verified against one process on gloo, priced and planned with the same exchanges."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import treadle
from treadle.cost.cluster import parse_cluster
from treadle.errors import ScheduleError
from treadle.forms.expert import expert_parallel_moe
from treadle.forms.expert.facts import expert_modules
from treadle.schedule.expert_primitive import experts_layout

from tiny_models import VOCAB, lm_inputs

LAYER = "model.layers.0.feed_forward.experts"


def tiny_llama4():
    import transformers as T

    torch.manual_seed(0)
    model = T.Llama4ForCausalLM(T.Llama4TextConfig(
        hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=1,
        max_position_embeddings=64, interleave_moe_layer_step=1, pad_token_id=0, bos_token_id=0, eos_token_id=0))
    model.config.use_cache = False
    return model


class _Mixing(nn.Module):
    """Stacked weights and one input, but every output row reads every group: not E independent experts."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x):
        h = x.view(4, -1, 8) @ self.w
        return (h + h.mean(0, keepdim=True)).reshape(-1, 8)


def test_dense_experts_are_found_by_data_flow():
    model = tiny_llama4()
    assert expert_modules(model) == {LAYER: 4, "model.layers.1.feed_forward.experts": 4}
    assert experts_layout(model.get_submodule(LAYER)) == "dense"
    assert expert_modules(nn.ModuleDict({"mix": _Mixing()})) == {}  # its groups are not independent


def test_the_primitive_refuses_what_dense_experts_cannot_state():
    sch = treadle.create_schedule(tiny_llama4(), mesh=treadle.Mesh((2, 2), ("dp", "tp")))
    with pytest.raises(ScheduleError, match=r"tensor= is for experts that take routed rows"):
        sch[LAYER].expert_parallel(axis="dp", tensor="tp")
    with pytest.raises(ScheduleError, match=r"load_imbalance= is for experts that take routed rows"):
        sch[LAYER].expert_parallel(axis="dp", load_imbalance=1.5)


@pytest.mark.parametrize("ep,shard", [("dp", False), (("dp", "ep"), False), ("ep", True)],
                         ids=["ep2xdp2", "ep4-group", "ep2-fsdp2"])
def test_dense_experts_split_over_expert_axes_match_one_process_on_4_ranks(ep, shard):
    sch = treadle.create_schedule(tiny_llama4(), mesh=treadle.Mesh((2, 2), ("dp", "ep")))
    expert_parallel_moe(sch, axis=ep)
    sch.data_parallel(axis=("dp", "ep"), shard=shard)
    report = treadle.verify(sch, lm_inputs(8, 16), steps=2, timeout_s=300)
    assert f"{LAYER}.gate_up_proj" in {c.name for c in report.checks if c.kind == "param_grad"}
    assert report.ok


def test_the_price_and_the_planner_charge_the_groups_exchanges_by_hand():
    from treadle.cost.collective_cost import collective_time_s
    from treadle.planner.capture import capture
    from treadle.planner.cost_graph import build_cost_graph
    from treadle.planner.roles import Roles

    cl = parse_cluster("4x1:cpu")
    a = cl.mesh.names[0]
    inputs = lm_inputs(8, 16)
    sch = treadle.create_schedule(tiny_llama4(), mesh=cl.mesh)
    expert_parallel_moe(sch, axis=a)
    sch.data_parallel(axis=a)
    p = treadle.price(sch, inputs, cl)
    ep = [c for c in p.collectives if c["source"] == "ep" and c["module"] == LAYER]
    rows = 4 * (8 // 4 * 16) * 64 * 4  # E groups of this rank's tokens, 64 wide, fp32
    # forward: each rank's group size (E int64), the groups there, the results back; backward: their adjoints
    assert [(c["kind"], c["nbytes"]) for c in ep if c["phase"] == "fwd"] == [("all_to_all", 4 * 8),
                                                                           ("all_to_all", rows), ("all_to_all", rows)]
    assert [c["nbytes"] for c in ep if c["phase"] == "bwd"] == [rows, rows]
    assert ep[1]["time_s"] == pytest.approx(collective_time_s("all_to_all", rows, 4, cl.link(a)))
    cg = build_cost_graph(capture(tiny_llama4(), (), inputs), cl, Roles((a,), False, (), ep=a))
    x = next(x for i, x in cg.form_terms["expert"].items() if cg.graph.nodes[i].module.startswith(LAYER))
    assert x.fwd_s == pytest.approx(sum(c["time_s"] for c in ep if c["phase"] == "fwd"), rel=1e-12)
    assert x.bwd_s == pytest.approx(sum(c["time_s"] for c in ep if c["phase"] == "bwd"), rel=1e-12)


@pytest.mark.slow
def test_a_budget_that_does_not_hold_every_expert_plans_dense_experts_split_and_verifies_on_4_ranks():
    from treadle.planner import plan_model

    cl = parse_cluster("4x1:cpu")
    a = cl.mesh.names[0]
    inputs = lm_inputs(8, 16)
    ddp = treadle.create_schedule(tiny_llama4(), mesh=cl.mesh)
    ddp.data_parallel(axis=a)
    budget = 0.9 * treadle.price(ddp, inputs, cl).peak_bytes
    plan = plan_model(tiny_llama4(), inputs, cluster=cl, dp_axis=a, zero=False, memory_budget_bytes=budget)
    assert f"experts over {a}" in plan.roles, plan.solver["alternatives"]
    assert plan.estimate().peak_bytes <= budget
    assert treadle.verify(plan.schedule, inputs, steps=2, timeout_s=300).ok
