"""`carry_schedule`: a schedule of a large model replayed on a shrunken model of the same architecture (what is
carried, where, and every refusal). No process group: the shrunken schedules are only compared as records."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from tiny_models import tiny_gpt2, tiny_llama
from treadle.errors import ScheduleError
from treadle.mesh import Mesh
from treadle.models import schedule_gpt2, schedule_llama
from treadle.schedule.core import create_schedule
from treadle.schedule.log import Ref
from treadle.verify.shrink import carry_schedule, checkpoint_count

MESH = Mesh((2, 2), ("dp", "tp"))


def _megatron_llama(n_layer: int = 4, **kw):
    sch = create_schedule(tiny_llama(n_layer), mesh=MESH)
    return schedule_llama(sch, tp="tp", dp="dp", sequence_parallel=True, **kw)


def _text(sch) -> list[str]:
    return [r.to_python() for r in sch.records]


def test_megatron_llama_carries_block_0_and_the_last_block_and_everything_outside():
    big = _megatron_llama(4)
    out = carry_schedule(big, tiny_llama(2), mesh=MESH)
    assert out.source_blocks == (0, 3) and out.n_big == 4
    assert out.kinds == 2  # block 0 also slices the sequence at its input (sequence parallelism)
    # 7 syncs: the 5 of Megatron SP plus the backward reduce-scatter of its 2 sequence gathers
    assert out.per_block == {"shard": 7, "sync": 7, "fork_rng": 1, "reduce_grads": 2}
    assert out.shared == {"shard": 2, "sync": 2, "set_attr": 1, "reduce_grads": 1, "data_parallel": 1}
    # exactly the large schedule's records of blocks 0 and 3 (renumbered 0 and 1) and the shared ones, in order
    want = [t.replace("model.layers.3.", "model.layers.1.") for t in _text(big)
            if "model.layers.1." not in t and "model.layers.2." not in t]
    assert _text(out.schedule) == want
    assert "sch['model.layers.0'].sync('fwd_pre', to=Shard(1), axis='tp')" in _text(out.schedule)


def test_shrunken_sizes_are_rechecked_on_replay():
    """A shard that held on the large sizes and not on the shrunken ones is refused by the primitive itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    big = _megatron_llama(4)
    torch.manual_seed(0)
    odd = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=129, vocab_size=256))
    with pytest.raises(ScheduleError, match=r"gate_proj.*129"):
        carry_schedule(big, odd, mesh=MESH)


def test_checkpoints_are_carried_in_proportion_with_their_primitive():
    assert [checkpoint_count(c, 32, 2) for c in (0, 1, 16, 31, 32)] == [0, 1, 1, 1, 2]
    assert [checkpoint_count(c, 8, 4) for c in (2, 4, 7)] == [1, 2, 3]
    big = _megatron_llama(4, checkpoint_fraction=0.5)  # blocks 0 and 2
    out = carry_schedule(big, tiny_llama(2), mesh=MESH)
    assert out.checkpointed_big == 2 and out.checkpointed == (0,) and out.checkpoint_op == "checkpoint"
    assert [r.path for r in out.schedule.records if r.op == "checkpoint"] == ["model.layers.0"]
    sac = create_schedule(tiny_llama(4), mesh=MESH)
    for i in range(4):
        sac[f"model.layers.{i}"].checkpoint(save=["aten.mm"])
    out = carry_schedule(sac, tiny_llama(2), mesh=MESH)
    assert [(r.op, r.path, r.args) for r in out.schedule.records] == [
        ("checkpoint_selective", f"model.layers.{i}", {"save": ["aten.mm"]}) for i in range(2)]


def test_gpt2_fused_qkv_blocks_and_split_size_are_carried():
    sch = create_schedule(tiny_gpt2(4), mesh=Mesh((4,), ("tp",)))
    schedule_gpt2(sch, tp="tp")
    out = carry_schedule(sch, tiny_gpt2(2), mesh=Mesh((2,), ("tp",)))
    recs = _text(out.schedule)
    assert "sch['transformer.h.1.attn.c_attn'].shard('weight', dim=1, axis='tp', blocks=3)" in recs
    assert "sch['transformer.h.1.attn'].shard_attr('split_size', axis='tp')" in recs
    assert out.schedule["transformer.h.1.attn"].mod.split_size == 64  # divided at build, not here


def test_refuses_other_axis_names_and_more_blocks():
    big = _megatron_llama(4)
    with pytest.raises(ScheduleError, match=r"same axis names \['dp', 'tp'\]"):
        carry_schedule(big, tiny_llama(2), mesh=Mesh((2, 2), ("data", "tp")))
    small = create_schedule(tiny_llama(2), mesh=MESH)
    small.data_parallel(axis="dp")
    with pytest.raises(ScheduleError, match=r"has 4 blocks at 'model.layers'; it needs 1 to 2"):
        carry_schedule(small, tiny_llama(4), mesh=MESH)


def test_refuses_a_middle_block_that_no_shrunken_block_carries():
    sch = _megatron_llama(4)
    sch["model.layers.1.mlp"].checkpoint()  # a checkpoint is carried by count: fine
    carry_schedule(sch, tiny_llama(2), mesh=MESH)
    sch["model.layers.2.mlp.act_fn"].fork_rng(axis="tp")
    with pytest.raises(ScheduleError, match=r"block model.layers.2 has primitives.*extra fork_rng '.mlp.act_fn'"):
        carry_schedule(sch, tiny_llama(2), mesh=MESH)
    carry_schedule(sch, tiny_llama(4), mesh=MESH)  # four shrunken blocks carry every kind


def test_refuses_mixed_checkpoints_sized_values_and_uncarried_primitives():
    sch = create_schedule(tiny_llama(4), mesh=MESH)
    sch["model.layers.0"].checkpoint()
    sch["model.layers.1"].checkpoint(save=["aten.mm"])
    with pytest.raises(ScheduleError, match="checkpointed in different ways"):
        carry_schedule(sch, tiny_llama(2), mesh=MESH)
    sch = create_schedule(tiny_llama(4), mesh=MESH)
    sch["model.layers.0.self_attn"].set_attr("num_key_value_groups", 1)
    with pytest.raises(ScheduleError, match=r"sets 'num_key_value_groups' to a int \(1\), which may hold a size"):
        carry_schedule(sch, tiny_llama(2), mesh=MESH)
    sch = create_schedule(tiny_llama(4), mesh=MESH)
    sch.set_attr("loss_function", Ref("treadle.runtime.losses:VocabParallelLoss", axis="tp", causal=True))
    carry_schedule(sch, tiny_llama(2), mesh=MESH)  # a Ref is carried
    sch["model.layers.0.mlp"].replace(torch.nn.Identity())
    with pytest.raises(ScheduleError, match=r"primitive 'replace' at 'model.layers.0.mlp' holds modules"):
        carry_schedule(sch, tiny_llama(2), mesh=MESH)


def test_refuses_a_record_on_the_block_list_and_a_model_without_blocks():
    sch = create_schedule(tiny_llama(4), mesh=MESH)
    sch["model.layers"].sync("fwd_post", to=Replicate(), from_=Shard(1), axis="tp")
    with pytest.raises(ScheduleError, match=r"block list 'model.layers' itself"):
        carry_schedule(sch, tiny_llama(2), mesh=MESH)
    flat = create_schedule(torch.nn.Sequential(torch.nn.Linear(4, 4)), mesh=MESH)
    with pytest.raises(ScheduleError, match=r"no nn.ModuleList \(or nn.ModuleDict keyed 0, 1, ...\) of repeated "
                                            r"blocks"):
        carry_schedule(flat, torch.nn.Sequential(torch.nn.Linear(4, 4)), mesh=MESH)


def _pipelined_llama(n_layer: int, v: int, mesh: Mesh, batch: int = 16, microbatches: int = 8):
    from tiny_models import lm_inputs

    sch = create_schedule(tiny_llama(n_layer), mesh=mesh)
    schedule_llama(sch, tp="tp", vocab_parallel_head=False)
    stages = v * mesh.size("pp")
    for s in range(stages - 1):
        sch[f"model.layers.{(s + 1) * n_layer // stages - 1}"].cut_pipeline_stage()
    sch.pipeline(axis="pp", schedule="interleaved_1f1b" if v > 1 else "1f1b", n_microbatches=microbatches,
                 example_inputs={**lm_inputs(batch, 16), "use_cache": False})
    return sch


def test_a_pipeline_is_carried_with_its_stages_per_rank_as_far_as_the_blocks_allow():
    from tiny_models import lm_inputs

    mesh = Mesh((2, 2), ("pp", "tp"))
    big = _pipelined_llama(8, 4, mesh)  # 8 stages of one block, 4 a rank
    small = lm_inputs(8, 16)
    out = carry_schedule(big, tiny_llama(4), mesh=mesh, example_inputs=small).schedule
    cuts = [r.path for r in out.records if r.op == "cut_pipeline_stage"]
    assert cuts == ["model.layers.0", "model.layers.1", "model.layers.2"]  # 2 a rank: what 4 blocks allow
    (pipe,) = [r for r in out.records if r.op == "pipeline"]
    assert pipe.args["schedule"] == "interleaved_1f1b" and pipe.args["n_microbatches"] == 8
    assert pipe.args["example_inputs"]["input_ids"]["shape"] == [8, 16]
    assert pipe.args["example_inputs"]["use_cache"] is False  # the large schedule's flag, carried
    with pytest.raises(ScheduleError, match="give the shrunken model's example_inputs"):
        carry_schedule(big, tiny_llama(4), mesh=mesh)
    with pytest.raises(ScheduleError, match="use at least 4 blocks"):
        carry_schedule(big, tiny_llama(2), mesh=mesh, example_inputs=small)
    # a smaller batch: the most micro-batches it splits into
    out = carry_schedule(big, tiny_llama(4), mesh=mesh, example_inputs=lm_inputs(4, 16)).schedule
    assert [r for r in out.records if r.op == "pipeline"][0].args["n_microbatches"] == 4


@pytest.mark.slow
def test_a_carried_pipeline_verifies():
    import treadle
    from tiny_models import lm_inputs

    mesh = Mesh((2, 2), ("pp", "tp"))
    small = lm_inputs(8, 16)
    out = carry_schedule(_pipelined_llama(8, 4, mesh), tiny_llama(4), mesh=mesh, example_inputs=small).schedule
    assert treadle.verify(out, small, steps=2, timeout_s=300).ok


def test_float8_on_the_block_list_is_carried_and_finds_the_shrunken_models_linears():
    pytest.importorskip("torchao")
    from treadle.schedule.float8_primitive import float8_specs

    mesh = Mesh((2,), ("dp",))
    sch = create_schedule(tiny_llama(4), mesh=mesh)
    sch.data_parallel(axis="dp", shard=True)
    sch["model.layers"].float8(recipe="tensorwise", all_gather=True, skip=["*.o_proj"])
    carried = carry_schedule(sch, tiny_llama(2), mesh=mesh)
    assert "sch['model.layers'].float8(recipe='tensorwise', all_gather=True, skip=['*.o_proj'])" in _text(
        carried.schedule)
    spec = float8_specs(carried.schedule.view().extras)["model.layers"]
    # every linear of the two shrunken blocks but the skipped ones, found again on the shrunken model
    want = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.k_proj",
                                                                  "self_attn.v_proj", "mlp.gate_proj",
                                                                  "mlp.up_proj", "mlp.down_proj")]
    assert sorted(spec.linears) == sorted(want)


@pytest.mark.slow
def test_an_expert_parallel_schedule_is_carried_with_its_stated_load_and_verifies():
    import treadle
    from test_moe import tiny_mixtral
    from tiny_models import lm_inputs
    from transformers import MixtralConfig, MixtralForCausalLM

    from treadle.forms.expert import expert_parallel_moe

    torch.manual_seed(0)
    big = MixtralForCausalLM(MixtralConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                                           num_key_value_heads=2, intermediate_size=256, vocab_size=256,
                                           max_position_embeddings=64, num_local_experts=8, num_experts_per_tok=2,
                                           bos_token_id=0, eos_token_id=0, pad_token_id=0))
    mesh = Mesh((2,), ("dp",))
    sch = create_schedule(big, mesh=mesh)
    sch.data_parallel(axis="dp")
    expert_parallel_moe(sch, axis="dp", load_imbalance=1.25)
    carried = carry_schedule(sch, tiny_mixtral(), mesh=mesh)
    text = _text(carried.schedule)
    for i in range(2):
        assert f"sch['model.layers.{i}.mlp.experts'].expert_parallel(axis='dp', load_imbalance=1.25)" in text
    assert carried.per_block == {"expert_parallel": 1}
    assert treadle.verify(carried.schedule, lm_inputs(8, 16), steps=2, timeout_s=300).ok
