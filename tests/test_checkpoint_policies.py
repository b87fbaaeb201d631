"""Checkpoint policies as the peers define them (NOTE [checkpoint policies as peers define them]): full,
layer-level every-k, torchtitan's op-level SAC ("alternate-matmuls") and Megatron's selective recomputation
("attention-core"): what each keeps and recomputes, op by op against the uncheckpointed step; numerics against
the original; the price's recompute terms against a hand sum of the recorded ops; files; errors."""

from __future__ import annotations

import json

import pytest
import torch

import treadle
from treadle.cost.cluster import parse_cluster
from treadle.errors import ScheduleError
from treadle.mesh import Mesh
from treadle.pricing import rehearse
from treadle.runtime.recompute import recompute_host_s
from treadle.schedule.replay import load_schedule

transformers = pytest.importorskip("transformers")

H100 = parse_cluster("1:h100")


def _llama(layers: int = 4):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 32))
    return model, {"input_ids": ids, "labels": ids}


def _sch(model):
    return treadle.create_schedule(model, mesh=Mesh((1,), ("dp",)))


def _records(sch, inputs):
    hw = H100.rank_hardware()
    return rehearse(sch, inputs, hw, None, gpu=True), hw


def _ops(reh, block: str, phase: str) -> list[str]:
    return [r.op for r in reh.records if r.phase == phase and (r.module == block or r.module.startswith(block + "."))]


def test_checkpoint_every_k_names_every_kth_block_in_the_log():
    model, _ = _llama(layers=5)
    sch = _sch(model)
    sch["model.layers"].checkpoint_every(2)
    assert sch.view().checkpoints == ("model.layers.1", "model.layers.3")
    assert [r.to_python() for r in sch._state.records] == ["sch['model.layers.1'].checkpoint()",
                                                           "sch['model.layers.3'].checkpoint()"]
    sch2 = _sch(_llama(layers=5)[0])
    sch2["model.layers"].checkpoint_every(1, policy="alternate-matmuls")
    assert [p for p, _ in sch2.view().extras["selective"]] == [f"model.layers.{i}" for i in range(5)]


def test_alternate_matmuls_keeps_the_odd_matmuls_and_attention_and_recomputes_the_rest():
    """torchtitan's op-level SAC, op by op: of a LLaMA block's 7 matmuls (q, k, v, o, gate, up, down) the 1st,
    3rd, 5th and 7th are kept and the 2nd, 4th and 6th recomputed, with the block's other ops (up to the last
    one backward needs: torch's recomputation stops early); SDPA is never recomputed. Full checkpointing
    recomputes 6 (all but the down projection, whose output no backward reads)."""
    from collections import Counter

    model, inputs = _llama(layers=2)
    plain, _ = _records(_sch(model), inputs)
    fwd = Counter(_ops(plain, "model.layers.0", "forward"))
    assert fwd["aten.mm.default"] == 7
    counts = {}
    for policy in ("full", "alternate-matmuls"):
        sch = _sch(model)
        sch["model.layers.0"].checkpoint(policy=policy)
        reh, _ = _records(sch, inputs)
        counts[policy] = rec = Counter(_ops(reh, "model.layers.0", "recompute"))
        assert not [op for op in rec if "scaled_dot_product" in op] or policy == "full"
        assert set(rec) - {"aten.detach.default"} <= set(fwd)  # SAC detaches what it hands back
        assert _ops(reh, "model.layers.1", "recompute") == []  # the other block is not checkpointed
    assert counts["full"]["aten.mm.default"] == 6  # the down projection's output: no backward reads it
    assert counts["alternate-matmuls"]["aten.mm.default"] == 3
    for op in ("aten.silu.default", "aten.rsqrt.default", "aten.neg.default"):  # the pointwise ops: recomputed
        assert counts["alternate-matmuls"][op] == fwd[op]


def test_attention_core_recomputes_only_the_attention_kernel():
    model, inputs = _llama(layers=2)
    plain, _ = _records(_sch(model), inputs)
    sch = _sch(model)
    sch["model.layers.0"].checkpoint(policy="attention-core")
    reh, _ = _records(sch, inputs)
    sdpa = [op for op in _ops(plain, "model.layers.0", "forward") if "scaled_dot_product" in op]
    assert len(sdpa) == 1
    # checkpoint detaches the inputs it hands the recomputation
    assert [op for op in _ops(reh, "model.layers.0", "recompute") if op != "aten.detach.default"] == sdpa
    # the step keeps every other activation: what it saves is the plain step's less the attention's own
    saved = sum(r.saved_bytes for r in reh.records if r.phase == "forward")
    plain_saved = sum(r.saved_bytes for r in plain.records if r.phase == "forward")
    assert 0 < plain_saved - saved < 0.2 * plain_saved


@pytest.mark.parametrize("policy", ["full", "alternate-matmuls", "attention-core"])
def test_price_recompute_is_the_recomputed_ops_plus_checkpointing_host_cost(policy):
    """recompute_s = each recomputed op's roofline time and dispatch overhead, checkpointing's per-op host cost,
    and its per-region cost once per checkpointed region (NOTE [framework overheads])."""
    model, inputs = _llama(layers=2)
    sch = _sch(model)
    sch["model.layers"].checkpoint_every(1, policy=policy)
    reh, hw = _records(sch, inputs)
    rec = [r for r in reh.records if r.phase == "recompute"]
    assert rec
    hand = sum(r.time_s + hw.op_overhead_s for r in rec) + recompute_host_s(hw, ops=len(rec), regions=2)
    p = treadle.price(sch, inputs, H100)
    assert p.recompute_s == pytest.approx(hand, rel=1e-9)


def test_policies_order_memory_and_time_as_their_definitions_say():
    """Full keeps least and recomputes most; torchtitan's op SAC sits between; Megatron's attention core
    recomputes least and keeps almost everything."""
    model, inputs = _llama(layers=2)
    prices = {}
    for policy in (None, "full", "alternate-matmuls", "attention-core"):
        sch = _sch(model)
        if policy:
            sch["model.layers"].checkpoint_every(1, policy=policy)
        prices[policy] = treadle.price(sch, inputs, H100)
    full, op, core, none = (prices[k] for k in ("full", "alternate-matmuls", "attention-core", None))
    assert full.recompute_s > op.recompute_s > core.recompute_s > none.recompute_s == 0
    assert full.peak_bytes < op.peak_bytes < core.peak_bytes <= none.peak_bytes


@pytest.mark.slow
def test_every_policy_verifies_against_the_original():
    """Forward, every gradient and an optimizer step under FSDP2 on 2 gloo ranks: one block per policy, one
    left alone."""
    model, inputs = _llama(layers=4)
    sch = treadle.create_schedule(model, mesh=Mesh((2,), ("dp",)))
    sch["model.layers.0"].checkpoint()
    sch["model.layers.1"].checkpoint(policy="alternate-matmuls")
    sch["model.layers.2"].checkpoint(policy="attention-core")
    sch.data_parallel(axis="dp", shard=True)  # FSDP2 around the policies
    assert treadle.verify(sch, inputs).ok


def test_a_policy_is_data_in_the_file_and_replays():
    model, inputs = _llama(layers=2)
    sch = _sch(model)
    sch["model.layers.0"].checkpoint(policy="attention-core")
    sch["model.layers.1"].checkpoint(policy="alternate-matmuls")
    text = sch.to_json()
    assert [r["args"] for r in json.loads(text)["records"]] == [{"policy": "attention-core"},
                                                                {"policy": "alternate-matmuls"}]
    again = load_schedule(_llama(layers=2)[0], text, Mesh((1,), ("dp",)))
    assert again.view().extras["selective"] == sch.view().extras["selective"]
    bad = json.loads(text)
    bad["records"][0]["args"]["policy"] = "os.system"
    with pytest.raises(ScheduleError, match=r"unknown policy 'os.system'.*'alternate-matmuls'"):
        load_schedule(_llama(layers=2)[0], json.dumps(bad), Mesh((1,), ("dp",)))


def test_policy_errors_name_the_module_and_what_is_known():
    model, _ = _llama(layers=2)
    sch = _sch(model)
    with pytest.raises(ScheduleError, match=r"sch\['model.layers.0'\]: unknown policy 'selective'; known: "
                                            r"\['full', 'alternate-matmuls', 'attention-core'\]"):
        sch["model.layers.0"].checkpoint(policy="selective")
    with pytest.raises(ScheduleError, match="give one of match=, save= or policy="):
        sch["model.layers.0"].checkpoint(save=["aten.mm"], policy="attention-core")
    with pytest.raises(ScheduleError, match="policy 'full' is checkpoint()"):
        sch["model.layers.0"].checkpoint_selective(policy="full")
    with pytest.raises(ScheduleError, match="no stack of blocks"):
        sch["model.layers.0"].checkpoint_every(2)
    with pytest.raises(ScheduleError, match="k must be an int >= 1, got 0"):
        sch["model.layers"].checkpoint_every(0)
    sch["model.layers.1"].checkpoint(policy="attention-core")
    with pytest.raises(ScheduleError, match=r"sch\['model.layers.1'\]: already checkpointed"):
        sch["model.layers"].checkpoint_every(1)


def test_what_sac_keeps_is_counted_as_saved():
    """NOTE [what SAC keeps]: the outputs op-level SAC keeps live in its own cache, not autograd's saved tensors;
    the price charges them as saved activations (at least the four kept matmul outputs of the block), and the
    peak does not move."""
    model, inputs = _llama(layers=2)
    sch = _sch(model)
    sch["model.layers.0"].checkpoint(policy="alternate-matmuls")
    reh, _ = _records(sch, inputs)
    fwd = [r for r in reh.records if r.phase == "forward" and r.module.startswith("model.layers.0")]
    mm = [r for r in fwd if r.op == "aten.mm.default"]
    kept = sum(r.output_bytes for r in mm[0::2])
    assert len(mm) == 7 and kept > 0
    assert sum(r.saved_bytes for r in fwd) >= kept
    assert all(r.saved_bytes for r in mm[0::2])
    full = _sch(model)
    full["model.layers.0"].checkpoint()
    p_sac, p_full = treadle.price(sch, inputs, H100), treadle.price(full, inputs, H100)
    assert p_sac.activation_bytes > p_full.activation_bytes
    assert p_sac.peak_bytes == pytest.approx(p_sac.static_bytes + p_sac.activation_bytes + p_sac.transient_bytes)


@pytest.mark.parametrize("policy", ["full", "alternate-matmuls", "attention-core"])
def test_selective_checkpointing_pays_its_dispatch_modes_per_op_it_sees_on_a_cpu(policy):
    """Every op run under op-level SAC's dispatch modes, forward and recomputed, costs `selective_op_s`, and each
    region `selective_region_s` once (`selective_host_s`: measured ~10 us an op on a CPU core, where it makes SAC
    slower than full checkpointing); full checkpoints and the attention core run no such mode."""
    from treadle.pricing.step import segments
    from treadle.profile.hardware import CPU_CORE
    from treadle.runtime.recompute import selective_host_s
    from treadle.schedule.tree import within

    model, inputs = _llama(layers=2)
    sch = _sch(model)
    sch["model.layers"].checkpoint_every(1, policy=policy)
    reh = rehearse(sch, inputs, CPU_CORE, None, gpu=False)
    assert reh.selective == (("model.layers.0", "model.layers.1") if policy == "alternate-matmuls" else ())
    seen = [r for r in reh.records if r.phase in ("forward", "recompute")
            and any(within(r.module, p) for p in reh.selective)]
    with_modes = sum(s.compute_s for s in segments(reh.records, CPU_CORE, reh.checkpoints, None, reh.selective)[0])
    without = sum(s.compute_s for s in segments(reh.records, CPU_CORE, reh.checkpoints)[0])
    assert with_modes - without == pytest.approx(selective_host_s(CPU_CORE, ops=len(seen),
                                                                  regions=len(reh.selective)), rel=1e-9, abs=1e-15)
    assert CPU_CORE.selective_op_s > 0 and H100.rank_hardware().selective_op_s == 0  # hidden behind a GPU
