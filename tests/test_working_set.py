"""NOTE [a backward's working set] (treadle.planner.grad_live): what a node's backward holds beside the saved
activations, measured at capture, divided per strategy, and stated by the planner's MILP as the price states it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tiny_models import lm_inputs, tiny_gpt2, tiny_llama
from treadle.cost.cluster import parse_cluster
from treadle.planner.capture import capture
from treadle.planner.cost_graph import build_cost_graph
from treadle.planner.roles import Roles


def _loss_nodes(g):
    ce = next(n for n in g.nodes if n.op_name == "cross_entropy_loss")
    return ce, g.nodes[ce.inputs[0]]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_the_loss_holds_two_logits_sized_gradients_and_saves_one_shaped_like_its_input(make):
    g = capture(make(2), (), lm_inputs(4, 16))
    ce, logits = _loss_nodes(g)
    assert logits.out.dtype == torch.float32 and logits.out.shape == (64, 256)
    # its backward: the log-softmax's gradient and the logits', both (64, 256) fp32, at once; shaped like the input
    assert g.working[ce.index] == {logits.index: 2 * logits.out.nbytes}
    # it saves its log-softmax, an intermediate shaped like the logits (and a scalar: the output's)
    assert g.saved_like[ce.index][logits.index] == logits.out.nbytes
    assert g.saved[ce.index] == sum(g.saved_like[ce.index].values())


class _Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(256, 256, bias=False)
        self.fc2 = nn.Linear(256, 256, bias=False)

    def forward(self, x):
        return self.fc2(self.fc1(x)).square().mean()


def test_a_parameter_gradient_is_static_memory_not_working_set():
    torch.manual_seed(0)
    g = capture(_Wide(), (torch.randn(2, 256),))
    second = [n for n in g.nodes if n.op_name == "linear"][1]
    # its backward makes its input's gradient (2 x 256 fp32: 2 KiB) and its weight's (256 KiB), which goes to .grad;
    # a view of its weight (the transpose its input's gradient reads) allocates nothing
    assert sum(g.working[second.index].values()) == 2 * 256 * 4


def test_a_vocab_parallel_loss_keeps_and_holds_its_share():
    g = capture(tiny_llama(2), (), lm_inputs(4, 16))
    ce, logits = _loss_nodes(g)
    cl = parse_cluster("1x2:cpu")
    cg = build_cost_graph(g, cl, Roles((), False, (cl.mesh.names[1],)))
    unit = next(u for u in cg.units if ce.index in u.nodes)
    acts = {round(c.act_bytes) for c in unit.costs}
    works = {round(c.work_bytes) for c in unit.costs}
    full = logits.out.nbytes
    # replicated logits: all of the log-softmax saved and both gradients held; split over the vocab: half of each
    assert max(acts) >= full and min(acts) <= full / 2 + 64, acts
    assert max(works) == 2 * full and min(works) == full, works


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("cluster", ["1:cpu", "1x2:cpu"])
def test_the_solver_states_activations_and_transient_as_the_price_does(make, cluster):
    """Without checkpoints the peak is at the loss's backward: every activation saved, and the loss's working set.
    The solver's estimate of the plan (its choice, tensor-parallel on 1x2) against the plan's price as built."""
    from treadle.planner import plan_model

    plan = plan_model(make(4), lm_inputs(8, 64), cluster=parse_cluster(cluster), dp_axis=None, pp_axis=None,
                      price_top=1, checkpoint="none")
    est, priced = plan.estimated, plan.price
    assert est.activation_bytes == pytest.approx(priced["activation_bytes"], rel=0.01)
    assert est.transient_bytes == pytest.approx(priced["transient_bytes"], rel=0.02)
    assert est.transient_bytes > 0.05 * est.activation_bytes  # the loss's working set: not negligible here
