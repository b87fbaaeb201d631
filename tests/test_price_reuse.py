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

    def spy(*a, **k):
        out = orig_short(*a, **k)
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
    rehearsal_mod._rehearse_short = lambda *a, **k: seen.append(a[-1]) or orig(*a, **k)
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


@pytest.mark.parametrize("tp", [False, True])
def test_a_compiled_price_splices_its_data_flow_exactly(tp):
    """`_splice_flows`: the spliced data flow gives a compiled step the same fused runs as recording every block."""
    from treadle.pricing.compiled import compiled_times, compiled_units

    sch = treadle.create_schedule(tiny_llama(16), mesh=Mesh((2, 2), ("dp", "tp")))
    if tp:
        megatron(sch, tp="tp", sequence_parallel=True)
    for i in _spread(5, 16) if tp else range(0, 16, 2):
        sch[f"model.layers.{i}"].checkpoint()
    sch.data_parallel(axis="dp", shard=tp)
    inputs, hw = lm_inputs(4, 16), CLUSTER.rank_hardware()
    spliced = []
    orig, orig_shortening = rehearsal_mod._rehearse_short, rehearsal_mod.shortening
    rehearsal_mod._rehearse_short = lambda *a, **k: (lambda r: spliced.append(r is not None) or r)(orig(*a, **k))
    try:
        short = rehearse(sch, inputs, hw, None, gpu=True, flows=True)
        p_short = treadle.price(sch, inputs, CLUSTER, execution="compiled")
    finally:
        rehearsal_mod._rehearse_short = orig
    rehearsal_mod.shortening = lambda *a: None
    try:
        full = rehearse(sch, inputs, hw, None, gpu=True, flows=True)
        p_full = treadle.price(sch, inputs, CLUSTER, execution="compiled")
    finally:
        rehearsal_mod.shortening = orig_shortening
    assert spliced == [True, True]
    _assert_same(short, full)
    assert len(short.flows) == len(full.flows) == len(full.records)
    times = [compiled_times(r.records, r.flows, compiled_units(r.model), hw) for r in (short, full)]
    assert times[0] == times[1] and sum(t == 0 for t in times[0]) > len(times[0]) // 4  # fused runs found
    assert p_short.to_dict() == p_full.to_dict()


def _qwen2_sliding(n: int = 10):
    """Qwen2 whose layers from 4 on use a sliding window: its forward picks each layer's mask by position."""
    from arch_suite import _decoder

    return _decoder("Qwen2Config", "Qwen2ForCausalLM", num_hidden_layers=n, use_sliding_window=True,
                    sliding_window=8, max_window_layers=4)()


def test_a_profile_of_two_runs_in_one_list_keeps_the_model_and_its_positions():
    """NOTE [a shortened list keeps its kinds in place]: the profiler's block reuse once left a block out of the
    user's model (two runs of one list restored in the wrong order) and ran kept blocks with another position's
    mask; now the list is profiled whole, equal to profiling every block, and the model keeps every block."""
    from treadle.profile.blocks import find_block_runs
    from treadle.profile.profiler import profile

    model, inputs = _qwen2_sliding()
    before = list(model.model.layers)
    assert find_block_runs(model) == []  # a shortened list would move the sliding layers to full-attention places
    a = profile(model, inputs, hardware="h100", reuse_blocks=True)
    b = profile(model, inputs, hardware="h100", reuse_blocks=False)
    assert [r.to_dict() for r in a.ops] == [r.to_dict() for r in b.ops]
    assert list(model.model.layers) == before

    from treadle.profile import blocks

    runs = [blocks.BlockRun("model.layers", tuple(str(i) for i in range(10)), 0, 4),
            blocks.BlockRun("model.layers", tuple(str(i) for i in range(10)), 4, 10)]
    with blocks.shortened(model, runs):
        assert len(model.model.layers) == 6
    assert list(model.model.layers) == before  # restored whole, last snapshot first


def test_blocks_whose_storages_live_past_them_or_move_places_are_priced_as_recorded_whole():
    """A sliding-window model holds each layer's mask until its forward returns (freed outside the blocks), and a
    hybrid one picks masks by position: either way the price equals recording every block."""
    from arch_suite import _decoder

    mistral = _decoder("MistralConfig", "MistralForCausalLM", num_hidden_layers=10, sliding_window=8)()
    for model, inputs in (mistral, _qwen2_sliding()):
        sch = treadle.create_schedule(model, mesh=Mesh((4,), ("dp",)))
        sch.data_parallel(axis="dp")
        short, full, _, (p_short, p_full) = _both(sch, inputs)
        _assert_same(short, full)
        assert p_short.to_dict() == p_full.to_dict()
