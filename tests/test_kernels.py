"""Kernel schedules (SDPA attention, fused bias+GeLU / SwiGLU, fused residual+norm) on GPT-2 and LLaMA, alone and
composed with the Megatron tensor-parallel recipe; each verified against the original model."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import treadle
from treadle import Mesh, ScheduleError, create_schedule
from treadle.graph.pattern import node_form
from treadle.graph.rewrite import FusedRegion
from treadle.models import megatron
from treadle.models.kernels import GPT2SdpaAttention, LlamaSdpaAttention, kernel_schedule
from tiny_models import lm_inputs, tiny_bert, tiny_gpt2, tiny_llama


def _inputs():
    return {**lm_inputs(2, 8), "use_cache": False}


def _eager(model):
    model.config._attn_implementation = "eager"  # the baseline the SDPA module replaces
    return model


def _fused(sch, path):
    return [m for m in sch[path].mod.modules() if isinstance(m, FusedRegion)]


def test_gpt2_kernel_schedule_then_verify():
    model = _eager(tiny_gpt2(2))
    sch = create_schedule(model, mesh=Mesh((1,), ("tp",)))
    kernel_schedule(sch, example_inputs=_inputs(), compiler="aot_eager")
    assert isinstance(sch["transformer.h.0.attn"].mod, GPT2SdpaAttention)
    assert isinstance(sch["transformer.h.1"].mod, fx.GraphModule)
    assert len(_fused(sch, "transformer.h.1")) == 2  # residual+LayerNorm in the block, bias+GeLU in the MLP
    rep = treadle.verify(sch, _inputs())
    assert rep.ok


def test_llama_kernel_schedule_then_verify():
    model = _eager(tiny_llama(2))
    sch = create_schedule(model, mesh=Mesh((1,), ("tp",)))
    kernel_schedule(sch, example_inputs=_inputs(), compiler="aot_eager")
    assert isinstance(sch["model.layers.0.self_attn"].mod, LlamaSdpaAttention)
    assert len(_fused(sch, "model.layers.0")) == 2  # residual+RMSNorm, SwiGLU
    treadle.verify(sch, _inputs())


def test_gpt2_kernels_compose_with_megatron_tp2():
    model = _eager(tiny_gpt2(2))
    sch = create_schedule(model, mesh=Mesh((2,), ("tp",)))
    megatron(sch, tp="tp")
    kernel_schedule(sch, example_inputs=_inputs(), compiler="aot_eager")
    w = sch["transformer.h.0.mlp.c_fc"].mod.weight
    assert sch._state.param_shards[id(w)][0].axis == "tp"  # the decomposed, fused c_fc is column-parallel
    # SDPA and the fused regions round differently from eager attention (~1e-7): AdamW moves an entry whose
    # gradient is ~0 (rows of unused tokens) by about +-lr whatever its rounding, so a small lr keeps the
    # step check about the gradients, which are all compared at the usual tolerance
    rep = treadle.verify(sch, _inputs(), lr=1e-5)
    assert rep.ok and sum(c.kind == "param_grad" for c in rep.checks) == len(list(tiny_gpt2(2).parameters()))


def test_llama_sdpa_composes_with_megatron_tp2():
    model = _eager(tiny_llama(2))
    sch = create_schedule(model, mesh=Mesh((2,), ("tp",)))
    megatron(sch, tp="tp")
    kernel_schedule(sch, example_inputs=_inputs(), compiler="aot_eager", fuse_norm=False)
    treadle.verify(sch, _inputs())


def test_bert_residual_dropout_layernorm_and_bias_gelu_with_megatron_tp2_then_verify():
    model = tiny_bert(2)
    sch = create_schedule(model, mesh=Mesh((2,), ("tp",)))
    megatron(sch, tp="tp")
    kernel_schedule(sch, example_inputs=lm_inputs(2, 8), compiler="aot_eager")
    for out in ("bert.encoder.layer.0.attention.output", "bert.encoder.layer.1.output"):
        (fused,) = _fused(sch, out)
        ops = {node_form(n, None).op for n in fused.region.graph.nodes if n.op == "call_function"}
        assert {"dropout", "add", "layer_norm"} <= ops  # dropout + residual + LayerNorm in one compiled region
    rep = treadle.verify(sch, lm_inputs(2, 8), lr=1e-5)  # small lr: see test_gpt2_kernels_compose_with_megatron_tp2
    assert rep.ok


def test_fuse_refuses_to_swallow_a_leaf_with_recorded_primitives():
    from treadle.models.kernels import bias_gelu

    sch = create_schedule(tiny_bert(1), mesh=Mesh((2,), ("tp",)))
    sch["bert.encoder.layer.0.intermediate"].trace(example_inputs=lm_inputs(2, 8))
    sch["bert.encoder.layer.0.intermediate.intermediate_act_fn"].fork_rng(axis="tp")
    sch["bert.encoder.layer.0.intermediate.dense"].decompose()
    m = sch["bert.encoder.layer.0.intermediate"].find_pattern(bias_gelu)[0]
    with pytest.raises(ScheduleError, match=r"leaf 'bert.encoder.layer.0.intermediate.intermediate_act_fn' has "
                                            r"recorded primitives or hooks \(fork_rng\)"):
        sch["bert.encoder.layer.0.intermediate"].fuse(m, compiler="aot_eager")


def test_kernel_schedule_by_data_flow_on_a_block_no_recipe_names_reports_and_verifies():
    """OPT: no named schedule; the block's own ReLU after a biased fc1 is fused (decomposed), its norms are
    skipped with the reason (a reshape sits between the residual sum and the final norm), and it verifies."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, ffn_dim=128,
                                     vocab_size=256, max_position_embeddings=64, word_embed_proj_dim=64,
                                     dropout=0.0))
    sch = create_schedule(model, mesh=Mesh((1,), ("tp",)))
    report: list[str] = []
    kernel_schedule(sch, example_inputs=_inputs(), compiler="aot_eager", report=report)
    assert report == ["model.decoder.layers.0: block: fused 1 x bias+activation; self_attn: attention already SDPA; "
                      "skipped self_attn_layer_norm (its input is not directly a residual sum made in the block); final_layer_norm (its input is not "
                      "directly a residual sum made in the block)"]
    assert len(_fused(sch, "model.decoder.layers.0")) == 1
    assert treadle.verify(sch, _inputs()).ok


def test_kernel_schedule_by_data_flow_keeps_what_a_named_schedule_does_not_know():
    """Qwen3 has LLaMA's module names plus per-head q/k norms: not the LLaMA schedule (whose SDPA module would
    drop the norms), but its residual+RMSNorm and SwiGLU regions by data flow; its attention (transformers' SDPA
    implementation) keeps its q/k norms."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=256,
                                         max_position_embeddings=64))
    sch = create_schedule(model, mesh=Mesh((1,), ("tp",)))
    report: list[str] = []
    kernel_schedule(sch, example_inputs=_inputs(), compiler="aot_eager", report=report)
    assert report == ["model.layers.0: residual+norm -> post_attention_layernorm; self_attn: attention already SDPA; "
                      "mlp: fused 1 x swiglu; skipped input_layernorm (its input is not directly a residual sum made in the block)"]
    names = {type(m).__name__ for m in sch["model.layers.0.self_attn"].mod.modules()}
    assert "Qwen3RMSNorm" in names and "SdpaCore" not in names  # its norms kept; SDPA was already its kernel
    assert treadle.verify(sch, _inputs()).ok


def test_sdpa_attention_matches_eager_attention_with_padding_mask():
    model = _eager(tiny_gpt2(1)).eval()
    ids = lm_inputs(2, 8)["input_ids"]
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding: the 4-D additive mask reaches the attention
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        sch = create_schedule(model, mesh=Mesh((1,), ("tp",)))
        kernel_schedule(sch, example_inputs={"input_ids": ids, "use_cache": False}, compiler="aot_eager",
                        fuse_mlp=False, fuse_norm=False)
        got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


class _MinGPTBlock(torch.nn.Module):
    """minGPT's block: attention written out (scores scaled, masked_fill with -inf, softmax, value product)."""

    def __init__(self, d: int = 32, heads: int = 4, n: int = 16):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.c_attn, self.c_proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.proj = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.register_buffer("bias", torch.tril(torch.ones(n, n)).view(1, 1, n, n))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (c // self.heads) ** 0.5)
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        y = torch.softmax(att, dim=-1) @ v
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln_2(x))))


class _MinGPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_MinGPTBlock(), _MinGPTBlock()])

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def test_kernel_schedule_puts_attention_written_out_on_sdpa_by_data_flow():
    """minGPT writes attention out in the block (masked_fill with -inf): the core becomes one SDPA call with the
    negated fill mask and the block's scale, beside the residual+LayerNorm and bias+GeLU regions."""
    from treadle.models.fusions import SdpaCore

    torch.manual_seed(0)
    sch = create_schedule(_MinGPT(), mesh=Mesh((1,), ("tp",)))
    report: list[str] = []
    inputs = {"x": torch.randn(2, 16, 32)}
    kernel_schedule(sch, example_inputs=inputs, compiler="aot_eager", report=report)
    assert report[0] == ("blocks.0: 1 attention core(s) on SDPA; residual+norm -> ln_2; block: fused 1 x "
                         "bias+activation; skipped ln_1 (its input is not directly a residual sum made in the block)")
    cores = [m for m in sch["blocks.0"].mod.modules() if isinstance(m, SdpaCore)]
    assert len(cores) == 1 and cores[0].filled and cores[0].scale == pytest.approx(1 / 8 ** 0.5)
    assert treadle.verify(sch, inputs).ok


def test_kernel_schedule_puts_transformers_eager_attention_on_sdpa():
    """Qwen3 in eager attention: the self_attn graph's core (GQA-repeated k/v, additive mask, softmax in fp32, a
    dropout of p=0) becomes SDPA; the probabilities it also returned, which the block drops, become None."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from treadle.models.fusions import SdpaCore

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=256,
                                         max_position_embeddings=64))
    model.config._attn_implementation = "eager"
    sch = create_schedule(model, mesh=Mesh((1,), ("tp",)))
    report: list[str] = []
    kernel_schedule(sch, example_inputs=_inputs(), compiler="aot_eager", report=report)
    assert "self_attn: 1 attention core(s) on SDPA" in report[0]
    cores = [m for m in sch["model.layers.0.self_attn"].mod.modules() if isinstance(m, SdpaCore)]
    assert len(cores) == 1 and cores[0].returns_probs and not cores[0].filled and cores[0].scale == 0.25
    assert treadle.verify(sch, _inputs()).ok
