"""One loss convention: the planner captures the same training loss that verify / train / profile use
(`loss_fn=`, default `treadle.loss.default_loss`), so its activations and backward are the ones a
real step has."""

from __future__ import annotations

import torch
from torch import nn

from treadle.planner.capture import capture


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


def _ops(graph) -> list[str]:
    return [str(n.target).split(".")[1] for n in graph.nodes if n.kind == "op"]


def _output_op(graph) -> str:
    (out,) = graph.outputs
    return str(graph.nodes[out].target).split(".")[1]


def test_capture_ends_in_the_default_loss_when_the_model_returns_none():
    g = capture(TwoHeads(), (torch.randn(4, 8),), {})
    assert _output_op(g) == "mean" and "pow" in _ops(g)  # mean square of the first floating output


def test_capture_ends_in_the_given_loss_fn():
    g = capture(TwoHeads(), (torch.randn(4, 8),), {}, loss_fn=lambda out: out[1].sum())
    assert _output_op(g) == "sum" and "pow" not in _ops(g)


def test_plan_model_passes_loss_fn_to_capture_and_price():
    from treadle.cost.cluster import parse_cluster
    from treadle.planner import plan_model

    seen = []

    def loss(out):
        seen.append(type(out).__name__)
        return out[1].sum()

    plan = plan_model(TwoHeads(), {"x": torch.randn(4, 8)}, cluster=parse_cluster("2:cpu"), loss_fn=loss)
    assert seen  # capture called it
    n = len(seen)
    plan.estimate()  # price replays one step with the same loss
    assert len(seen) > n
