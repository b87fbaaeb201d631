"""Slapo parity, smaller capabilities: built parameters carry their global shape (Slapo's ``orig_shape``),
`replace_all` factories receive the path and keyword arguments, and a named RNG-state tracker with a
model-parallel seed offset per rank."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import treadle
from treadle import Mesh, create_schedule, testing
from treadle.errors import BuildError, ScheduleError
from treadle.runtime.rng import MODEL_PARALLEL, RNGStatesTracker, model_parallel_seed


class MLP(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, hidden), nn.Linear(hidden, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.fc2(F.gelu(self.fc1(x))))


def _global_shapes(rank, world):
    sch = create_schedule(MLP(), mesh=Mesh((world,), ("tp",)))
    sch["fc1"].shard(["weight", "bias"], dim=0, axis="tp")
    sch["fc2"].shard("weight", dim=1, axis="tp")
    built = treadle.build(sch)
    return {n: (tuple(p.shape), p.global_shape) for n, p in built.named_parameters()}


def test_built_parameters_carry_their_global_shape():
    shapes = testing.spawn(_global_shapes, 2, timeout_s=60)[0]
    assert shapes["fc1.weight"] == ((8, 8), (16, 8))
    assert shapes["fc1.bias"] == ((8,), (16,))
    assert shapes["fc2.weight"] == ((8, 8), (8, 16))
    assert shapes["fc2.bias"] == ((8,), (8,))  # not sharded: the same
    assert shapes["norm.weight"] == ((8,), (8,))


class Scaled(nn.Module):
    def __init__(self, inner: nn.Module, scale: float):
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, x):
        return self.inner(x) * self.scale


SEEN: list[str] = []


def scale_by_path(old: nn.Module, *, path: str, scale: float) -> nn.Module:
    SEEN.append(path)
    return Scaled(old, scale if path.endswith("fc1") else 1.0)


def plain_factory(old: nn.Module) -> nn.Module:
    return Scaled(old, 1.0)


def test_replace_all_factory_receives_path_and_keyword_arguments():
    SEEN.clear()
    sch = create_schedule(MLP(), mesh=Mesh((1,), ("tp",)))
    paths = sch.replace_all(nn.Linear, scale_by_path, scale=0.5)
    assert paths == ["fc1", "fc2"] and SEEN == ["fc1", "fc2"]
    assert sch.model.fc1.scale == 0.5 and sch.model.fc2.scale == 1.0
    assert "replace_all" in sch.to_python() and "scale=0.5" in sch.to_python()
    treadle.register_ref(scale_by_path)  # a file may name only registered code (NOTE [files are data])
    again = treadle.load_schedule(MLP(), sch.to_json())  # the keyword arguments replay
    assert again.model.fc1.scale == 0.5 and SEEN == ["fc1", "fc2", "fc1", "fc2"]
    assert create_schedule(MLP(), mesh=Mesh((1,), ("tp",))).replace_all(nn.Linear, plain_factory) == ["fc1", "fc2"]
    with pytest.raises(ScheduleError, match="'path' is passed by treadle"):
        create_schedule(MLP(), mesh=Mesh((1,), ("tp",))).replace_all(nn.Linear, scale_by_path, path="x", scale=1.0)


def test_rng_tracker_streams_fork_and_restore():
    tr = RNGStatesTracker()
    torch.manual_seed(0)
    tr.add("a", 123)
    tr.add("b", 456)
    before = torch.get_rng_state()
    with tr.fork("a"):
        a1 = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched by a fork
    with tr.fork("a"):
        a2 = torch.rand(4)
    with tr.fork("b"):
        b1 = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(a1, torch.rand(4)) and torch.equal(a2, torch.rand(4))  # a continues where it stopped
    assert not torch.equal(a1, b1)
    saved = tr.get_states()
    with tr.fork("a"):
        a3 = torch.rand(4)
    tr.set_states(saved)
    with tr.fork("a"):
        assert torch.equal(torch.rand(4), a3)  # set_states rewinds
    with pytest.raises(BuildError, match="stream 'a' already exists"):
        tr.add("a", 9)
    with pytest.raises(BuildError, match="seed 456 is already used by stream 'b'"):
        tr.add("c", 456)
    with pytest.raises(BuildError, match=r"no stream 'zzz'; streams: \['a', 'b'\]"):
        with tr.fork("zzz"):
            pass
    tr.reset()
    assert tr.names() == []


def _mp_seed(rank, world):
    mesh = Mesh((2, 2), ("dp", "tp"))
    tr = model_parallel_seed(1234, mesh=mesh, axis="tp")
    shared = torch.rand(3)
    with tr.fork():
        mine = F.dropout(torch.ones(16), 0.5)
    after = torch.rand(3)
    return mesh.coordinate(rank), shared, mine, after, tr.names()


def test_model_parallel_seed_differs_along_tp_and_agrees_along_dp():
    res = testing.spawn(_mp_seed, 4, timeout_s=60)
    torch.manual_seed(1234)
    expect_shared = torch.rand(3)
    by_coord = {(c["dp"], c["tp"]): (s, m, a, names) for c, s, m, a, names in res}
    for (dp, tp), (shared, mine, after, names) in by_coord.items():
        assert names == [MODEL_PARALLEL]
        assert torch.equal(shared, expect_shared)  # default stream: the same seed everywhere
        torch.manual_seed(1234 + 2718 + tp)
        assert torch.equal(mine, F.dropout(torch.ones(16), 0.5))  # Megatron's offset per tp rank
    assert not torch.equal(by_coord[(0, 0)][1], by_coord[(0, 1)][1])  # tp ranks draw different masks
    assert torch.equal(by_coord[(0, 1)][1], by_coord[(1, 1)][1])  # dp ranks share the stream
    assert torch.equal(by_coord[(0, 0)][2], by_coord[(0, 1)][2])  # the default stream continues in step
