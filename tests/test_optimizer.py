"""NOTE [fused optimizer] and [foreach optimizer]: the runtime's AdamW takes the fused kernel whenever it can, else the
foreach kernels whenever the parameters are of one kind, else the loop."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from treadle.runtime.optimizer import adamw, foreach_ok, fused_ok


@pytest.fixture
def one_rank_mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        yield dist.device_mesh.init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_plain_parameters_take_the_fused_kernel_on_cpu():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]
    opt = adamw(params, lr=1e-3)
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    # parameter groups: the kind is read over every group
    opt = adamw([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:]}], lr=1e-3)
    assert opt.defaults["fused"] is True and len(opt.param_groups) == 2
    # an explicit choice stands
    assert adamw(params, lr=1e-3, foreach=False).defaults["foreach"] is False
    assert not adamw(params, lr=1e-3, foreach=False).defaults["fused"]
    opt = adamw(params, lr=1e-3, fused=False)
    assert not opt.defaults["fused"] and opt.defaults["foreach"] is None


def test_integer_or_no_parameters_are_not_fused():
    assert not fused_ok([]) and not fused_ok([torch.zeros(2, dtype=torch.int64)])
    assert fused_ok([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)])


def test_dtensors_alone_take_foreach_and_mixed_kinds_the_loop(one_rank_mesh):
    d = torch.nn.Parameter(distribute_tensor(torch.randn(4, 2), one_rank_mesh, [Replicate()]))
    p = torch.nn.Parameter(torch.randn(2))
    assert isinstance(d, DTensor)
    assert foreach_ok([d]) and foreach_ok([p]) and not foreach_ok([d, p])
    assert fused_ok([d]) and adamw([d], lr=1e-3).defaults["fused"] is True  # FSDP2's DTensors: fused too
    assert adamw([d], lr=1e-3, fused=False).defaults["foreach"] is None
    assert not fused_ok([d, p])
    opt = adamw([d, p], lr=1e-3)
    assert opt.defaults["foreach"] is False and not opt.defaults["fused"]
    d.grad, p.grad = torch.ones_like(d), torch.ones_like(p)
    before = d.to_local().clone()
    opt.step()  # the loop form steps a mix of kinds
    assert not torch.equal(d.to_local(), before)


def test_fused_and_loop_forms_step_alike():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    b = [torch.nn.Parameter(t.detach().clone()) for t in a]
    oa, ob = adamw(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2, foreach=False)
    for _ in range(3):
        for x, y in zip(a, b):
            g = torch.randn_like(x)
            x.grad, y.grad = g, g.clone()
        oa.step()
        ob.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)
