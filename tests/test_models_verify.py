"""Ready-made schedules on GPT-2, BERT and LLaMA pass `verify` (outputs, every gradient, three AdamW steps);
and `verify` catches broken schedules, naming the first diverging module."""

import pytest
from torch import nn

import treadle
import treadle.models
from treadle import Mesh, Partial, Replicate, Shard
from tiny_models import MODELS, lm_inputs, tiny_gpt2

TP2 = Mesh((2,), ("tp",))
DP2TP2 = Mesh((2, 2), ("dp", "tp"))


def _check(report):
    assert report.ok, report.summary()
    # three optimizer steps give the same losses as the single-process model (fp32, rel 1e-5)
    assert len(report.losses) == 3
    for got, ref in zip(report.losses, report.ref_losses):
        assert abs(got - ref) <= 1e-5 * abs(ref), (report.losses, report.ref_losses)
    kinds = {c.kind for c in report.checks}
    assert {"loss", "output", "output_grad", "param_grad", "param_step"} <= kinds
    n_params = len([c for c in report.checks if c.kind == "param_grad"])
    assert n_params >= 20


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "bert", "llama"])
@pytest.mark.parametrize("mesh", [TP2, DP2TP2], ids=["tp2", "dp2xtp2"])
def test_megatron_schedule_verifies(family, mesh):
    sch = treadle.create_schedule(MODELS[family](), mesh=mesh)
    treadle.models.megatron(sch, tp="tp", dp="dp" if "dp" in mesh.names else None)
    _check(treadle.verify(sch, lm_inputs(), steps=3))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sequence_parallel_verifies(family):
    sch = treadle.create_schedule(MODELS[family](), mesh=TP2)
    treadle.models.megatron(sch, tp="tp", sequence_parallel=True)
    assert any(s.to and dict(s.to).get("tp") == Shard(1) for s in sch._state.syncs)
    _check(treadle.verify(sch, lm_inputs(), steps=3))


@pytest.mark.slow
def test_zero3_with_tensor_parallel_and_checkpointing_verifies():
    sch = treadle.create_schedule(tiny_gpt2(n_layer=4), mesh=DP2TP2)
    treadle.models.megatron(sch, tp="tp", dp="dp", zero3=True, checkpoint_fraction=1.0)
    _check(treadle.verify(sch, lm_inputs(), steps=3))


@pytest.mark.slow
def test_replaced_module_verifies_against_the_original():
    sch = treadle.create_schedule(tiny_gpt2(), mesh=TP2)
    paths = sch.replace_all(type(sch["transformer.h.0.mlp.act"].mod), make_tanh_gelu)
    assert paths == ["transformer.h.0.mlp.act", "transformer.h.1.mlp.act"]
    treadle.models.megatron(sch, tp="tp")
    _check(treadle.verify(sch, lm_inputs(), steps=3))


def test_verify_names_a_wrong_replacement():
    sch = treadle.create_schedule(tiny_gpt2(), mesh=TP2)
    sch["transformer.h.1.mlp.act"].replace(nn.ReLU())
    treadle.models.megatron(sch, tp="tp")
    report = treadle.verify(sch, lm_inputs(), steps=1, raise_on_mismatch=False)
    assert not report.ok and report.first_divergence.startswith("output of 'transformer.h.1.mlp.act'")


class TanhGelu(nn.Module):
    """GPT-2's activation written with torch's built-in tanh approximation."""

    def forward(self, x):
        return nn.functional.gelu(x, approximate="tanh")


def make_tanh_gelu(old):
    return TanhGelu()


def _without_c_proj_sync(sch):
    st = sch._state
    st.syncs = [s for s in st.syncs if s.path != "transformer.h.0.mlp.c_proj"]
    st.records = [r for r in st.records if not (r.op == "sync" and r.path == "transformer.h.0.mlp.c_proj")]
    return sch


def test_verify_catches_row_parallel_all_reduce_stated_at_the_wrong_place():
    # with no sync anywhere, build derives the all-reduce after the row-parallel leaf
    sch = _without_c_proj_sync(treadle.models.megatron(treadle.create_schedule(tiny_gpt2(), mesh=TP2), tp="tp"))
    assert treadle.verify(sch, lm_inputs(), steps=1).ok
    sch = _without_c_proj_sync(treadle.models.megatron(treadle.create_schedule(tiny_gpt2(), mesh=TP2), tp="tp"))
    # the bug under test: the reduction is stated after the residual add, which it then counts twice
    sch["transformer.h.1.ln_1"].sync("fwd_pre", to=Replicate(), from_=Partial(), axis="tp")
    report = treadle.verify(sch, lm_inputs(), steps=1, raise_on_mismatch=False)
    assert not report.ok
    # the MLP's output is still a valid pending sum; the block's residual add is where it goes wrong
    assert report.first_divergence.startswith("output of 'transformer.h.0' "), report.summary()
    assert "'transformer.h.0.mlp' leaves a pending sum (Partial over tp) that is never reduced" in report.first_divergence
    with pytest.raises(treadle.VerifyError, match="first divergence: output of 'transformer.h.0' "):
        report.raise_if_failed()


def test_verify_catches_sync_on_the_wrong_dim():
    sch = treadle.create_schedule(tiny_gpt2(), mesh=TP2)
    treadle.models.megatron(sch, tp="tp")
    # the attention output is replicated; "re-gather" it over the batch instead of leaving it
    sch["transformer.h.1.attn"].sync("fwd_post", op="split", dim=0, axis="tp")
    sch["transformer.h.1.attn"].sync("fwd_post", op="all_gather", dim=1, axis="tp")
    report = treadle.verify(sch, lm_inputs(seq=8), steps=1, raise_on_mismatch=False)
    assert not report.ok
    assert "'transformer.h.1" in (report.first_divergence or report.error), report.summary()


def test_verify_catches_column_shard_without_bias_shard():
    sch = treadle.create_schedule(tiny_gpt2(), mesh=TP2)
    sch["transformer.h.0.mlp.c_fc"].shard("weight", dim=1, axis="tp")
    sch["transformer.h.0.mlp.c_proj"].shard("weight", dim=0, axis="tp").sync("fwd_post", to=Replicate(), axis="tp")
    report = treadle.verify(sch, lm_inputs(), steps=1, raise_on_mismatch=False)
    assert not report.ok and "'transformer.h.0.mlp.c_fc'" in report.error
    assert "its bias is not split the same way" in report.error
