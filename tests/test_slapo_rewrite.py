"""Slapo parity, rewrites: `decompose` and `replace(new, match)` carry the hooks of the leaves they remove
where the meaning is kept, and refuse (naming the leaf and what is recorded on it) where it would be lost."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slapo_models import Net

import treadle
from treadle import Mesh, Replicate, ScheduleError, create_schedule

MESH2 = Mesh((2,), ("tp",))


def bias_gelu(x, bias):
    return F.gelu(x + bias)


def fused_bias_gelu(x, bias):
    return F.gelu(x + bias)


def _hooked(model):
    model.mlp.fc1.register_forward_pre_hook(lambda m, a: (a[0] * 2,))
    model.mlp.fc1.register_forward_hook(lambda m, a, out: out + a[0].sum(-1, keepdim=True))
    return model


def test_decompose_keeps_forward_pre_hooks_and_forward_hooks():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ref_model = _hooked(Net())
    ref = ref_model(x)
    ref.sum().backward()
    ref_grad = x.grad.clone()
    x.grad = None
    sch = create_schedule(_hooked(Net()), mesh=Mesh((1,), ("tp",)))
    sch["mlp"].trace()
    sch["mlp.fc1"].decompose()
    assert "fc1" not in [n.target for n in sch["mlp"].graph.nodes if n.op == "call_module"]
    got = sch.model(x)
    got.sum().backward()
    torch.testing.assert_close(got, ref)  # both hooks still run around matmul + bias
    torch.testing.assert_close(x.grad, ref_grad)
    for (n, p), (_, q) in zip(ref_model.named_parameters(), sch.model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=n)


def test_decompose_refuses_what_its_loose_ops_cannot_carry():
    sch = create_schedule(Net(), mesh=MESH2)
    sch["mlp"].trace()
    sch["mlp.fc1"].shard(["weight", "bias"], dim=0, axis="tp").sync("fwd_post", to=Replicate(), axis="tp")
    with pytest.raises(ScheduleError, match=r"decompose at 'mlp.fc1': the leaf has sync fwd_post to=\[Replicate\(\)\] "
                                            r".*apply them to its parent module"):
        sch["mlp.fc1"].decompose()
    sch = create_schedule(Net(), mesh=MESH2)
    sch["mlp"].trace()
    sch["mlp.fc1"].mod.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(ScheduleError, match=r"decompose at 'mlp.fc1': the leaf has backward hooks, "):
        sch["mlp.fc1"].decompose()
    sch = create_schedule(Net(), mesh=MESH2)
    sch["mlp"].trace()
    sch["mlp.fc1"].checkpoint()
    with pytest.raises(ScheduleError, match=r"the leaf has checkpoint, "):
        sch["mlp.fc1"].decompose()


def test_decompose_keeps_a_slapo_column_parallel_gradient_sync():
    sch = create_schedule(Net(), mesh=MESH2)
    sch["mlp"].trace()
    sch["mlp.fc1"].shard(["weight", "bias"], dim=0, axis="tp").sync("bwd_post", op="all_reduce", axis="tp")
    sch["mlp.fc2"].shard("weight", dim=1, axis="tp").sync("fwd_post", op="all_reduce", axis="tp")
    sch["mlp.fc1"].decompose()  # the input-gradient all-reduce is the one build puts where fc1's input was
    treadle.verify(sch, {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(2))})


def linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b))


class LinearGelu(nn.Module):
    def forward(self, x, w, b):
        return F.gelu(F.linear(x, w, b))


@pytest.mark.parametrize("what", ["shard", "hook"])
def test_replace_match_refuses_to_drop_primitives_and_hooks_of_matched_leaves(what):
    # carrying them where the meaning is kept: tests/test_slapo_rewrite2.py
    sch = create_schedule(Net(), mesh=MESH2)
    sch["mlp"].trace()
    (m,) = sch["mlp"].find_pattern(linear_gelu)
    assert [n.target for n in m.nodes if n.op == "call_module"] == ["fc1"]
    if what == "shard":
        sch["mlp.fc1"].shard(["weight", "bias"], dim=0, axis="tp")
        found = "shard weight, which the replacement cannot carry: the replacement owns neither"
    else:
        sch["mlp.fc1"].mod.register_forward_hook(lambda mod, a, o: o * 2)
        found = "forward hooks, which the replacement cannot carry: the leaf's output is not a match output"
    with pytest.raises(ScheduleError, match=rf"replace_match at sch\['mlp'\]: leaf 'mlp.fc1' has {found}"):
        sch["mlp"].replace_match(LinearGelu(), m)


def test_replace_match_without_primitives_still_works():
    sch = create_schedule(Net(), mesh=Mesh((1,), ("tp",)))
    sch["mlp"].trace()
    (m,) = sch["mlp"].find_pattern(linear_gelu)
    sch["mlp"].replace_match(LinearGelu(), m)
    treadle.verify(sch, {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(2))})
