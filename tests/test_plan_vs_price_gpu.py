"""The planner's cost graph against `treadle.price` on GPU presets: each rule where they disagreed, by hand."""

from __future__ import annotations

import pytest
import torch

from treadle.cost.cluster import parse_cluster
from treadle.planner import ilp
from treadle.planner.capture import capture
from treadle.planner.cost_graph import Roles, build_cost_graph
from treadle.planner.capabilities import runtime_capabilities, shardable_fn as _shardable_fn
from treadle.forms.data.plan import terms as dp_terms
from treadle.forms.data.plan import dp_window_s
from treadle.forms.tensor.plan import chosen_grad_sums_s

from test_price_plan import _MLP  # noqa: E402  (the same two-layer MLP)


def test_zero3_sync_hides_behind_compute_and_tensor_parallel_waits():
    """ZeRO-3 gathers and reduce-scatters run on the data-parallel axis's channel; a blocking tensor-parallel
    collective stalls compute but not that channel (`treadle.cost.overlap`), so both widen the window:
    E = max(0, latency + dp - (compute + tp comm))."""
    torch.manual_seed(0)
    model, x = _MLP(), torch.randn(8, 64)
    cl = parse_cluster("2x2:h100")  # dp over InfiniBand, tp over NVLink
    # Megatron MLP pinned: the up projection column-parallel, the down projection row-parallel
    g = capture(model, (x,))
    cg = build_cost_graph(g, cl, Roles("dp", True, ("tp",)), pins={"up.weight": (0,), "down.weight": (1,)},
                          shardable=_shardable_fn(g, runtime_capabilities(model)[0], 1))
    sol = ilp.solve(cg, budget_bytes=None)
    choice = sol.choice
    costs = [(u.count, u.costs[choice[i]]) for i, u in enumerate(cg.units)]
    compute = sum(n * c.compute_s for n, c in costs)
    tp = sum(n * c.comm_s for n, c in costs)
    dp = sum(n * c.dp_comm_s for n, c in costs)
    step, _, terms = ilp.evaluate(cg, choice, {})
    assert tp > 0 and dp_terms(cg).latency_s + dp > compute  # the window's tp part decides what is exposed
    exposed = max(0.0, dp_terms(cg).latency_s + dp - (compute + tp))
    assert terms["comm_s"] == pytest.approx(tp + exposed)
    assert sol.step_s == pytest.approx(step)


class _QKV(torch.nn.Module):
    """Three column-parallel projections of one normed input (an attention's q, k, v) and a row-parallel out."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.o = torch.nn.Linear(d, d)

    def forward(self, x):
        h = self.norm(x)
        return self.o(self.q(h) * self.k(h) + self.v(h)).pow(2).mean()


def test_input_gradient_of_column_parallel_consumers_is_summed_once():
    """NOTE [shared input-gradient sum]: q, k and v read the same replicated tensor; the runtime adds their
    partial input gradients and all-reduces once, so the solver charges one all-reduce, not three."""
    from treadle.cost.collective_cost import all_reduce_time_s
    from treadle.cost.cluster import ClusterSpec
    from treadle.mesh import Mesh

    torch.manual_seed(0)
    model, x = _QKV(), torch.randn(8, 64, requires_grad=False)
    cl = ClusterSpec.uniform(Mesh((2,), ("tp",)), "nvlink4", device="h100-sxm")
    g = capture(model, (x,))
    pins = {"q.weight": (0,), "k.weight": (0,), "v.weight": (0,), "o.weight": (1,)}
    cg = build_cost_graph(g, cl, Roles((), False, ("tp",)), pins=pins,
                          shardable=_shardable_fn(g, runtime_capabilities(model)[0], 1))
    sol = ilp.solve(cg, budget_bytes=None)
    per_unit = sum(u.count * u.costs[sol.choice[i]].comm_s for i, u in enumerate(cg.units))
    # h's gradient, (8, 64) fp32, with the runtime's view forward and clone backward (NOTE [copies])
    from treadle.cost.convert import grad_sum_ops
    from treadle.profile.roofline import op_time_s

    hw = cl.rank_hardware()
    one_sum = all_reduce_time_s(8 * 64 * 4, 2, cl.link("tp")) + sum(
        op_time_s(0, 2 * b, hw, torch.float32) + hw.op_overhead_s for b in sum(grad_sum_ops(8 * 64 * 4), ()))
    assert sum(len(u.costs[sol.choice[i]].grad_sums) for i, u in enumerate(cg.units)) == 3  # q, k and v need it
    assert sol.terms["comm_s"] == pytest.approx(per_unit + one_sum)
    step, _, terms = ilp.evaluate(cg, sol.choice, {})
    assert sol.step_s == pytest.approx(step) and terms["comm_s"] == pytest.approx(sol.terms["comm_s"])


def test_ddp_buckets_hide_behind_backward_compute_and_backward_tensor_parallel_waits():
    """DDP's buckets run on the data-parallel axis's channel during the backward; a blocking tensor-parallel
    collective of the backward (here the one input-gradient sum of q, k and v) stalls compute but not that
    channel (`treadle.cost.overlap`), so the window is the backward's compute and its tensor-parallel
    communication: E = max(0, latency + dp - (bwd compute + bwd tp comm + gradient sums))."""
    torch.manual_seed(0)
    model, x = _QKV(d=256), torch.randn(8, 256)
    cl = parse_cluster("2x2:h100")  # dp over InfiniBand, tp over NVLink
    g = capture(model, (x,))
    pins = {"q.weight": (0,), "k.weight": (0,), "v.weight": (0,), "o.weight": (1,)}
    cg = build_cost_graph(g, cl, Roles("dp", False, ("tp",)), pins=pins,
                          shardable=_shardable_fn(g, runtime_capabilities(model)[0], 1))
    assert dp_terms(cg).window == "bwd" and dp_terms(cg).overlap
    sol = ilp.solve(cg, budget_bytes=None)
    costs = [(u.count, u.costs[sol.choice[i]]) for i, u in enumerate(cg.units)]
    sums = chosen_grad_sums_s(cg, sol.choice)
    window = sum(n * (c.bwd_s + c.bwd_comm_s) for n, c in costs) + sums
    dp = sum(n * c.dp_comm_s for n, c in costs)
    tp = sum(n * c.comm_s for n, c in costs) + sums
    assert sums > 0 and dp_terms(cg).latency_s + dp > window - sums  # without the sums in the window, more is exposed
    step, _, terms = ilp.evaluate(cg, sol.choice, {})
    assert terms["comm_s"] == pytest.approx(tp + max(0.0, dp_terms(cg).latency_s + dp - window))
    assert sol.step_s == pytest.approx(step)


def test_the_embeddings_bucket_cannot_hide_behind_the_blocks_backward():
    """NOTE [the last bucket] in ilp.py: DDP reduces the embedding's gradient last, after every block's backward,
    so its all-reduce is exposed even when the step's aggregate window would hide all the data-parallel sync.
    A 32k-vocab embedding beside four small blocks: E = max(0, aggregate, embedding's sync - its own window)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=4, intermediate_size=128, vocab_size=32000,
                                         max_position_embeddings=512, use_cache=False, tie_word_embeddings=False))
    ids = torch.randint(0, 32000, (8, 512))
    g = capture(model, (), {"input_ids": ids, "labels": ids})
    cg = build_cost_graph(g, parse_cluster("2x1:h100"), Roles(("dp",), False, ()))
    assert dp_terms(cg).window == "bwd" and dp_terms(cg).overlap
    head = ilp.head_units(cg)
    assert [g.nodes[cg.units[u].leader].module for u in head if cg.units[u].costs[0].dp_comm_s] == ["model.embed_tokens"]
    choice = [0] * len(cg.units)
    costs = [(u.count, u.costs[0]) for u in cg.units]
    sums = chosen_grad_sums_s(cg, choice)
    dp = sum(n * c.dp_comm_s for n, c in costs)
    aggregate = dp_terms(cg).latency_s + dp - (sum(n * (c.bwd_s + c.bwd_comm_s) for n, c in costs) + sums)
    embedding = sum(cg.units[u].count * (cg.units[u].costs[0].dp_comm_s - dp_window_s(cg, cg.units[u].costs[0]))
                    for u in head)
    assert embedding > max(0.0, aggregate)  # the aggregate window would hide it all
    step, _, terms = ilp.evaluate(cg, choice, {})
    assert dp_terms(cg).buffer_s > 0  # LLaMA's rotary buffers: DDP broadcasts them every forward (NOTE [DDP buffers])
    assert terms["comm_s"] == pytest.approx(sum(n * c.comm_s for n, c in costs) + sums + embedding
                                            + dp_terms(cg).buffer_s)
    sol = ilp.solve(cg, budget_bytes=None)
    assert sol.step_s == pytest.approx(step)  # the ILP states the same bound
