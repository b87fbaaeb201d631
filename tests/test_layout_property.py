"""Every legal layout of a sharded leaf builds and verifies: random layouts drawn per parameter and per mesh
axis (column / row / vocab / embedding-dim splits, with and without bias, data split on the other axes with
gradient reductions), random output layouts at the leaf's exit (one multi-axis sync or one per axis), and a
consumer that brings everything back to Replicate. Linear, transformers' Conv1D (GPT-2), Embedding,
LayerNorm and RMSNorm; 1-D meshes of 2 and 4 ranks and a 2x2 mesh. Seeded, a fixed number of draws.

Each draw is one model holding one branch per leaf kind, checked by `treadle.verify` against the
single-process model (outputs, every gradient, an optimizer step)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from transformers.pytorch_utils import Conv1D

import treadle
from treadle import Mesh

B, T, H, V = 4, 4, 8, 16  # batch, sequence, hidden, vocab: every split below divides on up to 4 ranks


class Branch(nn.Module):
    """``post(leaf(x))``; `post` is where the test brings the leaf's output back to Replicate."""

    def __init__(self, leaf: nn.Module, takes_ids: bool):
        super().__init__()
        self.leaf = leaf
        self.post = nn.Identity()
        self.takes_ids = takes_ids

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.post(self.leaf(ids if self.takes_ids else x))


class Branches(nn.Module):
    def __init__(self, leaves: list[tuple[nn.Module, bool]]):
        super().__init__()
        self.b = nn.ModuleList(Branch(m, ids) for m, ids in leaves)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # x (B, T, H), ids (B, T) -> (B, T, H)
        return sum(b(x, ids) for b in self.b)


def _leaves(rng: random.Random) -> list[tuple[str, nn.Module, bool]]:
    return [
        ("linear", nn.Linear(H, H, bias=True), False),
        ("linear", nn.Linear(H, H, bias=False), False),
        ("linear", nn.Linear(H, H, bias=rng.random() < 0.5), False),
        ("conv1d", Conv1D(H, H), False),
        ("embedding", nn.Embedding(V, H), True),
        ("norm", nn.LayerNorm(H), False),
        ("norm", nn.RMSNorm(H), False),
    ]


def _draw_leaf(rng: random.Random, kind: str, leaf: nn.Module, mesh: Mesh) -> dict:
    """One legal layout: per axis a role, the leaf's output layout and the exit layout (before `post`)."""
    roles: dict[str, str] = {}
    inner_taken = False  # a contraction (or vocab) dim is split over one axis at most
    for ax in mesh.names:
        opts = ["R", "data0", "data1"]
        if kind in ("linear", "conv1d"):
            opts += ["col"] + ([] if inner_taken else ["row"])
        elif kind == "embedding":
            opts += ["dim"] + ([] if inner_taken else ["vocab"])
        role = rng.choice(opts)
        inner_taken |= role in ("row", "vocab")
        roles[ax] = role
    out = {}
    for ax, role in roles.items():
        out[ax] = {"R": Replicate(), "data0": Shard(0), "data1": Shard(1), "col": Shard(2), "dim": Shard(2),
                   "row": Partial(), "vocab": Partial()}[role]
    exit_ = {}
    for ax, p in out.items():
        if isinstance(p, Partial):
            exit_[ax] = rng.choice([Partial(), Replicate(), Shard(2), Shard(1)])
        elif isinstance(p, Shard):
            exit_[ax] = rng.choice([p, Replicate()])
        else:
            exit_[ax] = p
    return {"roles": roles, "out": out, "exit": exit_, "list_sync": rng.random() < 0.5,
            "give_from": rng.random() < 0.5}


def _apply(sch, path: str, kind: str, leaf: nn.Module, d: dict) -> None:
    s = sch[f"{path}.leaf"]
    has_bias = getattr(leaf, "bias", None) is not None
    col_dim, row_dim = (0, 1) if kind == "linear" else (1, 0)  # Linear W (out, in); Conv1D W (in, out)
    sharded = False
    for ax, role in d["roles"].items():
        if role == "col":
            s.shard("weight", dim=col_dim, axis=ax)
            if has_bias:
                s.shard("bias", dim=0, axis=ax)
        elif role == "row":
            s.shard("weight", dim=row_dim, axis=ax)
            s.sync("fwd_pre", to=Shard(-1), axis=ax)
        elif role == "vocab":
            s.shard("weight", dim=0, axis=ax)
        elif role == "dim":
            s.shard("weight", dim=1, axis=ax)
        elif role.startswith("data"):
            s.sync("fwd_pre", to=Shard(int(role[-1])), axis=ax)
            s.reduce_grads(axis=ax)
        sharded |= role in ("col", "row", "vocab", "dim")
    names = list(d["roles"])
    changed = [ax for ax in names if d["exit"][ax] != d["out"][ax]]
    need_from = not sharded or d["give_from"]  # only a sharded leaf's output layout is derived
    if changed and d["list_sync"]:
        kw = {"from_": [d["out"][ax] for ax in names]} if need_from else {}
        s.sync("fwd_post", to=[d["exit"][ax] if ax in changed else d["out"][ax] for ax in names], **kw)
    else:
        for ax in changed:
            kw = {"from_": d["out"][ax]} if need_from else {}
            s.sync("fwd_post", to=d["exit"][ax], axis=ax, **kw)
    if any(not isinstance(p, Replicate) for p in d["exit"].values()):
        sch[f"{path}.post"].sync("fwd_pre", from_=[d["exit"][ax] for ax in names],
                                 to=[Replicate() for _ in names])


def _draw(seed: int, mesh: Mesh):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    leaves = _leaves(rng)
    model = Branches([(m, kind == "embedding") for kind, m, _ in leaves])
    for m in model.modules():  # norms start at ones / zeros: perturb so their gradients mean something
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.1 * torch.randn_like(p))
    sch = treadle.create_schedule(model, mesh=mesh)
    drawn = []
    for i, (kind, leaf, _) in enumerate(leaves):
        d = _draw_leaf(rng, kind, leaf, mesh)
        _apply(sch, f"b.{i}", kind, model.b[i].leaf, d)
        drawn.append((kind, {ax: r for ax, r in d["roles"].items()}, d["exit"]))
    inputs = {"x": torch.randn(B, T, H), "ids": torch.randint(0, V, (B, T))}
    return sch, inputs, drawn


MESHES = {"2": Mesh((2,), ("a",)), "4": Mesh((4,), ("a",)), "2x2": Mesh((2, 2), ("a", "b"))}
DRAWS = [("2", 0), ("4", 1), ("2x2", 2), ("2x2", 3), ("2x2", 4)]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name,seed", DRAWS, ids=[f"{m}-seed{s}" for m, s in DRAWS])
def test_random_legal_layouts_build_and_verify(mesh_name, seed):
    sch, inputs, drawn = _draw(seed, MESHES[mesh_name])
    report = treadle.verify(sch, inputs, steps=1, raise_on_mismatch=False, timeout_s=120)
    assert report.ok, f"layouts {drawn}:\n{report.summary()}"
    assert len([c for c in report.checks if c.kind == "param_grad"]) == len(list(sch.model.parameters()))


def test_draws_cover_every_role_and_the_planner_crash_layout():
    """The seeded draws above include each role on each leaf kind, and the layout that crashed: a weight split
    on its output dim over one axis and on its input dim over the other, with a bias, gathered at the exit."""
    seen: set[tuple[str, str]] = set()
    crash = False
    for mesh_name, seed in DRAWS:
        _, _, drawn = _draw(seed, MESHES[mesh_name])
        for kind, roles, exit_ in drawn:
            seen |= {(kind, r) for r in roles.values()}
            col = [ax for ax, r in roles.items() if r == "col"]
            crash |= bool(col) and "row" in roles.values() and any(exit_[ax] == Replicate() for ax in col)
    for kind in ("linear", "conv1d"):
        assert {(kind, r) for r in ("R", "col", "row")} <= seen, sorted(seen)
    assert {("embedding", "vocab"), ("embedding", "dim"), ("norm", "data0"), ("norm", "data1")} <= seen
    assert crash
