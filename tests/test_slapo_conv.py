"""Slapo parity, convolutions: channel-parallel Conv2d (output channels, then input channels) around a
channel-sharded BatchNorm2d with running statistics, against the single-process model on 2 and 4 gloo ranks:
outputs, input gradients, every parameter gradient and the running statistics."""

import pytest
import torch
from torch import nn

import treadle
from treadle import Mesh, Replicate, create_schedule, testing
from treadle.errors import BuildError
from treadle.runtime.params import assemble


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1, bias=False)

    def forward(self, x):
        return self.conv2(torch.relu(self.bn(self.conv1(x))))


def schedule(sch):
    sch["conv1"].shard(["weight", "bias"], dim=0, axis="tp")  # output channels: Shard(1) activations
    sch["bn"].shard(["weight", "bias"], dim=0, axis="tp")  # per-channel statistics on the local channels
    sch["conv2"].shard("weight", dim=1, axis="tp").sync("fwd_post", to=Replicate(), axis="tp")  # input channels
    return sch


def _x():
    return torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))


def _run(rank, world):
    sch = schedule(create_schedule(CNN(), mesh=Mesh((world,), ("tp",))))
    built = treadle.build(sch)
    x = _x().requires_grad_()
    y = built(x)
    (y * y).sum().backward()
    bn = built.bn
    return y.detach(), x.grad, {n: p.grad for n, p in built.named_parameters()}, (bn.running_mean, bn.running_var)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_channel_parallel_conv2d_and_batchnorm(world):
    ref_model = CNN()
    x = _x().requires_grad_()
    y_ref = ref_model(x)
    (y_ref * y_ref).sum().backward()
    sch = schedule(create_schedule(CNN(), mesh=Mesh((world,), ("tp",))))
    layouts = {n: sch._state.param_shards.get(id(p)) for n, p in sch.model.named_parameters()}
    res = testing.spawn(_run, world, timeout_s=120)
    for y, gx, _, _ in res:
        torch.testing.assert_close(y, y_ref.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gx, x.grad, atol=1e-5, rtol=1e-5)
    for name, p in ref_model.named_parameters():
        got = {(r,): out[2][name] for r, out in enumerate(res)}
        full = assemble(got, layouts[name], ("tp",), {"tp": world}) if layouts[name] else got[(0,)]
        torch.testing.assert_close(full, p.grad, atol=1e-5, rtol=1e-5, msg=name)
    mean = torch.cat([out[3][0] for out in res])
    var = torch.cat([out[3][1] for out in res])
    torch.testing.assert_close(mean, ref_model.bn.running_mean)
    torch.testing.assert_close(var, ref_model.bn.running_var)


def _errors(rank, world):
    out = []
    for apply in (lambda s: s["conv1"].shard("weight", dim=1, axis="tp"),  # input channels 3: not divisible
                  lambda s: s["conv1"].shard("weight", dim=0, axis="tp"),  # bias left whole
                  lambda s: s["bn"].shard("weight", dim=0, axis="tp"),  # bias left whole
                  ):
        sch = create_schedule(CNN(), mesh=Mesh((world,), ("tp",)))
        try:
            apply(sch)
            treadle.build(sch)
            out.append(None)
        except (BuildError, treadle.ScheduleError) as exc:
            out.append(str(exc))
    return out


def test_conv2d_layouts_that_cannot_work_are_refused():
    not_div, no_bias, bn = testing.spawn(_errors, 2, timeout_s=60)[0]
    assert "dim 1 has size 3, not divisible" in not_div
    assert "'conv1' weight is split on its output channels over axis 'tp' but its bias is not" in no_bias
    assert "'bn': BatchNorm2d weight and bias must be split the same way" in bn
