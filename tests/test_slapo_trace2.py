"""Slapo parity, trace by need for pipelines: only the forwards from the root down to the cut container are
captured; every other module stays an eager leaf call, so a module outside the cut blocks may branch on tensor
values (a NaN check, a clamp on overflow). Loss and every parameter gradient on 2 gloo ranks (pp=2) against
the single-process model; GPT-2's leaves by structure."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import treadle
from treadle import Mesh, ScheduleError, create_schedule
from treadle.graph.capture import capture_export
from treadle.forms.pipeline.stages import stage_leaves
from treadle.testing import spawn

VOCAB, DIM, BATCH, SEQ, MB = 32, 16, 4, 6, 2


class NanGuard(nn.Module):
    """No parameters, branches on values: the root's capture used to inline it and fail."""

    def forward(self, h):
        if torch.isnan(h).any():
            h = torch.nan_to_num(h)
        return h * 2


class ClampNorm(nn.Module):
    """Parameters and a branch on values: a leaf whose code export cannot run on fake tensors."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(DIM)

    def forward(self, h):
        if h.abs().max() > 1e4:
            h = h.clamp(-1e4, 1e4)
        return self.ln(h)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, h):
        return h + torch.tanh(self.fc(h))


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.guard = NanGuard()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.norm = ClampNorm()

    def forward(self, input_ids):
        h = self.guard(self.emb(input_ids))
        for b in self.blocks:
            h = b(h)
        return self.norm(h)


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = Body()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, labels):
        logits = self.head(self.body(input_ids))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _inputs():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.roll(1, -1)}


def test_whole_model_capture_fails_on_the_value_branch_and_the_leaves_are_by_need():
    with pytest.raises(ScheduleError, match=r"torch.export cannot capture LM"):
        capture_export(LM(), ["body.blocks.0", "body.blocks.1", "body.blocks.2", "body.blocks.3", "body.emb",
                              "body.norm", "head"], (), _inputs(), where="test", dynamic=False)
    with pytest.raises(ScheduleError, match=r"leaf 'body.guard' branches on tensor values .*cannot run on fake"):
        capture_export(LM(), stage_leaves(LM(), "body.blocks"), (), _inputs(), where="test", dynamic=False)
    assert sorted(stage_leaves(LM(), "body.blocks")) == sorted([f"body.blocks.{i}" for i in range(4)] + [
        "body.emb", "body.guard", "body.norm", "head"])


def _pp_rank(rank, world):
    sch = create_schedule(LM(), mesh=Mesh((2,), ("pp",)))
    sch["body.blocks.1"].cut_pipeline_stage()
    sch.pipeline(axis="pp", schedule="1f1b", n_microbatches=MB, example_inputs=_inputs())
    pipe = treadle.build(sch)
    loss = pipe.step(**_inputs())
    return loss, {n: p.grad.clone() for n, p in pipe.param_dict().items() if p.grad is not None}


@pytest.mark.slow
def test_pipeline_keeps_value_branching_modules_outside_the_cut_blocks_eager():
    ref = LM()
    loss = ref(**_inputs())
    loss.backward()
    want = dict(ref.named_parameters())
    seen = set()
    for got_loss, grads in spawn(_pp_rank, 2, timeout_s=180):
        assert got_loss == pytest.approx(float(loss.detach()), rel=1e-5)
        for n, g in grads.items():
            torch.testing.assert_close(g, want[n].grad, rtol=1e-4, atol=1e-6, msg=n)
            seen.add(n)
    assert seen == set(want)


def test_gpt2_leaves_by_structure():
    from tiny_models import tiny_gpt2

    leaves = stage_leaves(tiny_gpt2(2), "transformer.h")
    assert sorted(leaves) == sorted(["transformer.h.0", "transformer.h.1", "transformer.wte", "transformer.wpe",
                                     "transformer.drop", "transformer.ln_f", "lm_head"])
