"""Slapo parity, patterns: a match whose inner values have readers outside it is offered (those readers keep
their value after a rewrite), diamonds and trees among unrelated ops, and module-path regex patterns
(`module_call`, Slapo's call_module patterns) beside function patterns."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from treadle import Mesh, ScheduleError, create_schedule
from treadle.graph.pattern import module_call

MESH1 = Mesh((1,), ("tp",))


class Host(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, *a):
        return self.body(*a)


class DiamondWithReader(nn.Module):
    def forward(self, m, n):
        a = m + n
        out = a * 2 + a * 3
        return out, a * 5  # an unrelated reader of the inner value a


def diamond(m, n):
    a = m + n
    return a * 2 + a * 3


class TreeWithReader(nn.Module):
    def forward(self, x, y, z):
        left = x * y
        return left * 2 + (y - z) * 3, torch.tanh(left)


def tree(a, b, c):
    return a * b * 2 + (b - c) * 3


def fused_diamond(m, n):
    return (m + n) * 5


def fused_tree(a, b, c):
    return a * b * 2 + (b - c) * 3


def _inputs(k):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, generator=g) for _ in range(k)]


@pytest.mark.parametrize("body, pattern, new, n_in, shared", [
    (DiamondWithReader, diamond, fused_diamond, 2, ["add"]),
    (TreeWithReader, tree, fused_tree, 3, ["mul"]),
])
def test_matches_with_outside_readers_are_offered_and_rewrites_keep_them(body, pattern, new, n_in, shared):
    xs = _inputs(n_in)
    ref = body()(*xs)
    sch = create_schedule(Host(body()), mesh=MESH1)
    sch["body"].trace()
    (m,) = sch["body"].find_pattern(pattern)
    assert [n.name for n in m.shared] == shared
    sch["body"].replace_match(new, m)
    got = sch.model(*xs)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)  # the outside reader still gets the inner value
    assert any(n.op == "call_function" and n.target is new for n in sch["body"].graph.nodes)


class Dropping(nn.Module):
    def forward(self, x):
        h = F.dropout(x, 0.5, True)
        return torch.tanh(h), h * 2


def test_a_random_inner_value_read_outside_is_not_offered():
    sch = create_schedule(Host(Dropping()), mesh=MESH1)
    sch["body"].trace()
    assert sch["body"].find_pattern(lambda x: torch.tanh(F.dropout(x, 0.5, True))) == []


class Projections(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.proj = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(F.gelu(self.fc1(x)) + F.gelu(self.fc2(x)))


def test_module_path_regex_patterns():
    sch = create_schedule(Host(Projections()), mesh=MESH1)
    sch["body"].trace()
    found = sch["body"].find_pattern(lambda x: F.gelu(module_call(r"fc\d", x)))
    assert [[n.target for n in m.nodes if n.op == "call_module"] for m in found] == [["fc1"], ["fc2"]]
    assert sch["body"].find_pattern(lambda x: F.gelu(module_call(r"proj", x))) == []  # proj is not under a gelu
    (only,) = sch["body"].find_pattern(lambda x: module_call(r"pro.", x))
    assert only.nodes[0].target == "proj"
    with pytest.raises(ScheduleError, match="module_call\\(...\\) is a pattern element"):
        module_call("fc1", torch.ones(1))
    with pytest.raises(ScheduleError, match="is not a regular expression"):
        sch["body"].find_pattern(lambda x: module_call("fc(", x))
