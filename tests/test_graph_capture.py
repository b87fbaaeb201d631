"""trace(): capture of HF blocks with torch.export (children stay leaf calls and sub-schedules), flatten and
leaf variants, torch.fx for simple modules, and the capture errors."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

import treadle
from treadle import Mesh, ScheduleError, create_schedule
from tiny_models import lm_inputs, tiny_bert, tiny_gpt2, tiny_llama

MESH1 = Mesh((1,), ("tp",))


def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                               vocab_size=256, dropout_rate=0.0, decoder_start_token_id=0,
                                               pad_token_id=0))


CASES = {
    "gpt2": (lambda: tiny_gpt2(2), "transformer.h.0", ["ln_1", "attn", "ln_2", "mlp"]),
    "bert": (lambda: tiny_bert(2), "bert.encoder.layer.1", ["attention", "intermediate", "output"]),
    "llama": (lambda: tiny_llama(2), "model.layers.0", ["input_layernorm", "self_attn", "post_attention_layernorm",
                                                         "mlp"]),
    "t5": (tiny_t5, "decoder.block.1", ["layer.0", "layer.1", "layer.2"]),
}


def _logits(model, inp):
    with torch.no_grad():
        return model(**inp).logits


@pytest.mark.parametrize("name", list(CASES))
def test_trace_block_keeps_children_as_sub_schedules(name):
    make, path, children = CASES[name]
    model = make()
    model.config.use_cache = False
    inp = lm_inputs(2, 8)
    ref = _logits(model, inp)
    before = {c: model.get_submodule(f"{path}.{c}") for c in children}
    sch = create_schedule(model, mesh=MESH1)
    sch[path].trace(example_inputs=inp)
    leaf_calls = [n.target for n in sch[path].graph.nodes if n.op == "call_module"]
    assert leaf_calls == children
    for c, mod in before.items():
        assert sch[f"{path}.{c}"].mod is mod  # the very same module object, still addressable
    assert isinstance(sch[path].mod, fx.GraphModule) and sch[path].mod.capture_method == "export"
    torch.testing.assert_close(_logits(model, inp), ref, rtol=0, atol=0)
    assert "trace" in sch.to_python()


def test_trace_gpt2_block_verifies_after_replay():
    model = tiny_gpt2(2)
    inp = lm_inputs(2, 8)
    sch = create_schedule(model, mesh=MESH1)
    sch["transformer.h.1"].trace(example_inputs=inp)
    rep = treadle.verify(sch, inp)
    assert rep.ok and rep.losses == pytest.approx(rep.ref_losses, rel=1e-6)


def test_flatten_inlines_children_but_keeps_parameters():
    model = tiny_gpt2(2)
    model.config.use_cache = False
    inp = {**lm_inputs(2, 8), "use_cache": False}
    ref = _logits(model, inp)
    w = model.transformer.h[0].attn.c_attn.weight
    sch = create_schedule(model, mesh=MESH1)
    sch["transformer.h.0"].trace(flatten=True, example_inputs=inp)
    g = sch["transformer.h.0"].graph
    assert not [n for n in g.nodes if n.op == "call_module"]
    assert any(n.op == "get_attr" and n.target == "attn.c_attn.weight" for n in g.nodes)
    assert sch["transformer.h.0.attn.c_attn"].mod.weight is w  # same Parameter object: shards/ties stay valid
    torch.testing.assert_close(_logits(model, inp), ref, rtol=1e-6, atol=1e-6)


def test_flatten_with_leaves_by_type_and_path():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    model = tiny_gpt2(2)
    inp = {**lm_inputs(2, 8), "use_cache": False}
    ref = _logits(model, inp)
    sch = create_schedule(model, mesh=MESH1)
    sch["transformer.h.0"].trace(flatten=True, leaves=[GPT2Attention, "mlp.c_fc"], example_inputs=inp)
    calls = [n.target for n in sch["transformer.h.0"].graph.nodes if n.op == "call_module"]
    assert calls == ["attn", "mlp.c_fc"]
    torch.testing.assert_close(_logits(model, inp), ref, rtol=1e-6, atol=1e-6)
    again = treadle.load_schedule(tiny_gpt2(2), sch.to_json())  # leaves (a type and a path) replay from JSON
    assert [n.target for n in again["transformer.h.0"].graph.nodes if n.op == "call_module"] == calls


def test_a_kv_cache_reaching_only_leaves_is_handed_through():
    """use_cache=True: the block receives a DynamicCache, which only its attention leaf touches."""
    model = tiny_gpt2(2)
    inp = lm_inputs(2, 8)
    ref = _logits(model, inp)
    sch = create_schedule(model, mesh=MESH1)
    sch["transformer.h.0"].trace(example_inputs=inp)
    torch.testing.assert_close(_logits(model, inp), ref, rtol=0, atol=0)
    with pytest.raises(ScheduleError, match="uses a DynamicCache input.*use_cache=False"):
        sch["transformer.h.1"].trace(flatten=True, example_inputs=inp)


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(self.act(self.up(x))) + x


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: no graph can hold this
            return self.lin(x)
        return x


class Wrap(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_fx_trace_of_a_simple_module():
    model = Wrap(Gate())
    x = torch.randn(3, 8)
    ref = model(x)
    sch = create_schedule(model, mesh=MESH1)
    sch["inner"].trace()
    assert sch["inner"].mod.capture_method == "fx"
    assert [n.target for n in sch["inner"].graph.nodes if n.op == "call_module"] == ["up", "act", "down"]
    torch.testing.assert_close(model(x), ref)


def test_capture_errors_say_why():
    sch = create_schedule(tiny_gpt2(2), mesh=MESH1)
    with pytest.raises(ScheduleError, match=r"torch.fx cannot capture GPT2Block .*pass example_inputs="):
        sch["transformer.h.0"].trace()
    with pytest.raises(ScheduleError, match=r"trace at sch: torch.fx cannot capture GPT2LMHeadModel"):
        sch.trace()  # the root traces like any module (tests/test_slapo_trace.py); GPT-2 needs export
    assert not isinstance(sch.model, fx.GraphModule)
    with pytest.raises(ScheduleError, match=r"leaves \['nope'\] are not sub-modules of GPT2Block"):
        sch["transformer.h.0"].trace(leaves=["nope"], example_inputs=lm_inputs(2, 8))
    sch2 = create_schedule(Wrap(Branchy()), mesh=MESH1)
    with pytest.raises(ScheduleError, match=r"torch.export cannot capture Branchy"):
        sch2["inner"].trace(flatten=True, example_inputs={"x": torch.randn(2, 8)})
    assert not isinstance(sch2["inner"].mod, fx.GraphModule)  # nothing changed
