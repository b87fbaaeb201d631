"""The planner's vocab-parallel cross-entropy and sequence parallelism: priced by hand, emitted as the primitives
the Megatron recipe uses, and verified on gloo ranks against the single-process original (forward, input
gradients, every parameter gradient)."""

from __future__ import annotations

import pytest
import torch

import treadle
from treadle.cost.cluster import ClusterSpec
from treadle.cost.collective_cost import all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s
from treadle.cost.convert import runtime_ops
from treadle.cost.links import LinkSpec
from treadle.mesh import Mesh
from treadle.planner.capture import capture
from treadle.planner.cost_graph import Roles, build_cost_graph
from treadle.planner import Plan, plan_model
from treadle.profile.roofline import op_time_s
from treadle.planner.capabilities import runtime_capabilities, shardable_fn as _shardable_fn, tied_leaf_holders
from treadle.forms.vocab.plan import terms as vocab_terms

VOCAB, BATCH, SEQ = 1024, 8, 32
# a slow link and a CPU device: compute matters and a gathered (N, V) logit tensor is expensive
SLOW = LinkSpec(latency_s=1e-6, bandwidth_bytes_per_s=2e9)


def gpt2(vocab: int = VOCAB, n_layer: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=128, n_head=4, vocab_size=vocab, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0, use_cache=False, loss_type="ForCausalLM")).train()


def llama(vocab: int = VOCAB, n_layer: int = 2, kv: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=n_layer, hidden_size=128, num_attention_heads=4,
                                        num_key_value_heads=kv, intermediate_size=256, vocab_size=vocab,
                                        max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                        use_cache=False, loss_type="ForCausalLM")).train()


def inputs(batch: int = BATCH, seq: int = SEQ) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def cluster(shape=(2,), names=("tp",)) -> ClusterSpec:
    return ClusterSpec.uniform(Mesh(shape, names), SLOW, device="cpu")


def _cost_graph(model, inp, cl, roles):
    g = capture(model, (), inp)
    is_leaf, _ = runtime_capabilities(model)
    return g, build_cost_graph(g, cl, roles, shardable=_shardable_fn(g, is_leaf, len(roles.tp), tied_leaf_holders(model)))


@pytest.fixture(scope="module")
def gpt2_graph():
    """GPT-2 with 4 blocks (repeated blocks are captured as such from 3 on), (8, 64) tokens, on tp=2."""
    model, inp = gpt2(n_layer=4), inputs(seq=64)
    return _cost_graph(model, inp, cluster(), Roles(None, False, ("tp",)))


# ----------------------------------------------------------------------------- vocab-parallel cross-entropy
def test_vocab_parallel_loss_is_priced_by_hand(gpt2_graph):
    g, cg = gpt2_graph
    assert (g.loss_head.head, g.loss_head.causal) == ("lm_head", True)  # HF's loss_function on lm_head's output
    (ce,) = vocab_terms(cg).values()
    unit = next(u for u in cg.units if u.leader == ce.node)
    (k,) = [k for k, s in enumerate(unit.strategies) if s[ce.node][0][0].letter == ce.letter]
    rows = BATCH * 64
    # three all-reduces of (N,) fp32 per-row scalars (max, sum of exp, target logit), forward only
    assert unit.costs[k].comm_s == pytest.approx(3 * all_reduce_time_s(rows * 4, 2, SLOW))
    assert unit.costs[k].fwd_s - unit.costs[k].comm_s == pytest.approx(unit.costs[k].compute_s - unit.costs[k].bwd_s)
    # what it saves: the head's (N, V) logits gathered whole at its exit
    head = next(u for u in cg.units if g.nodes[u.leader].module == "lm_head")
    gathered = [c.comm_s for s, c in zip(head.strategies, head.costs) if s[head.leader][1] == (-1,)
                and s[head.leader][0][0].outs[0] == 2]
    assert min(gathered) > 10 * unit.costs[k].comm_s


def test_planner_emits_vocab_parallel_loss_when_cheaper():
    model, inp = gpt2(), inputs()
    plan = plan_model(model, inp, cluster=cluster(), dp_axis=None)
    loss = [d for d in plan.decisions if d.op == "set_attr"]
    assert [(d.path, d.args["name"], d.args["kwargs"]) for d in loss] == [
        ("", "loss_function", {"axis": "tp", "causal": True})]
    # the head is column-parallel and its logits are never gathered; the loss's own reshape asks for nothing
    assert any(d.op == "shard" and d.path == "lm_head" and d.args["dim"] == 0 for d in plan.decisions)
    assert not any(d.op == "sync" and d.path == "lm_head" for d in plan.decisions)
    assert not any(d.op == "shard_attr" and d.path == "" for d in plan.decisions)
    # the schedule carries it as the Megatron recipe does (verified numerically in the tests below)
    (rec,) = [r for r in plan.schedule_for(gpt2()).records if r.op == "set_attr"]
    assert dict(rec.args)["value"].target == "treadle.runtime.losses:VocabParallelLoss"
    assert Plan.from_json(plan.to_json()).decisions == plan.decisions


def test_llama_gqa_plan_on_2x2_has_the_vocab_parallel_loss_on_its_tensor_axis():
    model, inp = llama(), inputs()
    plan = plan_model(model, inp, cluster=cluster((2, 2), ("dp", "tp")), dp_axis="dp", zero=False)
    assert [d.args["kwargs"] for d in plan.decisions if d.op == "set_attr"] == [{"axis": "tp", "causal": True}]
    assert any(d.op == "shard" and d.path == "lm_head" and d.args == {"names": "weight", "dim": 0, "axis": "tp"}
               for d in plan.decisions)


def test_no_vocab_parallel_loss_for_an_inline_loss():
    """A loss_fn the planner cannot replace keeps the cross-entropy whole (the logits are gathered)."""
    model, inp = gpt2(), inputs()
    fn = lambda out: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), inp["labels"].flatten())
    plan = plan_model(model, {"input_ids": inp["input_ids"]}, cluster=cluster(), dp_axis=None, loss_fn=fn)
    assert plan._context["kwargs"]["graph"].loss_head is None
    assert not any(d.op == "set_attr" for d in plan.decisions)


# ----------------------------------------------------------------------------- sequence parallelism
def _pub_costs(g, cg, module: str, op: str, raw: tuple[int, ...]) -> dict:
    """{published layout: (comm_s, fwd_s)} of the unit holding the exit node (the last `op`) of `module`, over
    strategies with raw layout `raw` there that agree on every other choice of the unit."""
    i = [n.index for n in g.nodes if n.kind == "op" and n.module == module and n.op_name == op][-1]
    unit = next(u for u in cg.units if i in u.nodes)
    groups: dict = {}
    for s, c in zip(unit.strategies, unit.costs):
        combo, pub = s[i]
        if tuple(o.outs[0] for o in combo) == raw:
            key = tuple((j, s[j][0], s[j][1] if j != i else None) for j in sorted(s))
            groups.setdefault(key, {})[pub] = (c.comm_s, c.fwd_s)
    return max(groups.values(), key=len)


def test_local_slice_reduce_scatter_and_gather_are_priced_by_hand(gpt2_graph):
    g, cg = gpt2_graph
    full = BATCH * 64 * 128 * 4  # one (B, T, E) fp32 activation, bytes
    rs, ag, ar = (f(full, 2, SLOW) for f in (reduce_scatter_time_s, all_gather_time_s, all_reduce_time_s))
    hw = cluster().rank_hardware()

    def ops(step: str, local: float) -> tuple[float, float]:  # the runtime's local ops around it (NOTE [copies])
        return tuple(sum(op_time_s(0, 2 * x, hw, torch.float32) + hw.op_overhead_s for x in way)
                     for way in runtime_ops(step, 1, local, 2))

    # where the residual stream enters the blocks: a local slice (a copy of the chunk), its gradient all-gathered
    drop = _pub_costs(g, cg, "transformer.drop", "dropout", (-1,))
    sf, sb = ops("split", full)
    assert drop[(1,)][1] - drop[(-1,)][1] == pytest.approx(sf)
    assert drop[(1,)][0] - drop[(-1,)][0] == pytest.approx(sf + ag + sb)
    # after the row-parallel linear: reduce-scatter (backward all-gather) instead of all-reduce (and its clone)
    row = _pub_costs(g, cg, "transformer.h.0.mlp.c_proj", "view", (-2,))
    (rf, rb), (af, _) = ops("reduce_scatter", full), ops("all_reduce", full)
    assert row[(1,)][0] - row[(-1,)][0] == pytest.approx(rs + rf + ag + rb - ar - af)
    assert row[(1,)][1] - row[(-1,)][1] == pytest.approx(rs + rf - ar - af)
    # the norm's exit gathers the sequence back for the column-parallel consumer (backward: a local split)
    norm = _pub_costs(g, cg, "transformer.h.0.ln_2", "layer_norm", (1,))
    assert norm[(-1,)][0] - norm[(1,)][0] == pytest.approx(ag + sum(ops("all_gather", full / 2)))
    # an embedding's own output is never split there (the model reads its sizes)
    assert set(_pub_costs(g, cg, "transformer.wte", "embedding", (-1,))) == {(-1,)}


def test_reshape_with_a_literal_sequence_size_never_sees_a_sequence_shard(gpt2_graph):
    """GPT2Model reshapes the final hidden states with the global sequence length (``view(-1, T, E)``): that
    reshape keeps the sequence whole, so the final norm gathers before it."""
    g, cg = gpt2_graph
    (i,) = [n.index for n in g.nodes if n.kind == "op" and n.module == "transformer" and n.op_name == "view"
            and n.args[1:2] == ([-1, 64, 128],)]
    unit = next(u for u in cg.units if i in u.nodes)
    ins = {s[i][0][0].ins[0] for s in unit.strategies}
    assert 1 not in ins and 0 in ins  # the batch dim is -1 there: computed from the local tensor


@pytest.mark.slow
def test_gpt2_sequence_parallel_plan_builds_and_verifies():
    """Norms, dropout and residual adds on sequence shards between the tensor-parallel regions: a local slice
    at the first block's input, reduce-scatter after the row-parallel linear, all-gather at the norm's exit,
    the norms' gradients reduced, and the vocab-parallel loss; verified against the original on 2 gloo ranks."""
    model, inp = gpt2(n_layer=4), inputs(seq=64)
    plan = plan_model(model, inp, cluster=cluster(), dp_axis=None)
    syncs = {(d.path, d.args["mode"], d.args["from_"], d.args["to"]) for d in plan.decisions if d.op == "sync"}
    # the row split is on the sequence (S1) or the batch (S0) dim: the same costs here, the solver may take either
    (row,) = {to for path, mode, frm, to in syncs if path == "transformer.h.0" and mode == "fwd_pre"}
    assert row in ("S0", "S1")
    assert ("transformer.h.0", "fwd_pre", "R", row) in syncs  # the slice, free in forward
    assert ("transformer.h.0.mlp.c_proj", "fwd_post", "P", row) in syncs  # reduce-scatter instead of all-reduce
    # all-gather at the input of the column-parallel c_fc, whose partial input gradient is reduce-scattered
    # (NOTE [gather with a reduce-scatter backward]): no all-reduce of that gradient, no gather at ln_2's exit
    assert {("transformer.h.0.mlp.c_fc", "fwd_pre", row, "R"), ("transformer.h.0.mlp.c_fc", "bwd_post", "P", row),
            ("transformer.h.0.attn.c_attn", "fwd_pre", row, "R")} <= syncs
    assert not {s for s in syncs if s[0] in ("transformer.h.0.ln_1", "transformer.h.0.ln_2")}
    # gathered at the final norm's exit or at the exit of the module around it (the same cost)
    assert {("transformer.ln_f", "fwd_post", row, "R"), ("transformer", "fwd_post", row, "R")} & syncs
    grads = {d.path for d in plan.decisions if d.op == "reduce_grads"}
    assert {"transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.ln_f"} <= grads
    assert any(d.op == "set_attr" for d in plan.decisions)  # with the vocab-parallel loss
    report = treadle.verify(plan.schedule_for(gpt2(n_layer=4)), inp, timeout_s=240, raise_on_mismatch=False)
    assert report.error is None and report.ok, report.summary()


@pytest.mark.slow
def test_llama_sequence_parallel_and_vocab_loss_on_2x2_verify():
    """LLaMA (RMSNorm, rotary, gated MLP) on a (dp=2, tp=2) mesh: data parallel on one axis, tensor parallel
    with sequence parallelism and the vocab-parallel head and loss on the other; 4 gloo ranks against the
    original (loss, every module's output and gradient, input and every parameter gradient)."""
    model, inp = llama(n_layer=4, kv=4), inputs(seq=64)
    plan = plan_model(model, inp, cluster=cluster((2, 2), ("dp", "tp")), dp_axis="dp", zero=False)
    syncs = {(d.path, d.args["mode"], d.args["from_"], d.args["to"]) for d in plan.decisions if d.op == "sync"}
    (row,) = {to for path, mode, frm, to in syncs if path == "model.layers.0" and mode == "fwd_pre"}
    assert row in ("S0", "S1")  # sequence or batch rows (see the GPT-2 test)
    assert {("model.layers.0", "fwd_pre", "R", row), ("model.layers.0.self_attn.o_proj", "fwd_post", "P", row),
            ("model.norm", "fwd_post", row, "R")} <= syncs
    # q, k, v (gate, up) read the gathered input of self_attn (mlp): gathered there, the summed partial gradient
    # reduce-scattered back to the row shard (NOTE [gather with a reduce-scatter backward])
    for m in ("model.layers.0.self_attn", "model.layers.0.mlp"):
        assert {(m, "fwd_pre", row, "R"), (m, "bwd_post", "P", row)} <= syncs
    # the vocab-split embedding's pending sum is all-reduced at its exit, then sliced at the first block
    assert ("model.embed_tokens", "fwd_post", "P", "R") in syncs
    assert [d.args["kwargs"] for d in plan.decisions if d.op == "set_attr"] == [{"axis": "tp", "causal": True}]
    report = treadle.verify(plan.schedule_for(llama(n_layer=4, kv=4)), inp, timeout_s=300, raise_on_mismatch=False)
    assert report.error is None and report.ok, report.summary()
    assert any(c.kind == "param_grad" and c.name == "lm_head.weight" for c in report.checks)


@pytest.mark.slow
def test_a_planned_pipeline_keeps_sequence_parallelism_but_not_the_vocab_parallel_loss_and_verifies():
    """The same LLaMA on a (pp=2, tp=2) mesh: the stages keep Megatron's sequence-parallel gathers (credited on
    their stages, NOTE [pipeline in the plan]), but a pipeline's loss runs as the model's own ops traced on its
    last stage, so the planner states no vocab-parallel loss there (it did, and the loss read the head's vocabulary
    shard as whole logits: a crash in the loss), and build refuses one stated by hand."""
    from treadle.schedule.log import Ref

    model, inp = llama(n_layer=4, kv=4), inputs(seq=64)
    plan = plan_model(model, inp, cluster=cluster((2, 2), ("pp", "tp")), pp_axis="pp", dp_axis=None, price_top=1)
    assert "pipeline pp" in plan.roles and not any(d.op == "set_attr" for d in plan.decisions)
    syncs = {(d.path, d.args["mode"]) for d in plan.decisions if d.op == "sync"}
    assert {(f"model.layers.{i}.{m}", "bwd_post") for i in range(4) for m in ("self_attn", "mlp")} <= syncs
    report = treadle.verify(plan.schedule_for(llama(n_layer=4, kv=4)), inp, timeout_s=300, raise_on_mismatch=False)
    assert report.error is None and report.ok, report.summary()
    sch = plan.schedule_for(llama(n_layer=4, kv=4))
    sch.set_attr("loss_function", Ref("treadle.runtime.losses:VocabParallelLoss", axis="tp", causal=True))
    with pytest.raises(treadle.VerifyError, match=r"pipeline: loss_function is set by set_attr to a VocabParallelLoss "
                                                   r"bound to the mesh, and the model.s forward calls it outside"):
        treadle.verify(sch, inp, timeout_s=300)


def test_a_slice_at_a_replicated_leaf_states_its_source_layout():
    """A Linear the plan leaves whole has no rule-derived output layout: its slice names from_=Replicate()."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    from treadle.planner.to_schedule import Decision, apply_decisions

    model = gpt2()
    sch = treadle.create_schedule(model, mesh=Mesh((2,), ("tp",)))
    _, is_leaf = runtime_capabilities(model)
    d = Decision("sync", "transformer.h.0.attn.c_proj", {"mode": "fwd_post", "to": "S1", "from_": "R", "axis": "tp"})
    apply_decisions(sch, [d], leaf_module=is_leaf)
    (spec,) = sch._state.syncs
    assert (spec.mode, spec.to, spec.from_) == ("fwd_post", (("tp", Shard(1)),), (("tp", Replicate()),))


@pytest.mark.slow
def test_gpt2_on_two_tensor_axes_with_row_shards_verifies():
    """Both axes of a 2x2 mesh tensor-parallel: row shards on one axis and feature shards on the other change
    together at one module's exit, converted in one typed sync from the whole source layout. The MLP's
    features are pinned to axis a (left free, this tiny model keeps axis a replicated since the local ops
    around each collective are priced: NOTE [copies]); the solver splits its rows over b."""
    model, inp = gpt2(n_layer=4), inputs(seq=64)
    pins = {"*.mlp.c_fc.weight": {"a": 1}, "*.mlp.c_proj.weight": {"a": 1}}
    plan = plan_model(model, inp, cluster=cluster((2, 2), ("a", "b")), dp_axis=None, pp_axis=None, pins=pins)
    syncs = [d for d in plan.decisions if d.op == "sync"]
    assert any(d.args["to"] in ("S0", "S1") for d in syncs)  # a row shard
    whole = [d for d in syncs if "layout" in d.args]
    assert whole and all(set(d.args["layout"]["from"]) == {"a", "b"} for d in whole)
    sch = plan.schedule_for(gpt2(n_layer=4))
    assert len([s for s in sch._state.syncs if s.path == whole[0].path and s.mode == "fwd_post"]) == 1
    report = treadle.verify(sch, inp, timeout_s=300, raise_on_mismatch=False)
    assert report.error is None and report.ok, report.summary()


def test_a_pin_on_either_name_of_a_tied_embedding_binds_it():
    """GPT-2's head and embedding share one weight, which the captured graph reads as ``lm_head.weight``: a pin
    written on ``transformer.wte.weight`` binds it too (it once bound nothing, silently), and two pins that
    disagree on the tied weight are refused."""
    from treadle.errors import PlanError
    from treadle.planner.pins import tied_pins

    model, inp = gpt2(), inputs()
    assert tied_pins(model, {"transformer.wte.weight": {"tp": 0}})["lm_head.weight"] == {"tp": 0}
    for name in ("transformer.wte.weight", "lm_head.weight"):
        plan = plan_model(model, inp, cluster=cluster(), dp_axis=None, pins={name: {"tp": "R"}})
        assert not [d for d in plan.decisions if d.op == "shard" and d.args["names"] == "weight"
                    and d.path in ("lm_head", "transformer.wte")]
        plan = plan_model(model, inp, cluster=cluster(), dp_axis=None, pins={name: {"tp": 0}})
        assert [d for d in plan.decisions if d.op == "shard" and d.path in ("lm_head", "transformer.wte")
                and d.args["dim"] == 0]
    with pytest.raises(PlanError, match=r"tied parameter .* different placements"):
        plan_model(model, inp, cluster=cluster(), dp_axis=None,
                   pins={"transformer.wte.weight": {"tp": 0}, "lm_head.weight": {"tp": "R"}})
