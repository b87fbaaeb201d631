"""NOTE [blocks rehearsed once per context]: a rehearsal that keeps one block per context and splices the rest
gives the records, collectives and price of rehearsing every block, exactly."""

from __future__ import annotations

import pytest

import treadle
import treadle.pricing.rehearsal as rehearsal_mod
from treadle import Mesh
from treadle.cost.cluster import parse_cluster
from treadle.models import megatron
from treadle.pricing.rehearsal import rehearse

from tiny_models import lm_inputs, tiny_gpt2, tiny_llama

CLUSTER = parse_cluster("4:h100")


def _spread(c: int, n: int) -> list[int]:
    return sorted({int(j * n / c) for j in range(c)})


def _both(sch, inputs, *, price_too: bool = True):
    """(shortened rehearsal, full rehearsal, kept blocks, prices) of one schedule."""
    hw = CLUSTER.rank_hardware()
    kept = []
    orig_short, orig_shortening = rehearsal_mod._rehearse_short, rehearsal_mod.shortening

    def spy(*a):
        out = orig_short(*a)
        kept.append((len(a[-1].kept), len(a[-1].keys), out is not None))
        return out

    rehearsal_mod._rehearse_short = spy
    try:
        short = rehearse(sch, inputs, hw, None, gpu=True)
        p_short = treadle.price(sch, inputs, CLUSTER) if price_too else None
    finally:
        rehearsal_mod._rehearse_short = orig_short
    rehearsal_mod.shortening = lambda *a: None
    try:
        full = rehearse(sch, inputs, hw, None, gpu=True)
        p_full = treadle.price(sch, inputs, CLUSTER) if price_too else None
    finally:
        rehearsal_mod.shortening = orig_shortening
    return short, full, kept, (p_short, p_full)


def _assert_same(short, full):
    assert len(short.records) == len(full.records)
    for a, b in zip(short.records, full.records):
        assert a.to_dict() == b.to_dict()
    assert short.collectives == full.collectives
    assert short.saved_input_bytes == full.saved_input_bytes
    assert short.checkpoints == full.checkpoints


def _tp_dp(sch, *, sp: bool, ckpt: list[int], shard: bool = True, n: int = 12):
    megatron(sch, tp="tp", sequence_parallel=sp)
    for i in ckpt:
        sch[f"model.layers.{i}"].checkpoint()
    sch.data_parallel(axis="dp", shard=shard)


@pytest.mark.parametrize("n, ckpt, sp", [(16, _spread(5, 16), True), (12, list(range(0, 12, 2)), False),
                                         (12, [], True), (12, list(range(12)), False)])
def test_llama_under_tensor_and_data_parallelism_splices_exactly(n, ckpt, sp):
    sch = treadle.create_schedule(tiny_llama(n), mesh=Mesh((2, 2), ("dp", "tp")))
    _tp_dp(sch, sp=sp, ckpt=ckpt)
    short, full, kept, (p_short, p_full) = _both(sch, lm_inputs(4, 16))
    _assert_same(short, full)
    assert p_short.to_dict() == p_full.to_dict()
    n_kept, n_blocks, spliced = kept[0]
    assert spliced and n_blocks == n and n_kept < n
    if not ckpt or len(ckpt) == n:  # one kind: the ends and a middle block with its neighbours (and the next one
        assert n_kept <= 7          # above it, when checkpointed), whatever the block count


def test_mixed_checkpoint_policies_and_gpt2_splice_exactly():
    model = tiny_llama(24)
    sch = treadle.create_schedule(model, mesh=Mesh((4,), ("dp",)))
    for i in range(4, 20):
        sch[f"model.layers.{i}"].checkpoint(policy="alternate-matmuls")
    for i in (0, 1, 21):
        sch[f"model.layers.{i}"].checkpoint()
    sch.data_parallel(axis="dp")
    short, full, kept, (p_short, p_full) = _both(sch, lm_inputs(4, 16))
    _assert_same(short, full)
    assert p_short.to_dict() == p_full.to_dict()
    assert kept[0][2] and kept[0][0] < 20

    sch = treadle.create_schedule(tiny_gpt2(10), mesh=Mesh((2, 2), ("dp", "tp")))
    megatron(sch, tp="tp")
    sch.data_parallel(axis="dp")
    short, full, kept, (p_short, p_full) = _both(sch, {**lm_inputs(4, 16), "use_cache": False})
    _assert_same(short, full)
    assert p_short.to_dict() == p_full.to_dict()
    assert kept[0] == (5, 10, True)


def test_a_pipeline_price_splices_its_stages_and_the_sends_at_its_cuts():
    sch = treadle.create_schedule(tiny_gpt2(16), mesh=Mesh((2, 2), ("pp", "dp")))
    for i in range(6):
        sch[f"transformer.h.{i}"].checkpoint()
    sch["transformer.h.8"].cut_pipeline_stage()
    inputs = {**lm_inputs(8, 16, seed=3), "use_cache": False}
    sch.pipeline(axis="pp", schedule="1f1b", n_microbatches=4, example_inputs=inputs)
    sch.data_parallel(axis="dp")
    hw = CLUSTER.rank_hardware()
    seen = []
    orig = rehearsal_mod._rehearse_short
    rehearsal_mod._rehearse_short = lambda *a: seen.append(a[-1]) or orig(*a)
    try:
        p_short = treadle.price(sch, inputs, CLUSTER)
        short = rehearse(sch, inputs, hw, None, gpu=True, unpipelined=True, watch=("transformer.h.8",))
    finally:
        rehearsal_mod._rehearse_short = orig
    assert seen and len(seen[0].kept) < 16
    orig_shortening = rehearsal_mod.shortening
    rehearsal_mod.shortening = lambda *a: None
    try:
        p_full = treadle.price(sch, inputs, CLUSTER)
        full = rehearse(sch, inputs, hw, None, gpu=True, unpipelined=True, watch=("transformer.h.8",))
    finally:
        rehearsal_mod.shortening = orig_shortening
    _assert_same(short, full)
    assert short.output_bytes == full.output_bytes and full.output_bytes["transformer.h.8"] > 0
    assert p_short.to_dict() == p_full.to_dict()


def test_blocks_that_differ_in_the_schedule_or_share_nothing_to_leave_out_are_rehearsed_whole():
    from treadle.models.common import block_container
    from treadle.pricing.reuse import block_kinds, shortening

    model = tiny_llama(6)
    sch = treadle.create_schedule(model, mesh=Mesh((1,), ("dp",)))
    for i in (0, 3):
        sch[f"model.layers.{i}"].checkpoint()
    kinds = block_kinds(model, "model.layers", sch.records)
    assert kinds == [0, 1, 1, 0, 1, 1]  # the checkpointed blocks are a kind of their own
    assert block_container(model) == "model.layers"
    # every block is some context's neighbour: nothing to leave out
    assert shortening(model, "model.layers", sch.records, tuple(sch.view().checkpoints)) is None
    # a record that names blocks by a pattern the kinds cannot tell apart
    from treadle.schedule.log import Record
    assert block_kinds(model, "model.layers", [Record("annotate", "model", {"paths": "model.layers.*"})]) is None
    assert block_kinds(model, "model.layers", [Record("annotate", "", {"p": ["model.layers.2.mlp"]})]) == \
        [0, 0, 1, 0, 0, 0]
    # a block's own path in its record's arguments is its index replaced; another block's path is not
    own = [Record("annotate", f"model.layers.{i}", {"p": f"model.layers.{i}.mlp"}) for i in (1, 2)]
    other = [Record("annotate", "model.layers.3", {"p": "model.layers.31"}),
             Record("annotate", "model.layers.4", {"p": "model.layers.41"})]
    assert block_kinds(model, "model.layers", own + other) == [0, 1, 1, 2, 3, 0]


def test_a_compiled_price_rehearses_every_block_for_its_data_flow():
    sch = treadle.create_schedule(tiny_llama(8), mesh=Mesh((1,), ("dp",)))
    hw = CLUSTER.rank_hardware()
    calls = []
    orig = rehearsal_mod._rehearse_short
    rehearsal_mod._rehearse_short = lambda *a: calls.append(1) or orig(*a)
    try:
        full = rehearse(sch, lm_inputs(2, 16), hw, None, gpu=True, flows=True)
        short = rehearse(sch, lm_inputs(2, 16), hw, None, gpu=True)
    finally:
        rehearsal_mod._rehearse_short = orig
    assert len(calls) == 1 and len(full.flows) == len(full.records) and short.flows == []
    _assert_same(short, full)
