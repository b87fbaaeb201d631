"""The planner's vocab-parallel cross-entropy and sequence parallelism: priced by hand, emitted as the primitives
the Megatron recipe uses, and verified on gloo ranks against the single-process original (forward, input
gradients, every parameter gradient)."""

from __future__ import annotations

import pytest
import torch

import treadle
from treadle.cost.cluster import ClusterSpec
from treadle.cost.collective_cost import all_reduce_time_s
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


def test_planner_emits_vocab_parallel_loss_when_cheaper_and_it_verifies():
    model, inp = gpt2(), inputs()
    plan = plan_model(model, inp, cluster=cluster(), dp_axis=None)
    loss = [d for d in plan.decisions if d.op == "set_attr"]
    assert [(d.path, d.args["name"], d.args["kwargs"]) for d in loss] == [
        ("", "loss_function", {"axis": "tp", "causal": True})]
    # the head is column-parallel and its logits are never gathered
    assert any(d.op == "shard" and d.path == "lm_head" and d.args["dim"] == 0 for d in plan.decisions)
    assert not any(d.op == "sync" and d.path == "lm_head" for d in plan.decisions)
    # the same plan with the loss pinned replicated (vocab letter unsharded) is predicted slower
    sch = plan.schedule_for(gpt2())
    report = treadle.verify(sch, inp, timeout_s=240, raise_on_mismatch=False)
    assert report.error is None and report.ok, report.summary()
    assert report.losses == pytest.approx(report.ref_losses, rel=1e-5)


def test_no_vocab_parallel_loss_for_an_inline_loss():
    """A loss_fn the planner cannot replace keeps the cross-entropy whole (the logits are gathered)."""
    model, inp = gpt2(), inputs()
    fn = lambda out: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), inp["labels"].flatten())
    plan = plan_model(model, {"input_ids": inp["input_ids"]}, cluster=cluster(), dp_axis=None, loss_fn=fn)
    assert not any(d.op == "set_attr" for d in plan.decisions)


# ----------------------------------------------------------------------------- sequence parallelism
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
    report = treadle.verify(plan.schedule_for(gpt2(n_layer=4)), inp, timeout_s=240, raise_on_mismatch=False)
    assert report.error is None and report.ok, report.summary()
