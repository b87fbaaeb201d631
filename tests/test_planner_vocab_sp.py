"""The planner's vocab-parallel cross-entropy and sequence parallelism: priced by hand, emitted as the primitives
the Megatron recipe uses, and verified on gloo ranks against the single-process original (forward, input
gradients, every parameter gradient)."""

from __future__ import annotations

import pytest
import torch

import treadle
from treadle.cost.cluster import ClusterSpec
from treadle.cost.collective_cost import all_gather_time_s, all_reduce_time_s, reduce_scatter_time_s
from treadle.cost.links import LinkSpec
from treadle.mesh import Mesh
from treadle.planner.capture import capture
from treadle.planner.cost_graph import Roles, build_cost_graph
from treadle.planner.plan import _shardable_fn, plan_model, runtime_capabilities, tied_leaf_holders

VOCAB, BATCH, SEQ = 1024, 8, 32
# a slow link and a CPU device: compute matters and a gathered (N, V) logit tensor is expensive
SLOW = LinkSpec(latency_s=1e-6, bandwidth_bytes_per_s=2e9)


def gpt2(vocab: int = VOCAB, n_layer: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=128, n_head=4, vocab_size=vocab, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0, use_cache=False, loss_type="ForCausalLM")).train()


def llama(vocab: int = VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=256, vocab_size=vocab,
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


# ----------------------------------------------------------------------------- vocab-parallel cross-entropy
def test_capture_records_the_loss_head_and_not_an_inline_loss():
    g = capture(gpt2(), (), inputs())
    assert (g.loss_head.head, g.loss_head.causal) == ("lm_head", True)
    # a loss computed by a user loss_fn on the logits does not go through loss_function
    g2 = capture(gpt2(), (), {"input_ids": inputs()["input_ids"]}, loss_fn=lambda out: out.logits.float().square().mean())
    assert g2.loss_head is None


def test_vocab_parallel_loss_is_priced_by_hand():
    model, inp = gpt2(), inputs()
    cl = cluster()
    g, cg = _cost_graph(model, inp, cl, Roles(None, False, ("tp",)))
    (ce,) = cg.vocab_ce.values()
    unit = next(u for u in cg.units if u.leader == ce.node)
    (k,) = [k for k, s in enumerate(unit.strategies) if s[ce.node][0][0].letter == ce.letter]
    rows = BATCH * SEQ
    # three all-reduces of (N,) fp32 per-row scalars (max, sum of exp, target logit), forward only
    assert unit.costs[k].comm_s == pytest.approx(3 * all_reduce_time_s(rows * 4, 2, SLOW))
    assert unit.costs[k].fwd_s - unit.costs[k].comm_s == pytest.approx(unit.costs[k].compute_s - unit.costs[k].bwd_s)
    # the alternative it saves: the head's (N, V) logits gathered whole at its exit
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


@pytest.mark.slow
def test_llama_gqa_vocab_parallel_loss_verifies_on_2x2():
    """Data parallel on one axis, tensor parallel with the vocab-parallel head and loss on the other: 4 gloo
    ranks against the single-process original (loss, outputs, input and every parameter gradient)."""
    model, inp = llama(), inputs()
    plan = plan_model(model, inp, cluster=cluster((2, 2), ("dp", "tp")), dp_axis="dp", zero=False)
    assert [d.args["kwargs"] for d in plan.decisions if d.op == "set_attr"] == [{"axis": "tp", "causal": True}]
    assert any(d.op == "shard" and d.path == "lm_head" and d.args == {"names": "weight", "dim": 0, "axis": "tp"}
               for d in plan.decisions)
    report = treadle.verify(plan.schedule_for(llama()), inp, timeout_s=300, raise_on_mismatch=False)
    assert report.error is None and report.ok, report.summary()
    assert any(c.kind == "param_grad" and c.name == "lm_head.weight" for c in report.checks)


def test_no_vocab_parallel_loss_for_an_inline_loss():
    """A loss_fn the planner cannot replace keeps the cross-entropy whole (the logits are gathered)."""
    model, inp = gpt2(), inputs()
    fn = lambda out: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), inp["labels"].flatten())
    plan = plan_model(model, {"input_ids": inp["input_ids"]}, cluster=cluster(), dp_axis=None, loss_fn=fn)
    assert not any(d.op == "set_attr" for d in plan.decisions)


# ----------------------------------------------------------------------------- sequence parallelism
@pytest.mark.slow
def test_sequence_parallel_plan_builds_and_verifies():
    """Norms, dropout and residual adds on sequence shards between the tensor-parallel regions: a local slice
    where the residual stream enters the blocks, reduce-scatter after the row-parallel linear, all-gather at
    the norm's exit, the norms' gradients reduced; verified against the original on 2 gloo ranks."""
    model, inp = gpt2(n_layer=4), inputs(seq=64)
    plan = plan_model(model, inp, cluster=cluster(), dp_axis=None)
    syncs = {(d.path, d.args["from_"], d.args["to"]) for d in plan.decisions if d.op == "sync"}
    assert ("transformer.drop", "R", "S1") in syncs  # the slice, free in forward
    assert ("transformer.h.0.mlp.c_proj", "P", "S1") in syncs  # reduce-scatter instead of all-reduce
    assert ("transformer.h.0.ln_2", "S1", "R") in syncs  # all-gather before the column-parallel c_fc
    assert ("transformer.ln_f", "S1", "R") in syncs
    grads = {d.path for d in plan.decisions if d.op == "reduce_grads"}
    assert {"transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.ln_f"} <= grads
    assert any(d.op == "set_attr" for d in plan.decisions)  # with the vocab-parallel loss
    report = treadle.verify(plan.schedule_for(gpt2(n_layer=4)), inp, timeout_s=240, raise_on_mismatch=False)
    assert report.error is None and report.ok, report.summary()


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


def test_local_slice_reduce_scatter_and_gather_are_priced_by_hand():
    model, inp = gpt2(n_layer=4), inputs(seq=64)
    g, cg = _cost_graph(model, inp, cluster(), Roles(None, False, ("tp",)))
    full = BATCH * 64 * 128 * 4  # one (B, T, E) fp32 activation, bytes
    # where the residual stream enters the blocks: a local slice, free in forward, its gradient all-gathered
    drop = _pub_costs(g, cg, "transformer.drop", "dropout", (-1,))
    assert drop[(1,)][1] == pytest.approx(drop[(-1,)][1])
    assert drop[(1,)][0] - drop[(-1,)][0] == pytest.approx(all_gather_time_s(full, 2, SLOW))
    # after the row-parallel linear: reduce-scatter (backward all-gather) instead of all-reduce
    row = _pub_costs(g, cg, "transformer.h.0.mlp.c_proj", "view", (-2,))
    rs, ag, ar = (f(full, 2, SLOW) for f in (reduce_scatter_time_s, all_gather_time_s, all_reduce_time_s))
    assert row[(1,)][0] - row[(-1,)][0] == pytest.approx(rs + ag - ar)
    assert row[(1,)][1] - row[(-1,)][1] == pytest.approx(rs - ar)
    # the norm's exit gathers the sequence back for the column-parallel consumer (backward: a local split)
    norm = _pub_costs(g, cg, "transformer.h.0.ln_2", "layer_norm", (1,))
    assert norm[(-1,)][0] - norm[(1,)][0] == pytest.approx(ag)
    # an embedding's own output is never split (the model reads its sizes), nor is a slice offered at the
    # blocks' inside
    emb = _pub_costs(g, cg, "transformer.wte", "embedding", (-1,))
    assert set(emb) == {(-1,)}


def test_reshape_with_a_literal_sequence_size_never_sees_a_sequence_shard():
    """GPT2Model reshapes the final hidden states with the global sequence length (``view(-1, T, E)``): that
    reshape keeps the sequence whole, so the final norm gathers before it."""
    model, inp = gpt2(n_layer=4), inputs(seq=64)
    g, cg = _cost_graph(model, inp, cluster(), Roles(None, False, ("tp",)))
    (i,) = [n.index for n in g.nodes if n.kind == "op" and n.module == "transformer" and n.op_name == "view"
            and n.args[1:2] == ([-1, 64, 128],)]
    unit = next(u for u in cg.units if i in u.nodes)
    ins = {s[i][0][0].ins[0] for s in unit.strategies}
    assert 1 not in ins and 0 in ins  # the batch dim is -1 there: computed from the local tensor
