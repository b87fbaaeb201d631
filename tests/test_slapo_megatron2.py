"""Slapo parity, ready-made schedules by structure for BLOOM: the per-head ALiBi biases the block receives
(batch x heads flattened, made outside it) are split to this rank's heads (``sync("fwd_pre", op="split",
dim=0, inner=heads, arg="alibi")``), found by shape, not by class name. Verified at world 2 against the
single-process model (outputs, every gradient, an optimizer step)."""

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
def test_megatron_by_structure_verifies_bloom_with_alibi_split_to_local_heads():
    sch = create_schedule(bloom(), mesh=TP2)
    treadle.models.megatron(sch, tp="tp")
    splits = [(r.path, r.args) for r in sch.records if r.op == "sync" and r.args.get("op") == "split"]
    assert splits == [(f"transformer.h.{i}", {"*": "fwd_pre", "op": "split", "axis": "tp", "dim": 0, "inner": 4,
                                              "arg": "alibi"}) for i in range(2)]
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


class _Cfg:
    num_attention_heads = 4


class _Blk(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, h, extras):
        return h + self.down(self.up(h)) + extras[0].mean()


class _Nested(torch.nn.Module):
    """Per-head biases handed to each block inside a tuple."""

    def __init__(self):
        super().__init__()
        self.config = _Cfg()
        self.layers = torch.nn.ModuleList([_Blk(), _Blk()])

    def forward(self, x):
        bias = torch.zeros(x.shape[0] * 4, 1, x.shape[1])
        for layer in self.layers:
            x = layer(x, (bias,))
        return x


def test_a_per_head_tensor_inside_a_container_input_is_refused():
    sch = create_schedule(_Nested(), mesh=TP2)
    with pytest.raises(ScheduleError, match=r"megatron at sch\['layers.0'\] \(_Blk\): input 'extras' holds a tensor of "
                                            r"shape \(4, 1, 7\) with one entry per attention head \(4\) inside a "
                                            r"container"):
        treadle.models.megatron(sch, tp="tp", example_inputs={"x": torch.randn(1, 7, 8)})
