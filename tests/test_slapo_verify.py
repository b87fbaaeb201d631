"""Slapo parity, verify: a meta-device model verifies (the reference is materialised with the same seeded,
mesh-independent init as build), and a failed verify names the primitive nearest the first diverging tensor."""

import torch
import torch.nn.functional as F
from torch import nn

import treadle
from treadle import Mesh, Replicate, create_schedule


class Double(nn.Module):
    def forward(self, x):
        return x * 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = Double()
        self.fc2 = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.fc2(F.gelu(self.act(self.fc1(x)))))


def _inputs():
    return {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(0))}


def _tp(sch):
    sch["fc1"].shard(["weight", "bias"], dim=0, axis="tp")
    sch["fc2"].shard("weight", dim=1, axis="tp").sync("fwd_post", to=Replicate(), axis="tp")
    return sch


def test_verify_a_meta_device_model():
    with torch.device("meta"):
        model = Net()
    sch = _tp(create_schedule(model, mesh=Mesh((2,), ("tp",))))
    report = treadle.verify(sch, _inputs())
    assert report.ok and any(c.kind == "param_grad" for c in report.checks)


def test_a_failed_verify_names_the_primitive_nearest_the_first_divergence():
    torch.manual_seed(0)
    sch = _tp(create_schedule(Net(), mesh=Mesh((2,), ("tp",))))
    # a wrong statement build cannot check (Double has no known layout): the gradient of act's input is
    # already complete, so this doubles it
    sch["act"].sync("bwd_post", op="all_reduce", axis="tp")
    report = treadle.verify(sch, _inputs(), raise_on_mismatch=False)
    assert not report.ok
    assert "sch['act'].sync('bwd_post', op='all_reduce', axis='tp')" in report.first_divergence, report.first_divergence
