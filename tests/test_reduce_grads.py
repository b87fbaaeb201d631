"""NOTE [one all-reduce per module] in runtime/build.py: `reduce_grads` sums a module's replicated parameters'
gradients over the axis in one flat all-reduce; the gradients equal the single-process ones."""

import torch
import torch.distributed as dist
from torch import nn

import treadle
from treadle import Mesh, testing
from treadle.runtime.collectives import grad_all_reduce_many


class Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.scale = nn.Parameter(torch.ones(8))  # a second direct parameter, read by another op

    def forward(self, x):
        return self.ln(x) * self.scale


def _sharded_rows(rank, world):
    torch.manual_seed(0)
    model = Norms()
    x = torch.randn(4, 8)
    model(x).square().sum().backward()  # single process, every row
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    sch = treadle.create_schedule(model, mesh=Mesh((world,), ("tp",)))
    sch["ln"].reduce_grads(axis="tp")  # weight and bias: one all-reduce
    sch.reduce_grads(axis="tp", names=["scale"])
    built = treadle.build(sch)
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: (calls.append(t.numel()), real(t, *a, **k))[1]
    try:
        built(x.chunk(world)[rank]).square().sum().backward()  # this rank's rows only
    finally:
        dist.all_reduce = real
    got = {n: p.grad.clone() for n, p in built.named_parameters()}
    return want, got, calls


def test_a_modules_parameter_gradients_are_summed_in_one_all_reduce():
    for want, got, calls in testing.spawn(_sharded_rows, 2, timeout_s=60):
        assert want.keys() == got.keys()
        for n in want:
            torch.testing.assert_close(got[n], want[n], msg=n)
        assert sorted(calls) == [8, 16]  # ln.weight + ln.bias flat (16 elements), scale alone (8)


def test_tensors_without_a_gradient_pass_through():
    a, b = torch.ones(3, requires_grad=True), torch.zeros(2)
    out = grad_all_reduce_many([a, b], group=None)
    assert out[1] is b and out[0].requires_grad and torch.equal(out[0], a)
