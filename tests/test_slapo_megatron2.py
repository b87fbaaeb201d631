"""Slapo parity for BLOOM: the Megatron recipe as a constrained plan (verified at world 2 against the
single-process model: outputs, every gradient, an optimizer step), and the runtime's split of a per-head input
flattened with the batch (``sync("fwd_pre", op="split", dim=0, inner=heads, arg="alibi")``), which a user may
state by hand."""

from __future__ import annotations

import os

import pytest
import torch

import treadle
from treadle import Mesh, ScheduleError, create_schedule
from treadle.testing import spawn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TP2 = Mesh((2,), ("tp",))


def bloom():
    import transformers as T

    torch.manual_seed(0)
    return T.BloomForCausalLM(T.BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=256, hidden_dropout=0.0,
                                            attention_dropout=0.0))


def _inputs(batch=2):
    ids = torch.randint(1, 256, (batch, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids, "use_cache": False}


@pytest.mark.slow
def test_megatron_on_bloom_splits_every_linear_and_verifies():
    """BLOOM has no named recipe: the constrained plan splits every Linear of its blocks over tp. Its ALiBi biases
    arrive flattened (batch x heads), a blocked split the placement algebra cannot state, so the plan keeps the
    attention core whole (q|k|v gathered) rather than splitting heads it could not feed exactly."""
    sch = create_schedule(bloom(), mesh=TP2)
    treadle.models.megatron(sch, tp="tp")
    shards = {r.path.split(".", 3)[3] for r in sch.records if r.op == "shard"}
    assert shards == {"self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h",
                      "mlp.dense_4h_to_h"}
    treadle.verify(sch, _inputs(), steps=1)


def _split_rank(rank, world):
    from treadle.runtime.convert import apply_op
    import torch.distributed as dist

    x = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2 * 4, 1, 3)  # (batch x heads, 1, seq)
    y = apply_op(x, "split", {"dim": 0, "inner": 4}, dist.group.WORLD)
    return y


def test_split_inner_keeps_this_ranks_heads_of_every_batch_entry():
    x = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 1, 3)
    for r, y in enumerate(spawn(_split_rank, 2, timeout_s=60)):
        torch.testing.assert_close(y, x[:, 2 * r:2 * r + 2].reshape(4, 1, 3))


def test_split_inner_must_divide_by_the_axis():
    sch = create_schedule(bloom(), mesh=TP2)
    with pytest.raises(ScheduleError, match=r"sync at sch\['transformer.h.0'\]: split inner=3 must be a positive "
                                            r"multiple of the size 2 of axis 'tp'"):
        sch["transformer.h.0"].sync("fwd_pre", op="split", dim=0, inner=3, axis="tp", arg="alibi")
