"""NOTE [bytes per node] (the bytes each captured node's ops move, forward and backward, as `treadle.price` counts
an op's), NOTE [gradient sums at a fork] (the autograd engine's adds, which no node's ops hold) and NOTE [copies]
(the runtime's local ops around a layout change): each against the price's records of the same step."""

from __future__ import annotations

import pytest
import torch

import treadle
from treadle.cost.cluster import parse_cluster
from treadle.planner import plan_model
from treadle.planner.capture import TensorMeta, capture
from treadle.planner.cost_graph import Roles, _Builder
from treadle.planner.roles import TrainSpec
from treadle.pricing.rehearsal import rehearse

from tiny_models import MODELS, lm_inputs


def _price_bytes(records, phase: str, adds: bool | None = None) -> int:
    return sum(r.read_bytes + r.write_bytes for r in records if r.phase == phase
               and (adds is None or r.op.startswith("aten.add") == adds))


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_capture_measures_the_bytes_the_price_records_and_the_forks_hold_the_rest(name):
    inputs = lm_inputs()
    graph = capture(MODELS[name](), (), inputs, reduce_repeats=False)
    cl = parse_cluster("1:cpu")
    recs = rehearse(treadle.create_schedule(MODELS[name](), mesh=cl.mesh), inputs, cl.rank_hardware(), None).records
    # forward: the same ops, the same bytes
    assert sum(graph.fwd_bytes.values()) == _price_bytes(recs, "forward")
    # backward: every op a node's autograd functions run; the engine's gradient sums are no node's (nor the
    # loss's seed gradient, a scalar)
    engine = _price_bytes(recs, "backward", adds=True)
    assert engine > 0
    assert sum(graph.bwd_bytes.values()) == pytest.approx(_price_bytes(recs, "backward") - engine, abs=16)
    # ... and they are the sums the cost graph charges where a value forks: k readers, k - 1 adds of 3 passes
    # (a tied embedding and head: the parameter's two gradients)
    b = _Builder(graph, cl, Roles(None, False, ()), TrainSpec(), {}, None, None)
    b._batch()
    forks = sum((b.grad_uses(n.index) - 1) * 3 * n.out.nbytes for n in graph.nodes
                if n.kind in ("op", "param") and isinstance(n.out, TensorMeta) and b.rg[n.index]
                and b.grad_uses(n.index) > 1)
    assert forks == engine


def test_a_cross_entropy_moves_several_times_its_own_tensors():
    """The loss on a vocabulary: upcast, log-softmax written and read again; its backward writes two logits-sized
    gradients. A pass over its own tensors each way (what the cost graph charged before) is far under."""
    inputs = lm_inputs()
    graph = capture(MODELS["llama"](), (), inputs, reduce_repeats=False)
    (loss,) = [n for n in graph.nodes if n.op_name == "cross_entropy_loss"]
    own = sum(graph.nodes[j].out.nbytes for j in loss.inputs) + loss.out.nbytes
    assert graph.fwd_bytes[loss.index] >= 2 * own and graph.bwd_bytes[loss.index] >= 3 * own
    b = _Builder(graph, parse_cluster("1:cpu"), Roles(None, False, ()), TrainSpec(), {}, None, None)
    b._batch()
    rf, rb = b.traffic(loss)
    assert (rf, rb) == (graph.fwd_bytes[loss.index] / own, graph.bwd_bytes[loss.index] / own)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_the_solver_step_of_a_plan_on_one_device_is_its_price(name):
    """Nothing to shard: the solver's step is the price's own figure, op for op (within 3%)."""
    cl = parse_cluster("1:cpu")
    plan = plan_model(MODELS[name](), lm_inputs(), cluster=cl, price_top=1)
    assert plan.estimated.step_s == pytest.approx(plan.price["step_s"], rel=0.03)


def test_tensor_parallel_copies_are_in_the_solver_step_as_priced():
    """NOTE [copies]: a sequence-parallel block gathers and scatters on the sequence dim, each with a copy of the
    gathered activation; the solver's step of the plan it returns is within 5% of its price on 1x8 H100 (it was
    12% under before the copies, the fork sums and the measured bytes), bf16 on fake tensors."""
    from treadle.models.zoo import named_model

    model, inputs = named_model("llama-3-8b", batch=1, seq=4096, fake=True, dtype=torch.bfloat16)
    plan = plan_model(model, inputs, cluster=parse_cluster("1x8:h100"), price_top=1, dp_axis=None)
    assert plan.roles.startswith("tensor")
    assert plan.estimated.step_s == pytest.approx(plan.price["step_s"], rel=0.05)
