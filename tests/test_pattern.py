"""Subgraph patterns: data-flow matching (diamond, tree, two outputs), horizontal q/k/v matches in order,
functional vs module forms, constants, absent patterns and uncapturable ones."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from treadle import Mesh, ScheduleError, create_schedule
from treadle.graph.pattern import ParamRef
from tiny_models import lm_inputs, tiny_bert

MESH1 = Mesh((1,), ("tp",))


class Host(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, *a):
        return self.body(*a)


def traced(body: nn.Module):
    sch = create_schedule(Host(body), mesh=MESH1)
    sch["body"].trace()
    return sch["body"]


# ------------------------------------------------------------------------------------------ shapes of patterns
class Diamond(nn.Module):
    """relu feeds two branches that join again; the ops are written in an order unlike the pattern's."""

    def forward(self, x):
        a = F.relu(x)
        t = torch.tanh(a)
        z = x * 3.0  # unrelated op in between
        s = torch.sigmoid(a)
        return s * t + z


def diamond(x):
    a = torch.relu(x)
    return torch.tanh(a) * torch.sigmoid(a)  # commuted product: data flow, not order


class Tree(nn.Module):
    def forward(self, x, y, z):
        return (x + y) * (y - z) + 1.0


def tree(a, b, c):
    return (a + b) * (b - c)


class TwoPath(nn.Module):
    def forward(self, x):
        h = F.relu(x)
        left = h + 1.0
        right = h * 2.0
        return left - right


def two_outputs(x):
    h = F.relu(x)
    return h + 1.0, h * 2.0


def test_diamond_matches_along_data_flow():
    sch = traced(Diamond())
    (m,) = sch.find_pattern(diamond)
    assert m.inputs["x"].name == "x"
    assert [n.name for n in m.outputs] == ["mul_1"]
    assert {n.name for n in m.nodes} == {"relu", "tanh", "sigmoid", "mul_1"}  # not the unrelated x * 3.0


def test_tree_binds_each_input_by_name():
    sch = traced(Tree())
    (m,) = sch.find_pattern(tree)
    assert {k: v.name for k, v in m.inputs.items()} == {"a": "x", "b": "y", "c": "z"}


def test_two_path_pattern_has_two_named_outputs():
    sch = traced(TwoPath())
    (m,) = sch.find_pattern(two_outputs)
    assert [o.name for o in m.outputs] == ["add", "mul"]
    assert m.spec()["outputs"] == ["add", "mul"]


# ------------------------------------------------------------------------------------------ horizontal
class QKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)
        self.v = nn.Linear(8, 8)

    def forward(self, x):
        return torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1) @ self.v(x)


def linear(x, w, b):
    return F.linear(x, w, b)


def test_horizontal_qkv_in_order_module_form():
    sch = traced(QKV())
    ms = sch.find_pattern(linear)
    assert [m.outputs[0].target for m in ms] == ["q", "k", "v"]
    assert [m.inputs["w"] for m in ms] == [ParamRef("q.weight"), ParamRef("k.weight"), ParamRef("v.weight")]
    assert all(m.inputs["x"].name == "x" for m in ms)


def test_horizontal_qkv_in_a_bert_layer_exported():
    model = tiny_bert(1)
    sch = create_schedule(model, mesh=MESH1)
    sch["bert.encoder.layer.0.attention.self"].trace(flatten=True, example_inputs=lm_inputs(2, 8))
    ms = sch["bert.encoder.layer.0.attention.self"].find_pattern(linear)
    assert [m.inputs["w"].target for m in ms] == ["query.weight", "key.weight", "value.weight"]  # aten.linear form


# ------------------------------------------------------------------------------------------ forms, constants
class ModuleRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(x * 0.5)


class MethodRelu(nn.Module):
    def forward(self, x):
        return (x * 2.0).relu()


def half_relu(x):
    return F.relu(x * 0.5)


def test_functional_pattern_matches_module_and_method_forms_with_constants():
    (m,) = traced(ModuleRelu()).find_pattern(half_relu)
    assert m.outputs[0].op == "call_module"
    assert traced(MethodRelu()).find_pattern(half_relu) == []  # x * 2.0 is not x * 0.5
    assert len(traced(MethodRelu()).find_pattern(lambda x: F.relu(x * 2.0))) == 1  # method form, right constant


def test_gelu_approximation_is_a_constant():
    class Tanh(nn.Module):
        def forward(self, x):
            return F.gelu(x, approximate="tanh")

    sch = create_schedule(Host(Tanh()), mesh=MESH1)
    sch["body"].trace()
    assert sch["body"].find_pattern(lambda x: F.gelu(x)) == []
    assert len(sch["body"].find_pattern(lambda x: F.gelu(x, approximate="tanh"))) == 1


def test_export_graph_matches_torch_level_pattern():
    """aten ops (export) and torch functions (the pattern) meet in the canonical form."""
    kw = create_schedule(KwHost(TwoPath()), mesh=MESH1)
    kw["body"].trace(example_inputs={"x": torch.randn(2, 4)})
    assert kw["body"].mod.capture_method == "export"
    (m,) = kw["body"].find_pattern(two_outputs)
    assert all(isinstance(n.target, torch._ops.OpOverload) for n in m.nodes)


class KwHost(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x)


# ------------------------------------------------------------------------------------------ absent, errors
def test_absent_pattern_finds_nothing_and_replacing_nothing_is_an_error():
    sch = traced(TwoPath())
    assert sch.find_pattern(lambda x: torch.sigmoid(x)) == []
    with pytest.raises(ScheduleError, match="no match given"):
        sch.replace_match(operator.neg, sch.find_pattern(lambda x: torch.sigmoid(x)))


def test_uncapturable_pattern_is_an_error():
    def branchy(x):
        if x.sum() > 0:
            return F.relu(x)
        return x

    with pytest.raises(ScheduleError, match=r"pattern .*branchy.* cannot be captured by torch.fx"):
        traced(TwoPath()).find_pattern(branchy)
    with pytest.raises(ScheduleError, match="computes nothing"):
        traced(TwoPath()).find_pattern(lambda x: x)


def test_find_needs_a_traced_module():
    sch = create_schedule(Host(TwoPath()), mesh=MESH1)
    with pytest.raises(ScheduleError, match=r"find at sch\['body'\]: TwoPath is not traced"):
        sch["body"].find_pattern(two_outputs)


def test_match_with_outside_users_of_an_inner_node_is_offered_with_them_named():
    class Leaky(nn.Module):
        def forward(self, x):
            h = F.relu(x)
            return torch.tanh(h) + h  # h is used outside tanh(relu(x)): it stays for that reader

    (m,) = traced(Leaky()).find_pattern(lambda x: torch.tanh(F.relu(x)))
    assert [n.name for n in m.shared] == ["relu"]
