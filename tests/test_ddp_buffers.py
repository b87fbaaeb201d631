"""NOTE [DDP buffers] in treadle.forms.data.facts: DDP broadcasts the model's buffers at the start of every forward;
`price` and the planner's cost graph charge that broadcast, on the critical path, once per step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import treadle
from treadle import Mesh
from treadle.cost import collective_cost as cc
from treadle.cost.cluster import ClusterSpec
from treadle.planner.capture import capture
from treadle.planner.cost_graph import Roles, build_cost_graph
from treadle.pricing import price
from treadle.profile.memory import buffer_bytes
from treadle.forms.data.plan import terms as dp_terms


class Scaled(nn.Module):
    """Two linears and a buffer the forward reads (as LLaMA's rotary `inv_freq`), plus one it never reads."""

    def __init__(self, d: int = 16, buffers: bool = True):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        if buffers:
            self.register_buffer("scale", torch.full((d,), 0.5), persistent=False)
            self.register_buffer("unused", torch.zeros(4))

    def forward(self, x):
        h = self.a(x)
        if hasattr(self, "scale"):
            h = h * self.scale
        return self.b(h).pow(2).mean()


def _cluster():
    return ClusterSpec.uniform(Mesh((2,), ("dp",)), "loopback", device="cpu").with_ranks(threads_per_rank=1,
                                                                                         cores_per_host=2)


@pytest.mark.parametrize("buffers", [True, False])
def test_price_charges_one_blocking_broadcast_of_every_buffer_per_step(buffers):
    torch.manual_seed(0)
    model, x = Scaled(buffers=buffers), torch.randn(8, 16)
    sch = treadle.create_schedule(model, mesh=Mesh((2,), ("dp",)))
    sch.data_parallel(axis="dp")
    cl = _cluster()
    p = price(sch, {"x": x}, cl)
    casts = [c for c in p.collectives if c["kind"] == "broadcast"]
    if not buffers:
        assert casts == [] and buffer_bytes(model) == 0
        return
    (bc,) = casts
    assert bc["nbytes"] == buffer_bytes(model) == (16 + 4) * 4  # every buffer, read or not, as DDP does
    assert bc["source"] == "ddp" and bc["phase"] == "fwd" and bc["blocking"]
    assert bc["time_s"] == pytest.approx(cc.broadcast_time_s(80, 2, cl.link("dp")))
    assert bc["start_s"] == pytest.approx(0.0)  # before the forward's first op
    assert bc["exposed_s"] == pytest.approx(bc["time_s"])  # the forward waits for it


def test_cost_graph_charges_the_same_broadcast_under_ddp_only():
    model, x = Scaled(), torch.randn(8, 16)
    g = capture(model, (x,))
    assert g.buffer_bytes == 80
    cl = _cluster()
    ddp = build_cost_graph(g, cl, Roles(("dp",), False, (), ()))
    assert dp_terms(ddp).buffer_s == pytest.approx(cc.broadcast_time_s(80, 2, cl.link("dp")))
    zero = build_cost_graph(g, cl, Roles(("dp",), True, (), ()))
    assert dp_terms(zero).buffer_s == 0.0  # FSDP2 broadcasts nothing per step
    none = build_cost_graph(capture(Scaled(buffers=False), (x,)), cl, Roles(("dp",), False, (), ()))
    assert dp_terms(none).buffer_s == 0.0


def test_plan_estimate_includes_the_broadcast_and_equals_the_price():
    from treadle.planner import plan_model

    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(8, 16)
    cl = _cluster()
    plan = plan_model(model, {"x": x}, cluster=cl, dp_axis="dp", zero=False)
    assert [d.op for d in plan.decisions] == ["data_parallel"] and not plan.decisions[0].args.get("shard")
    p = price(plan.schedule, {"x": x}, cl)
    assert plan.estimate().step_s == pytest.approx(p.step_s, rel=1e-6)
    assert any(c["kind"] == "broadcast" for c in p.collectives)
