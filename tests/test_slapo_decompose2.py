"""Slapo parity, `decompose` carries more: explicit syncs of the leaf move to identities at its input / output
(`SyncBoundary`), so a column-parallel leaf whose output is gathered decomposes and still matches the
single-process model (treadle.verify at world 2: outputs, input gradients, every parameter gradient); a typed
sync, which reads the leaf's layout, is refused with a hint."""

import pytest
import torch

from slapo_models import Net

import treadle
from treadle import Mesh, Replicate, ScheduleError, create_schedule

MESH2 = Mesh((2,), ("tp",))


@pytest.mark.slow
def test_decompose_moves_explicit_syncs_to_the_leaf_boundary():
    sch = create_schedule(Net(), mesh=MESH2)
    sch["mlp"].trace()
    fc1 = sch["mlp.fc1"]
    fc1.shard(["weight", "bias"], dim=0, axis="tp")
    fc1.sync("bwd_post", op="all_reduce", axis="tp")  # Slapo's recipe: build's reduction at the input, once
    fc1.sync("fwd_post", op="all_gather", dim=-1, axis="tp")
    fc1.decompose()
    syncs = [(s.path, s.mode) for s in sch._state.syncs]
    assert syncs == [("mlp.fc1", "bwd_post"), ("mlp.fc1_sync_out_0", "fwd_post")]
    kinds = [n.target for n in sch["mlp"].graph.nodes if n.op == "call_module"]
    assert kinds == ["fc1_sync_out_0", "fc2"]
    treadle.verify(sch, {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(2))})


def test_decompose_refuses_a_typed_sync_with_a_hint():
    sch = create_schedule(Net(), mesh=MESH2)
    sch["mlp"].trace()
    sch["mlp.fc1"].shard(["weight", "bias"], dim=0, axis="tp").sync("fwd_post", to=Replicate(), axis="tp")
    with pytest.raises(ScheduleError, match=r"decompose at 'mlp.fc1': the leaf has sync fwd_post to=\[Replicate\(\)\] "
                                            r"\(a typed sync reads the leaf's layout; state it with op=\)"):
        sch["mlp.fc1"].decompose()
