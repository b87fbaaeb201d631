"""Head-parallel attention found by the planner (not a recipe): grouped-query attention (LLaMA, Mistral: q and
kv heads sharded together, HF's `repeat_kv` sizes scaled), GPT-2's fused q|k|v (``shard(..., blocks=3)`` and
``shard_attr("split_size")``), with and without a KV cache; each plan verified on gloo against the original
(loss, every module output, input and parameter gradients, an optimizer step). Where the kv heads do not divide
over the tensor axis the attention stays replicated (the planner does not slice repeated kv heads)."""

from __future__ import annotations

import pytest
import torch

from tiny_models import VOCAB, lm_inputs
from treadle.cost.cluster import ClusterSpec
from treadle.errors import PlanError
from treadle.mesh import Mesh
from treadle.planner import Plan, plan_model
from treadle.testing import spawn
from treadle.verify.verify import verify

BATCH, SEQ = 4, 32


def _llama_like(kind: str, *, kv: int, use_cache: bool = False, heads: int = 8):
    """hidden 128, `heads` query heads, `kv` key/value heads, 2 layers, vocab 256."""
    import transformers as T

    torch.manual_seed(0)
    common = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=heads, num_key_value_heads=kv,
                  intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
                  eos_token_id=0, pad_token_id=0, use_cache=use_cache)
    cls, cfg = {"llama": (T.LlamaForCausalLM, T.LlamaConfig), "mistral": (T.MistralForCausalLM, T.MistralConfig),
                "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config)}[kind]
    return cls(cfg(**common))


def _gpt2(*, use_cache: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=8, vocab_size=VOCAB, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0, loss_type="ForCausalLM", use_cache=use_cache))


def _tp_plan(model, inputs, tp: int) -> Plan:
    """Tensor parallelism only (no data-parallel axis), no checkpointing, under 0.6x the unconstrained peak:
    the plan must shard to fit."""
    cl = ClusterSpec.uniform(Mesh((tp,), ("tp",)), "nvlink4", device="h100-sxm")
    free = plan_model(model, inputs, cluster=cl, dp_axis=None, checkpoint="none")
    # price_top=0: the solver's choice under its own memory model (what these tests examine is which heads it
    # shards; priced by default, the budget would be corrected to the plan as built and may need no attention split)
    plan = plan_model(model, inputs, cluster=cl, dp_axis=None, checkpoint="none",
                      memory_budget_bytes=0.6 * free.estimated.peak_bytes, price_top=0)
    assert plan.estimated.peak_bytes <= 0.6 * free.estimated.peak_bytes
    return plan


def _shards(plan: Plan) -> dict[tuple[str, str], tuple[int, int]]:
    """(module path, parameter) -> (dim, blocks) of every tp shard record of the plan's schedule."""
    out = {}
    for r in plan.schedule.records:
        if r.op == "shard":
            args = dict(r.args)
            names = args["*"] if isinstance(args["*"], list) else [args["*"]]
            for n in names:
                out[(r.path, n)] = (int(args["dim"]), int(args.get("blocks", 1)))
    return out


def _verify_all(plan: Plan, model, inputs) -> None:
    report = verify(plan.schedule_for(model), inputs, steps=1, timeout_s=240, raise_on_mismatch=False)
    assert report.error is None, report.error
    bad = [c for c in report.checks if not c.diff.ok]
    assert not bad, bad
    kinds = {c.kind for c in report.checks}
    assert {"output", "param_grad"} <= kinds, kinds
    assert report.losses == pytest.approx(report.ref_losses, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind,use_cache", [("llama", False), ("mistral", True)], ids=["llama", "mistral-cache"])
def test_gqa_plan_shards_q_and_kv_heads_and_verifies(kind, use_cache):
    """8 query heads, 4 kv heads on tp=2: q/k/v column-parallel by heads, o row-parallel, one reduction."""
    inputs = {**lm_inputs(BATCH, SEQ), "use_cache": use_cache}
    plan = _tp_plan(_llama_like(kind, kv=4, use_cache=use_cache), inputs, 2)
    shards = _shards(plan)
    for i in range(2):
        att = f"model.layers.{i}.self_attn"
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert shards.get((f"{att}.{proj}", "weight")) == (0, 1), (proj, shards)
        assert shards.get((f"{att}.o_proj", "weight")) == (1, 1), shards
        syncs = {r.path for r in plan.schedule.records if r.op == "sync" and r.path.startswith(att)}
        assert syncs == {f"{att}.o_proj"}, syncs  # no gather of q, k or v: the heads stay local
    _verify_all(plan, _llama_like(kind, kv=4, use_cache=use_cache), inputs)


@pytest.mark.slow
def test_kv_groups_equal_to_kv_heads_do_not_shard_the_group_count():
    """4 query heads, 2 kv heads: `repeat_kv` expands (b, 2, n_rep=2, s, d), the kv heads and the group count
    equal (Llama-2-70B: 8 and 8). Sharding the kv heads must leave ``num_key_value_groups`` whole (dividing it
    would broadcast one kv head over the local q heads: SDPA's slow path), and the plan verifies."""
    inputs = lm_inputs(BATCH, SEQ)
    plan = _tp_plan(_llama_like("llama", kv=2, heads=4), inputs, 2)
    shards = _shards(plan)
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert shards.get((f"model.layers.0.self_attn.{proj}", "weight")) == (0, 1), shards
    assert not [r for r in plan.schedule.records if r.op == "shard_attr"], plan.schedule.records
    _verify_all(plan, _llama_like("llama", kv=2, heads=4), inputs)


@pytest.mark.slow
@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "cache"])
def test_gpt2_fused_qkv_is_sharded_in_three_blocks_and_verifies(use_cache):
    inputs = {**lm_inputs(BATCH, SEQ), "use_cache": use_cache}
    plan = _tp_plan(_gpt2(use_cache=use_cache), inputs, 2)
    shards = _shards(plan)
    attrs = {(r.path, dict(r.args)["*"]) for r in plan.schedule.records if r.op == "shard_attr"}
    for i in range(2):
        att = f"transformer.h.{i}.attn"
        assert shards.get((f"{att}.c_attn", "weight")) == (1, 3), shards
        assert shards.get((f"{att}.c_attn", "bias")) == (0, 3), shards
        assert shards.get((f"{att}.c_proj", "weight")) == (0, 1), shards
        assert (att, "split_size") in attrs, attrs
    if not use_cache:
        _verify_all(plan, _gpt2(), inputs)
    else:  # the cache each rank returns holds its own heads of the original's keys and values
        for same, local, full in spawn(_cache_rank, 2, plan.to_json(), inputs, timeout_s=180):
            assert same and local[1] * 2 == full[1], (local, full)


def _cache_rank(rank: int, world: int, plan_json: str, inputs: dict) -> tuple[bool, tuple, tuple]:
    from treadle.runtime.build import build

    built = build(Plan.from_json(plan_json).schedule_for(_gpt2(use_cache=True)))
    with torch.no_grad():
        got = built(**inputs).past_key_values.layers[1]
        ref = _gpt2(use_cache=True)(**inputs).past_key_values.layers[1]
    same = all(torch.allclose(a, b.chunk(world, dim=1)[rank], atol=1e-5)
               for a, b in ((got.keys, ref.keys), (got.values, ref.values)))
    return same, tuple(got.keys.shape), tuple(ref.keys.shape)


def test_plan_json_keeps_blocks():
    """A saved plan replays the blocked shard (decisions carry ``blocks``)."""
    inputs = lm_inputs(BATCH, SEQ)
    cl = ClusterSpec.uniform(Mesh((2,), ("tp",)), "nvlink4", device="h100-sxm")
    plan = plan_model(_gpt2(), inputs, cluster=cl, dp_axis=None,
                      pins={"*.attn.c_attn.weight": {"tp": 1}, "*.attn.c_proj.weight": {"tp": 0}})
    again = Plan.from_json(plan.to_json())
    sch = again.schedule_for(_gpt2())
    blocked = [(r.path, dict(r.args)["*"]) for r in sch.records if r.op == "shard" and dict(r.args).get("blocks") == 3]
    assert sorted(blocked) == sorted((f"transformer.h.{i}.attn.c_attn", n) for i in range(2) for n in ("weight", "bias"))


@pytest.mark.slow
def test_kv_heads_that_do_not_divide_keep_attention_replicated_and_verify():
    """Qwen2 with 2 kv heads on tp=4: kv heads cannot shard, and sharding only the queries would pair them with
    the wrong kv heads, so the attention stays whole (the MLP is still tensor parallel)."""
    inputs = lm_inputs(BATCH, SEQ)
    plan = _tp_plan(_llama_like("qwen2", kv=2), inputs, 4)
    shards = _shards(plan)
    assert not [k for k in shards if ".self_attn." in k[0]], shards
    assert shards.get(("model.layers.0.mlp.gate_proj", "weight")) == (0, 1), shards
    _verify_all(plan, _llama_like("qwen2", kv=2), inputs)


class _ConfigHeads(torch.nn.Module):
    """Attention whose head split reads the head count from a config with a -1 on the sequence dim:
    on head-sharded q it would divide the sequence, silently."""

    def __init__(self):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(n_heads=4)
        self.emb = torch.nn.Embedding(VOCAB, 64)
        self.q = torch.nn.Linear(64, 64, bias=False)
        self.o = torch.nn.Linear(64, 64, bias=False)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        b = x.shape[0]
        q = self.q(x).view(b, -1, self.config.n_heads, 16).transpose(1, 2)  # (B, H, S, D)
        a = torch.softmax(q @ q.transpose(-1, -2), dim=-1) @ q
        return self.o(a.transpose(1, 2).reshape(b, -1, 64))


def test_config_head_count_with_a_minus_one_elsewhere_is_refused():
    model = _ConfigHeads()
    ids = torch.randint(0, VOCAB, (2, 8))
    cl = ClusterSpec.uniform(Mesh((2,), ("tp",)), "nvlink4", device="h100-sxm")
    pins = {"q.weight": {"tp": 0}, "o.weight": {"tp": 1}}
    with pytest.raises(PlanError, match="cannot hold|no plan|no strategy"):
        plan_model(model, (ids,), cluster=cl, dp_axis=None, pins=pins)
    # pins on q alone: q is sharded, then gathered at its exit before the head split
    plan = plan_model(model, (ids,), cluster=cl, dp_axis=None, pins={"q.weight": {"tp": 0}})
    syncs = [(d.path, d.args["to"]) for d in plan.decisions if d.op == "sync"]
    assert ("q", "R") in syncs, plan.decisions


def test_sdpa_with_enable_gqa_shards_query_and_kv_heads_together(monkeypatch):
    """SDPA's own grouped-query path (``enable_gqa``, no `repeat_kv`): query head i reads kv head i // (H / K), so
    sharding the queries alone would pair a rank's queries with the wrong kv heads: refused; q and kv together
    is a plan."""
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    model, inputs = _llama_like("llama", kv=4), lm_inputs(2, 8)
    from treadle.planner.capture import capture

    graph = capture(model, (), inputs)
    sdpa = [n for n in graph.ops() if n.op_name == "scaled_dot_product_attention"]
    assert sdpa and all(n.kwargs.get("enable_gqa") for n in sdpa)
    cl = ClusterSpec.uniform(Mesh((2,), ("tp",)), "nvlink4", device="h100-sxm")
    heads = {"*.q_proj.weight": {"tp": 0}, "*.o_proj.weight": {"tp": 1}}
    with pytest.raises(PlanError, match="cannot hold|no plan|no strategy"):
        plan_model(model, inputs, cluster=cl, dp_axis=None, graph=graph,
                   pins={**heads, "*.k_proj.weight": {"tp": "R"}, "*.v_proj.weight": {"tp": "R"}})
    plan = plan_model(model, inputs, cluster=cl, dp_axis=None, graph=graph,
                      pins={**heads, "*.k_proj.weight": {"tp": 0}, "*.v_proj.weight": {"tp": 0}})
    assert not [d for d in plan.decisions if d.op == "sync" and not d.path.endswith("o_proj")], plan.decisions


@pytest.mark.slow
def test_an_attribute_equal_to_another_dim_of_the_view_is_never_divided():
    """hidden 64 over 8 heads: head_dim == heads == 8, one size for two dims of attention's reshapes and the
    ``head_dim`` attribute. Dividing ``head_dim`` on shards would regroup the heads silently: the planner must
    not (an attribute whose value sizes two dims of one call is never divided, NOTE [fixed view sizes]), and
    its head-parallel plan verifies against the original."""
    import transformers as T

    def model():
        torch.manual_seed(0)
        return T.LlamaForCausalLM(T.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=8,
            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
            pad_token_id=0, use_cache=False))

    inputs = lm_inputs(BATCH, SEQ)
    plan = _tp_plan(model(), inputs, 2)
    assert not [r for r in plan.schedule.records if r.op == "shard_attr"], plan.schedule.to_python()
    assert _shards(plan).get(("model.layers.0.self_attn.q_proj", "weight")) == (0, 1)  # head-parallel
    _verify_all(plan, model(), inputs)


def test_attribute_rules_for_sizes_a_reshape_repeats():
    """NOTE [fixed view sizes], unit level: a sharded dim whose size an attribute holds needs ``shard_attr`` —
    unless the same size also sizes another dim of the call. An expand whose twin dim is broadcast from 1
    leaves the attribute to that dim (`repeat_kv`: kv heads == groups); a reshape cannot tell: refused."""
    from types import SimpleNamespace

    from treadle.planner.capture import TensorMeta
    from treadle.planner.cost_graph import view_attr_needs
    from treadle.planner.dims import AxisOption

    def node(op, src_shape, sizes):
        return SimpleNamespace(op_name=op, args=[None, list(sizes)], module="attn", out=TensorMeta(tuple(sizes),
                               torch.float32), fake_args=[torch.empty(src_shape, device="meta")])

    shard = lambda d: (AxisOption(0, (d,), (d,), True, (False,)),)  # noqa: E731  (output dim d on the axis)
    attr = lambda module, v, prefer=None: ("attr", "n") if v == 8 else "ok"  # noqa: E731  (attribute n = 8)
    # one dim of size 8: the attribute is divided on shards; 8 at two dims: which one n sizes is unknown, refused
    assert view_attr_needs(node("view", (2, 32), (2, 8, 4)), shard(1), ("tp",), attr) == [("n", "tp")]
    assert view_attr_needs(node("view", (2, 64), (2, 8, 8)), shard(1), ("tp",), attr) is None
    # repeat_kv: (b, kv=8, 1, s, d) expanded to (b, 8, n_rep=8, s, d), the kv dim sharded: n sizes the broadcast dim
    kv = node("expand", (2, 8, 1, 4, 16), (2, 8, 8, 4, 16))
    assert view_attr_needs(kv, shard(1), ("tp",), attr) == []
