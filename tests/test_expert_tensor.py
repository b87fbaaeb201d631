"""Tensor parallelism inside each expert (`expert_parallel(tensor=)`, NOTE [experts split by tensor]): the split
found by running the experts' own forward, the refusals, numerics against one process on gloo with skewed and
dropped routing, the price's sums over the tensor axis by hand."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

import treadle
from treadle.errors import BuildError, ScheduleError
from treadle.forms.expert import expert_parallel_moe
from treadle.schedule.expert_split import find_split
from treadle.schedule.state import ParamShard

from test_expert_parallel import LoopExperts, SkewedMoE, _toy_inputs, tiny_deepseek_v3
from test_moe import tiny_mixtral
from tiny_models import VOCAB, lm_inputs


def _split(mod, n=2):
    return {name: (s.dim, s.blocks) for name, s in find_split(mod, n, where="test").items()}


# ------------------------------------------------------------------------------------------ the split
def test_the_split_cuts_each_experts_inner_width_as_its_forward_computes():
    # Mixtral: gate|up fused as two blocks of (E, 2I, H), down (E, H, I) split on its contraction
    assert _split(tiny_mixtral().model.layers[0].mlp.experts) == {"gate_up_proj": (1, 2), "down_proj": (2, 1)}
    # DeepSeek-V3's tiny config has 2I == H (64): the rows' width does not tell the dims apart, the probe does
    ds = tiny_deepseek_v3().model.layers[1].mlp.experts
    assert tuple(ds.gate_up_proj.shape[1:]) == (64, 64)
    assert _split(ds, 4) == {"gate_up_proj": (1, 2), "down_proj": (2, 1)}
    # unfused up and down, a loop over experts
    assert _split(LoopExperts(4, 16, 24, bias=False)) == {"up": (1, 1), "down": (2, 1)}


def test_a_bias_of_the_rows_width_is_refused_not_added_once_per_rank():
    with pytest.raises(ScheduleError, match=r"test: no split of the experts' weights \{'up': \(4, 24, 16\), 'down': "
                                            r"\(4, 16, 24\), 'bias': \(4, 16\)\} over 2 ranks"):
        find_split(LoopExperts(4, 16, 24), 2, where="test")


def test_gpt_oss_interleaved_gate_up_with_an_output_bias_is_refused():
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=32, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                       vocab_size=VOCAB, layer_types=["full_attention"])
    sch = treadle.create_schedule(GptOssForCausalLM(cfg), mesh=treadle.Mesh((2, 2), ("dp", "tp")))
    with pytest.raises(ScheduleError, match=r"expert_parallel at sch\['model.layers.0.mlp.experts'\].*no split of "
                                            r"the experts' weights .*'down_proj_bias': \(4, 64\)"):
        expert_parallel_moe(sch, axis="dp", tensor="tp")


def test_the_primitive_records_the_split_and_round_trips_through_a_schedule_file():
    sch = treadle.create_schedule(SkewedMoE(bias=False), mesh=treadle.Mesh((2, 2), ("dp", "tp")))
    sch["experts"].expert_parallel(axis="dp", tensor="tp")
    sch.data_parallel(axis="dp")
    shards = sch.view().shards_by_name()
    assert shards["experts.up"] == (ParamShard(0, "dp"), ParamShard(1, "tp"))
    assert shards["experts.down"] == (ParamShard(0, "dp"), ParamShard(2, "tp"))
    assert "sch['experts'].expert_parallel(axis='dp', tensor='tp')" in sch.to_python()
    again = treadle.load_schedule(SkewedMoE(bias=False), sch.to_json())
    assert again.to_python() == sch.to_python() and again.view().shards_by_name() == shards


def test_the_primitive_refuses_a_tensor_axis_that_routes_other_rows():
    mesh = treadle.Mesh((2, 2), ("dp", "tp"))
    sch = treadle.create_schedule(SkewedMoE(bias=False), mesh=mesh)
    with pytest.raises(ScheduleError, match=r"tensor='dp' is the expert axis"):
        sch["experts"].expert_parallel(axis="dp", tensor="dp")
    sch.data_parallel(axis=("dp", "tp"))
    with pytest.raises(ScheduleError, match=r"tensor='tp' is data-parallel"):
        sch["experts"].expert_parallel(axis="dp", tensor="tp")
    with pytest.raises(ScheduleError, match=r"unknown mesh axis 'mp'|mesh axis 'mp'"):
        sch["experts"].expert_parallel(axis="dp", tensor="mp")


# ------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("drop", [0.0, 0.05])
def test_skewed_routing_with_each_expert_split_over_tp_matches_one_process_on_4_ranks(drop):
    # EP2 x TP2: rank (d, t) holds experts 4d..4d+3, inner columns t of each; most rows go to expert 0
    sch = treadle.create_schedule(SkewedMoE(drop=drop, bias=False), mesh=treadle.Mesh((2, 2), ("dp", "tp")))
    sch["experts"].expert_parallel(axis="dp", tensor="tp")
    sch.data_parallel(axis="dp")
    report = treadle.verify(sch, _toy_inputs(), steps=2, timeout_s=240)
    names = {c.name for c in report.checks if c.kind == "param_grad"}
    assert {"experts.up", "experts.down", "router.weight", "router.bias", "head.weight"} <= names
    assert report.ok


def test_build_checks_a_split_stated_by_hand_on_4_ranks():
    from treadle.testing import spawn

    for r in spawn(_by_hand_rank, 4, timeout_s=180):
        assert r == "ok"


def _by_hand_rank(rank, world):
    mesh = treadle.Mesh((2, 2), ("dp", "tp"))
    x = _toy_inputs()["x"]
    torch.manual_seed(0)
    # the split the search finds, stated with shard(...): builds and computes the model's result
    sch = treadle.create_schedule(SkewedMoE(bias=False), mesh=mesh)
    sch["experts"].expert_parallel(axis="dp")
    sch["experts"].shard("up", dim=1, axis="tp")
    sch["experts"].shard("down", dim=2, axis="tp")
    sch.data_parallel(axis="dp")
    built = treadle.build(sch)
    mine = x.chunk(2)[mesh.local_rank("dp")]
    torch.testing.assert_close(built(x=mine), SkewedMoE(bias=False)(mine), rtol=1e-5, atol=1e-6)
    # down split on its output instead of its contraction: the parts are not a sum
    sch = treadle.create_schedule(SkewedMoE(bias=False), mesh=mesh)
    sch["experts"].expert_parallel(axis="dp")
    sch["experts"].shard("up", dim=1, axis="tp")
    sch["experts"].shard("down", dim=1, axis="tp")
    sch.data_parallel(axis="dp")
    with pytest.raises(BuildError, match=r"split over 'tp' as \(dim, blocks\) \{'up': \(1, 1\), 'down': \(1, 1\)\}: "
                                         r"its forward fails on the slices|the parts do not sum to the whole"):
        treadle.build(sch)
    # each expert's weights over a data-parallel axis: its ranks route other rows
    sch = treadle.create_schedule(SkewedMoE(bias=False), mesh=mesh)
    sch["experts"].expert_parallel(axis="dp")
    sch["experts"].shard(["up"], dim=1, axis="tp")
    sch["experts"].shard(["down"], dim=2, axis="tp")
    sch.data_parallel(axis=("dp", "tp"))
    with pytest.raises(BuildError, match=r"the experts' weights \['down', 'up'\] are split over data-parallel axis "
                                         r"'tp', whose ranks route different rows"):
        treadle.build(sch)
    # the rows split over tp before the experts (a sequence-parallel input): refused at the first forward
    sch = treadle.create_schedule(SkewedMoE(bias=False), mesh=mesh)
    sch["experts"].expert_parallel(axis="dp", tensor="tp")
    sch["experts"].sync("fwd_pre", to=Shard(0), axis="tp")
    sch.data_parallel(axis="dp")
    built = treadle.build(sch)
    with pytest.raises(BuildError, match=r"the ranks of tensor axis 'tp' route different rows"):
        built(x=mine)
    return "ok"


@pytest.mark.slow
def test_mixtral_experts_split_over_ep_and_tp_with_fsdp2_verify_on_8_ranks():
    # EP2 x TP2 x FSDP2: attention and each expert split over tp, the experts over ep, ZeRO-3 over (dp, ep)
    from treadle.models import megatron

    sch = treadle.create_schedule(tiny_mixtral(), mesh=treadle.Mesh((2, 2, 2), ("dp", "ep", "tp")))
    megatron(sch, tp="tp", dp=None)
    expert_parallel_moe(sch, axis="ep", tensor="tp")
    sch.data_parallel(axis=("dp", "ep"), shard=True)
    assert treadle.verify(sch, lm_inputs(8, 16), steps=2, timeout_s=400).ok


# ------------------------------------------------------------------------------------------ the price
def test_the_price_sums_each_experts_parts_over_tp_by_hand():
    from treadle.cost.cluster import parse_cluster
    from treadle.cost.collective_cost import collective_time_s

    cl = parse_cluster("2x2:cpu")
    ep_axis, tp_axis = cl.mesh.names
    inputs = lm_inputs(8, 16)

    def priced(tensor):
        sch = treadle.create_schedule(tiny_mixtral(), mesh=cl.mesh)
        expert_parallel_moe(sch, axis=ep_axis, tensor=tensor)
        sch.data_parallel(axis=ep_axis)
        return treadle.price(sch, inputs, cl)

    p, whole = priced(tp_axis), priced(None)
    tokens, k, hidden = 8 // 2 * 16, 2, 64  # this rank's tokens (the batch split over the expert axis only)
    for layer in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
        mine = [(c["kind"], c["phase"], c["nbytes"]) for c in p.collectives
                if c["module"] == layer and c["axis"] == tp_axis]
        # forward: the combined result summed over tp; backward: the rows' and routing weights' gradients, one
        # flat all-reduce (fp32)
        assert sorted(mine) == sorted([("all_reduce", "fwd", tokens * hidden * 4),
                                       ("all_reduce", "bwd", (tokens * hidden + tokens * k) * 4)])
        assert {c["source"] for c in p.collectives if c["module"] == layer and c["axis"] == tp_axis} == {"tp"}
        # the exchanges over the expert axis are the same as without the split
        ex, ref = (sorted((c["kind"], c["phase"], c["nbytes"]) for c in q.collectives
                          if c["module"] == layer and c["source"] == "ep") for q in (p, whole))
        assert ex == ref and ex
    fwd = next(c for c in p.collectives if c["axis"] == tp_axis and c["phase"] == "fwd")
    assert fwd["time_s"] == pytest.approx(collective_time_s("all_reduce", tokens * hidden * 4, 2, cl.link(tp_axis)))
    # memory: each rank holds half of each of its experts' weights (and their gradients and optimizer state)
    experts = sum(t.numel() * 4 for n, t in tiny_mixtral().named_parameters() if ".experts." in n)
    assert whole.static_bytes - p.static_bytes == pytest.approx(3 * experts / 2 / 2, rel=1e-6)
