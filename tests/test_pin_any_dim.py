"""A planner pin may say "sharded over this axis, on whichever dim the solver picks" (value "S"): what the
Megatron recipe pins on every Linear of the blocks when it runs as a constrained plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from treadle import Mesh
from treadle.cost.cluster import ClusterSpec
from treadle.errors import PlanError
from treadle.placement import ANY_SHARD, P, R, pin_holds
from treadle.planner import plan_model


def test_any_shard_holds_for_a_shard_only():
    assert pin_holds((0,), (ANY_SHARD,)) and pin_holds((1, R), (ANY_SHARD, R))
    assert not pin_holds((R,), (ANY_SHARD,)) and not pin_holds((P,), (ANY_SHARD,))
    assert not pin_holds((0, 0), (ANY_SHARD, R))


class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_a_pin_S_lets_the_solver_pick_the_dim_and_names_a_data_parallel_axis_as_at_fault():
    cluster = ClusterSpec.uniform(Mesh((2,), ("tp",)), "loopback")
    inputs = {"x": torch.randn(4, 8)}
    plan = plan_model(_Chain(), inputs, cluster=cluster, dp_axis=None, pp_axis=None, checkpoint="none",
                      pins={"*.weight": {"tp": "S"}})
    dims = {d.path: d.args["dim"] for d in plan.decisions if d.op == "shard" and d.args["names"] == "weight"}
    assert dims == {"up": 0, "down": 1}  # column then row: one all-reduce, the cheapest pair
    with pytest.raises(PlanError, match=r"pin 'up.weight' shards a dim over axis 'tp', but dp_axis='tp' gives it "
                                        r"to data parallelism"):
        plan_model(_Chain(), inputs, cluster=cluster, dp_axis="tp", pins={"up.weight": {"tp": "S"}})
