"""`treadle.verify` on pipeline schedules: PP x TP x DP on 8 gloo ranks (2 x 2 x 2), PP4 on a tiny LLaMA with grouped
kv heads and on GPT-2, each schedule kind, against one process: the losses of both steps (the forward), every
parameter's gradient and every parameter after an AdamW step, on every group of ranks holding it."""

from __future__ import annotations

import pytest

import treadle
from treadle import Mesh, VerifyError, create_schedule
from treadle.models import megatron
from tiny_models import lm_inputs, tiny_gpt2, tiny_llama

BATCH, SEQ = 8, 16


def _inputs() -> dict:
    return {**lm_inputs(BATCH, SEQ, seed=3), "use_cache": False}


def _schedule(model, mesh: Mesh, blocks: str, cuts: list[int], kind: str, mb: int, *, tp: bool = False,
              dp: dict | None = None, scale_grads: bool = True):
    sch = create_schedule(model, mesh=mesh)
    if tp:
        megatron(sch, tp="tp", vocab_parallel_head=False)
    for c in cuts:
        sch[f"{blocks}.{c}"].cut_pipeline_stage()
    if dp is not None:
        sch.data_parallel(**dp)
    sch.pipeline(axis="pp", schedule=kind, n_microbatches=mb, example_inputs=_inputs(), scale_grads=scale_grads)
    return sch


def _assert_covers_every_parameter(report, model) -> None:
    assert report.ok, report.summary()
    names = {n for n, _ in model.named_parameters()}
    for kind in ("param_grad", "param_step"):
        checked = {c.name for c in report.checks if c.kind == kind}
        assert checked == names, (kind, names ^ checked)
    assert [c.name for c in report.checks if c.kind == "loss"][:2] == ["step 0", "step 1"]


@pytest.mark.slow
@pytest.mark.parametrize("shard", [False, True], ids=["ddp", "fsdp"])
def test_verify_pp_x_tp_x_dp_on_8_ranks(shard):
    mesh = Mesh((2, 2, 2), ("pp", "tp", "dp"))
    model = tiny_gpt2(4)
    sch = _schedule(model, mesh, "transformer.h", [1], "1f1b", 2, tp=True, dp=dict(axis="dp", shard=shard))
    report = treadle.verify(sch, _inputs(), timeout_s=300)
    _assert_covers_every_parameter(report, tiny_gpt2(4))


LLAMA_KINDS = [("gpipe", [0, 1, 2], 4), ("1f1b", [1, 3, 5], 4), ("interleaved_1f1b", list(range(7)), 4),
               ("looped_bfs", list(range(7)), 4), ("interleaved_zb", list(range(7)), 4),
               ("zbv", list(range(7)), 4), ("dualpipev", list(range(7)), 8)]


@pytest.mark.slow
@pytest.mark.parametrize("kind,cuts,mb", LLAMA_KINDS, ids=[k for k, _, _ in LLAMA_KINDS])
def test_verify_pp4_llama_gqa_every_schedule_kind(kind, cuts, mb):
    """8 LLaMA blocks (4 query heads over 2 kv heads, untied head) on 4 stage ranks; the looped and V schedules
    hold 8 stages, two a rank (a V places stages 0 and 7 on rank 0: embedding and head; DualPipeV needs a micro-batch per stage)."""
    model = tiny_llama(8)
    sch = _schedule(model, Mesh((4,), ("pp",)), "model.layers", cuts, kind, mb)
    report = treadle.verify(sch, _inputs(), timeout_s=300)
    _assert_covers_every_parameter(report, tiny_llama(8))


@pytest.mark.slow
@pytest.mark.parametrize("kind,cuts", [("gpipe", [0, 1, 2]), ("1f1b", [0, 1, 2]),
                                       ("interleaved_1f1b", [0, 1, 2, 3, 4, 5, 6])],
                         ids=["gpipe", "1f1b", "interleaved_1f1b"])
def test_verify_pp4_gpt2_tied_head(kind, cuts):
    """GPT-2's head is its embedding: stage 0 and the last stage hold one parameter, summed across them."""
    model = tiny_gpt2(8)
    sch = _schedule(model, Mesh((4,), ("pp",)), "transformer.h", cuts, kind, 4)
    report = treadle.verify(sch, _inputs(), timeout_s=300)
    _assert_covers_every_parameter(report, tiny_gpt2(8))


def test_verify_refuses_a_loss_fn_for_a_pipeline():
    sch = _schedule(tiny_gpt2(2), Mesh((2,), ("pp",)), "transformer.h", [0], "gpipe", 2)
    with pytest.raises(VerifyError, match=r"a pipeline's loss is the model's own loss, captured with its stages"):
        treadle.verify(sch, _inputs(), loss_fn=lambda out: out.logits.mean())


@pytest.mark.slow
def test_verify_finds_the_gradients_of_an_unscaled_pipeline():
    """scale_grads=False leaves the micro-batch gradients summed, n_microbatches times the reference's: verify
    reports the parameter gradients that differ and not the loss, which is right."""
    sch = _schedule(tiny_gpt2(2), Mesh((2,), ("pp",)), "transformer.h", [0], "1f1b", 2, scale_grads=False)
    report = treadle.verify(sch, _inputs(), raise_on_mismatch=False)
    assert not report.ok
    bad = {c.kind for c in report.checks if not c.diff.ok}
    assert "param_grad" in bad
    assert all(c.diff.ok for c in report.checks if c.kind == "loss" and c.name == "step 0")  # the first forward
    assert report.first_divergence.startswith("gradient of parameter ")
