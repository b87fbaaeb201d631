"""bench/verify_planner_plans.py end to end on one small case: a planned 2x2 schedule of a 4-block LLaMA whose
repeat_kv group count equals its kv head count (as Llama-2-70B's 64/8), carried onto the shrunken model the
script derives (2 blocks, the collision kept) and verified on 4 gloo ranks against the single process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tiny_models import lm_inputs
from treadle.cost.cluster import ClusterSpec
from treadle.mesh import Mesh
from treadle.planner import plan_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import verify_planner_plans as V  # noqa: E402


def _llama_collision():
    """4 blocks, 16 query heads of 8, 4 kv heads: num_key_value_groups == num_key_value_heads == 4."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=16, num_key_value_heads=4,
                      intermediate_size=448, vocab_size=256, max_position_embeddings=64, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0, loss_type="ForCausalLM")
    return LlamaForCausalLM(cfg)


def test_shrunken_mesh_and_config_rules():
    assert V.shrunken_mesh(Mesh((16, 4), ("dp", "tp")), ("dp",)) == Mesh((2, 4), ("dp", "tp"))
    assert V.shrunken_mesh(Mesh((8, 8), ("dp", "tp")), ("dp",)) == Mesh((2, 4), ("dp", "tp"))
    assert V.shrunken_mesh(Mesh((8,), ("dp",)), ("dp",)) == Mesh((8,), ("dp",))
    assert V.shrunken_mesh(Mesh((64,), ("dp",)), ("dp",)) == Mesh((8,), ("dp",))
    assert V.shrunken_mesh(Mesh((8, 8), ("r", "s")), ("r", "s")) == Mesh((2, 4), ("r", "s"))
    from transformers import GPT2Config, LlamaConfig

    big70 = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                        vocab_size=32000)
    cfg, desc = V.shrunken_config(big70, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size) == (16, 4, 128)
    assert cfg.num_attention_heads // cfg.num_key_value_heads == cfg.num_key_value_heads  # the collision kept
    cfg, _ = V.shrunken_config(big70, 4, kv_per_rank=2)  # --stress: 2 kv heads per rank, the collision kept
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 8)
    mask = V.lm_inputs(256, 2, pad=2)["attention_mask"]
    assert mask.tolist() == [[1] * 14 + [0] * 2] * 2
    big8 = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=128256)
    cfg, desc = V.shrunken_config(big8, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == (32, 8, 448, 256)
    assert desc == "L2 h128 q32/kv8 ffn448 V256"
    cfg, desc = V.shrunken_config(GPT2Config(n_layer=48, n_embd=1600, n_head=25), 1)
    assert (cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.n_layer) == (25, 200, 257, 2)
    with pytest.raises(ValueError, match="no shrink rule for model_type 'bert'"):
        from transformers import BertConfig

        V.shrunken_config(BertConfig(), 2)


@pytest.mark.slow
def test_planned_2x2_llama_with_colliding_kv_groups_is_carried_and_verifies():
    big = _llama_collision()
    cl = ClusterSpec.uniform(Mesh((2, 2), ("dp", "tp")), "nvlink4", device="h100-sxm")
    plan = plan_model(big, lm_inputs(4, 16), cluster=cl, dp_axis="dp", checkpoint="none",
                      pins={"*.q_proj.weight": {"tp": 0}, "*.o_proj.weight": {"tp": 1}})  # head-parallel attention
    sch = plan.schedule
    big_block0 = [r.to_python() for r in sch.records if r.path.startswith("model.layers.0.")]
    for proj, dim in (("q_proj", 0), ("k_proj", 0), ("v_proj", 0), ("o_proj", 1)):  # q and kv heads together
        assert f"sch['model.layers.0.self_attn.{proj}'].shard('weight', dim={dim}, axis='tp')" in big_block0

    row = V.verify_carried(sch, big, timeout_s=240)
    assert "error" not in row, row.get("error")
    assert row["small_mesh"] == str(Mesh((2, 2), ("dp", "tp")))
    assert row["small_config"] == "L2 h128 q4/kv2 ffn448 V256"  # 2 kv heads, 2 groups: the collision kept
    # carried: block 0's primitives exactly, and everything outside the blocks (data parallelism included)
    assert row["carried_block_records"] == big_block0
    outside = [r.to_python() for r in sch.records if not r.path.startswith("model.layers.")]
    assert row["carried_shared_records"] == outside
    assert any(".data_parallel(axis='dp'" in r for r in outside)
    assert row["carried"].startswith("4->2 blocks from [0,3]")
    # verified: loss, every module output and gradient, every parameter gradient and step, in fp32
    assert row["ok"], row.get("failures")
    assert row["n_checks"] > 50 and row["n_failed"] == 0
    assert row["fwd_max_abs"] < 1e-4 and row["grad_max_abs"] < 1e-5
    assert row["losses"] == pytest.approx(row["ref_losses"], rel=1e-5)
