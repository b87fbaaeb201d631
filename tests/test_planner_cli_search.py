"""Planner from the CLI: mesh search, the default precision per device, pins that cannot hold, and explain's
per-module billing."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from treadle.cost.cluster import ClusterSpec
from treadle.errors import PlanError
from treadle.mesh import Mesh
from treadle.planner import plan_model
from treadle.profile.roofline import op_time_s


def _fake(*shape):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.randn(*shape)


class TanhGELU(nn.Module):
    """GPT-2's tanh GELU written out in elementwise ops (as transformers' NewGELUActivation)."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))


class MLPBlock(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.fc = nn.Linear(h, 4 * h)
        self.act = TanhGELU()
        self.proj = nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.proj(self.act(self.fc(x)))


class MLPStack(nn.Module):
    def __init__(self, h: int, n: int):
        super().__init__()
        self.blocks = nn.ModuleList([MLPBlock(h) for _ in range(n)])
        self.head = nn.Linear(h, h)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


# ----------------------------------------------------------------------------- explain billing
def test_explain_bills_merged_ops_to_their_own_module():
    """The activation's elementwise ops follow fc's strategy (merged into fc's decision unit); explain must
    still bill them to `blocks.0.act`, not to `blocks.0.fc`."""
    model = MLPStack(256, 2)
    cl = ClusterSpec.uniform(Mesh((2,), ("tp",)), "nvlink4", device="h100-sxm")
    pins = {"blocks.*.fc.weight": {"tp": 0}, "blocks.*.fc.bias": {"tp": 0}, "blocks.*.proj.weight": {"tp": 1}}
    plan = plan_model(model, (_fake(8, 128, 256),), cluster=cl, dp_axis=None, pins=pins)
    rows = {r.path: r for r in plan.rows}
    assert "blocks.0.act" in rows and rows["blocks.0.act"].compute_s > 0
    # fc's row holds fc's ops alone: the same as in the model whose activation is an identity
    bare = MLPStack(256, 2)
    for b in bare.blocks:
        b.act = nn.Identity()
    plan_bare = plan_model(bare, (_fake(8, 128, 256),), cluster=cl, dp_axis=None, pins=pins)
    fc_alone = {r.path: r for r in plan_bare.rows}["blocks.0.fc"]
    # ... and the sums of its output's gradients, which three ops of the activation read (NOTE [gradient sums at
    # a fork]): two adds of its local (8, 128, 1024 / 2) fp32 gradient
    hw, elems = cl.rank_hardware(), 8 * 128 * 1024 // 2
    forks = 2 * op_time_s(0, 3 * 4 * elems, hw, torch.float32, op="add", elems=elems)
    assert math.isclose(rows["blocks.0.fc"].compute_s, fc_alone.compute_s + forks, rel_tol=1e-9)
    # nothing is lost or counted twice: the rows add up to the solver's compute
    assert math.isclose(sum(r.compute_s for r in plan.rows), plan.estimated.compute_s, rel_tol=1e-9)


# ----------------------------------------------------------------------------- pins that cannot hold
class NormMLP(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 2 * h)
        self.proj = nn.Linear(2 * h, h)

    def forward(self, x):
        return x + self.proj(torch.relu(self.fc(self.ln(x))))


class Scale(nn.Module):
    """A parameter used by plain ops: the runtime has no sharded-compute rule for this module."""

    def __init__(self, h: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        return x * self.weight


TP2 = ClusterSpec.uniform(Mesh((2,), ("tp",)), "nvlink4", device="h100-sxm")


def test_pin_blocked_by_a_producer_names_pin_and_op():
    model = nn.Sequential(nn.Linear(64, 64), NormMLP(64))
    x = _fake(4, 8, 64)
    with pytest.raises(PlanError) as info:
        plan_model(model, (x,), cluster=TP2, dp_axis=None, pins={"1.fc.weight": {"tp": 1}})
    msg = str(info.value)
    assert "pin '1.fc.weight' (axis 'tp': Shard(1)) cannot hold" in msg
    assert "1.fc (linear" in msg and "only as tp:S(2)" in msg
    assert "producer 1.ln (layer_norm" in msg and "never publishes" in msg
    assert "smallest budget" not in msg
    # two pins, one of which holds alone: only the culprit is named
    with pytest.raises(PlanError, match=r"^pin '1\.fc\.weight' \(axis 'tp': Shard\(1\)\) cannot hold: "):
        plan_model(model, (x,), cluster=TP2, dp_axis=None,
                   pins={"1.proj.weight": {"tp": 1}, "1.fc.weight": {"tp": 1}})


def test_pin_on_user_input_no_leaf_rule_and_uneven_size():
    x = _fake(4, 8, 64)
    with pytest.raises(PlanError, match=r"pin '0\.weight' \(axis 'tp': Shard\(1\)\) cannot hold: .*0 \(linear, node "
                                        r"linear\) would read input 'args_0' as tp:S\(2\), and user inputs"):
        plan_model(nn.Sequential(nn.Linear(64, 64)), (x,), cluster=TP2, dp_axis=None, pins={"0.weight": {"tp": 1}})
    with pytest.raises(PlanError, match=r"pin '1\.weight' \(axis 'tp': Shard\(0\)\) cannot hold: .*no sharded-compute "
                                        r"rule for module '1' \(Scale\)"):
        plan_model(nn.Sequential(nn.Linear(64, 64), Scale(64)), (x,), cluster=TP2, dp_axis=None,
                   pins={"1.weight": {"tp": 0}})
    with pytest.raises(PlanError, match=r"'1\.weight' has size 31 on dim 0, which does not divide over axis 'tp' of "
                                        r"size 2 \(read by 1 \(linear"):
        plan_model(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 31)), (x,), cluster=TP2, dp_axis=None,
                   pins={"1.weight": {"tp": 0}})



class FixedHeads(nn.Module):
    """Splits into heads with sizes read from attributes that two names share (NOTE [fixed view sizes]: the
    planner cannot tell which one to divide, so the view's head dims stay whole)."""

    def __init__(self, h: int):
        super().__init__()
        self.n_heads = self.n_groups = 4
        self.head_dim = self.group_dim = h // 4
        self.fc = nn.Linear(h, h)
        self.proj = nn.Linear(h, h)

    def forward(self, x):
        b, t, _ = x.shape
        y = self.fc(x).view(b, t, self.n_heads, self.head_dim)
        return self.proj(torch.relu(y).reshape(b, t, self.n_heads * self.head_dim))


def test_pin_blocked_by_a_fixed_reshape_upstream_names_the_reshape():
    with pytest.raises(PlanError) as info:
        plan_model(FixedHeads(64), (_fake(4, 8, 64),), cluster=TP2, dp_axis=None, pins={"proj.weight": {"tp": 1}})
    msg = str(info.value)
    assert msg.startswith("pin 'proj.weight' (axis 'tp': Shard(1)) cannot hold: ")
    assert "proj (linear, node linear_1) reads 'reshape' only as tp:S(2)" in msg
    assert "the limit comes from fc (linear, node linear) -> <root> (view, node view)" in msg
    assert "<root> (view, node view) reshapes to sizes [4, 8, 4, 16]" in msg and "fixed view sizes" in msg

# ----------------------------------------------------------------------------- CLI: mesh search, precision
def test_cli_searches_meshes_in_bf16_on_a_gpu_preset(tmp_path, capsys):
    import json

    from treadle.cli import main
    from treadle.cost.cluster import parse_cluster
    from treadle.cost.links import link_preset
    from treadle.planner.meshes import search_clusters

    meshes = search_clusters(parse_cluster("8x8:h100"))
    assert [tuple(c.mesh.shape) for c in meshes] == [(64,), (8, 8), (16, 4), (32, 2)]
    assert all(c.links[-1] == link_preset("nvlink4") for c in meshes if c.mesh.ndim == 2)  # fast inner axis
    out = tmp_path / "plan.json"
    assert main(["plan", "tiny-gpt2", "--cluster", "1x4:h100", "--batch", "4", "--seq", "16", "-q",
                 "-o", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal width
    assert "meshes searched (2" in text and "dp=4" in text and "dp=2,tp=2" in text
    assert "precision: bf16 mixed" in text and "fp32 master weights and AdamW states" in text
    assert "MFU against the bf16 peak of h100-sxm" in text
    saved = json.loads(out.read_text())
    assert saved["model"]["dtype"] == "bf16" and saved["solver"]["param_dtype"] == "bfloat16"
    searched = {a["mesh"] for a in saved["solver"]["alternatives"]}
    assert searched == {"Mesh(dp=4)", "Mesh(dp=2, tp=2)"}
    best = min((a for a in saved["solver"]["alternatives"] if a["status"] != "infeasible"), key=lambda a: a["step_s"])
    assert math.isclose(saved["estimate"]["step_s"], best["step_s"], rel_tol=1e-12)  # the best one is saved
    assert saved["schedule"]["mesh"]["shape"] == [int(x) for x in best["mesh"].split("(")[1].rstrip(")").replace(
        "dp=", "").replace("tp=", "").split(", ")]


def test_cli_single_mesh_fp32_on_cpu_and_bad_mesh(tmp_path, capsys):
    import json

    from treadle.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "tiny-gpt2", "--cluster", "2x2:cpu", "--nominal", "--mesh", "2x2", "--batch", "4", "--seq",
                 "16", "-q", "-o", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "meshes searched" not in text and "precision: fp32" in text
    saved = json.loads(out.read_text())
    assert saved["model"]["dtype"] == "fp32" and saved["solver"]["param_dtype"] == "float32"
    assert {a["mesh"] for a in saved["solver"]["alternatives"]} == {"Mesh(dp=2, tp=2)"}
    assert main(["plan", "tiny-gpt2", "--cluster", "2x2:cpu", "--mesh", "3x3", "--batch", "4", "--seq", "16"]) == 2
    assert "--mesh 3x3: 3x3 = 9 devices, but the cluster has 4" in capsys.readouterr().err.replace("\n", "")
