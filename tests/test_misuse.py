"""Misuses a new user makes, each with the error type and the message fragment that names the culprit.

One table of single-process misuses (schedule primitives, schedule files, losses, batches, planner arguments),
one multi-process run for the misuses that only show at build or in forward, and the CLI's one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import treadle
import treadle.profile
from treadle import Mesh, Replicate, Shard, testing
from treadle.errors import BuildError, PlanError, ProfileError, ScheduleError, SpawnError, TreadleError
from tiny_models import lm_inputs, tiny_gpt2

TP2 = Mesh((2,), ("tp",))
DP2TP2 = Mesh((2, 2), ("dp", "tp"))


class Two(nn.Module):
    """Linear -> Linear; returns (y, count) so `out=` has something to pick."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, x):
        return self.b(self.a(x)), 3


class NoFloat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return (self.a(x).argmax(-1),)


def _sch(mesh=TP2):
    torch.manual_seed(0)
    return treadle.create_schedule(Two(), mesh=mesh)


def _file(records, mesh=None) -> str:
    mesh = mesh or {"shape": [2], "names": ["tp"]}
    return json.dumps({"format": "treadle.schedule/1", "mesh": mesh, "records": records})


def _load(text):
    return treadle.load_schedule(Two(), text)


def _dp_after_shard():
    s = _sch(DP2TP2)
    s["a"].shard("weight", dim=0, axis="dp")
    s.data_parallel(axis="dp")


def _shard_on_dp_axis():
    s = _sch(DP2TP2)
    s.data_parallel(axis="dp")
    s["a"].shard("weight", dim=0, axis="dp")


def _verify_small_batch():
    s = _sch(DP2TP2)
    s.data_parallel(axis="dp")
    treadle.verify(s, {"x": torch.randn(1, 8)})


def _verify_uneven_batch():
    s = _sch(Mesh((4,), ("dp",)))
    s.data_parallel(axis="dp")
    treadle.verify(s, {"x": torch.randn(6, 8)})


def _train_uneven_batch():
    s = _sch(Mesh((4,), ("dp",)))
    s.data_parallel(axis="dp")
    treadle.train(s, {"x": torch.randn(6, 8)})


def _plan(**kw):
    from treadle.cost.cluster import parse_cluster
    from treadle.planner import plan_model

    args = dict(cluster=parse_cluster("2x2:cpu"), memory_budget_bytes=2**30)
    args.update(kw)
    plan_model(tiny_gpt2(), lm_inputs(), **args)


def _shell_factory():  # what a malicious file would name
    return None


MISUSES = {
    # ---- schedule files are data (NOTE [files are data])
    "file names an arbitrary callable": (
        lambda: _load(_file([{"op": "set_attr", "path": "", "args": {"*": "x", "value": {"ref": "os:system",
                                                                                      "kwargs": {}}}}])),
        ScheduleError, "names the callable 'os:system', which is not allowed"),
    "file holds a pickled module": (
        lambda: _load(_file([{"op": "replace", "path": "a", "args": {"new": {"module_pickle": "AAAA",
                                                                             "class": "Evil"}}}])),
        ScheduleError, "holds a pickled module (Evil), and unpickling runs code"),
    "file names a type from a module not imported": (
        lambda: _load(_file([{"op": "replace_all", "path": "", "args": {
            "module_type": {"type": "antigravity:Fly"}, "factory": {"ref": "treadle.x:y", "kwargs": {}}}}])),
        ScheduleError, "names the type (not a class of an imported module) 'antigravity:Fly'"),
    "file with a non-integer dim": (
        lambda: _load(_file([{"op": "shard", "path": "a", "args": {"*": "weight", "dim": "zero", "axis": "tp"}}])),
        ScheduleError, "shard at sch['a']: dim must be an integer tensor dim, got 'zero'"),
    "file with a Shard of a non-integer dim": (
        lambda: _load(_file([{"op": "sync", "path": "a", "args": {"*": "fwd_post", "to": {"placement": "Shard",
                                                                                          "dim": "zero"},
                                                                 "axis": "tp"}}])),
        ScheduleError, "Shard needs an integer dim, got 'zero'"),
    "corrupt file": (lambda: treadle.load_schedule(Two(), "{oops", source="s.json"), ScheduleError,
                     "s.json does not parse"),
    "file missing fields": (lambda: treadle.load_schedule(Two(), _file([{"op": "shard"}]), source="s.json"),
                            ScheduleError, "s.json is malformed: missing or wrong field"),
    # ---- schedule primitives
    "data_parallel on an axis that shards parameters": (
        _dp_after_shard, ScheduleError, "mesh axis 'dp' already shards parameters ['a.weight']"),
    "shard on the data-parallel axis": (
        _shard_on_dp_axis, ScheduleError, "mesh axis 'dp' is the data-parallel axis"),
    "one dim split over two axes against mesh order": (
        lambda: _sch(Mesh((2, 2), ("a", "b")))["a"].shard("weight", dim=0, axis="b").shard("weight", dim=0, axis="a"),
        ScheduleError, "split a dim over several axes in mesh-axis order ['a', 'b'] (shard on 'a' first"),
    "checkpoint a ModuleList": (lambda: _sch()["blocks"].checkpoint(), ScheduleError,
                                "a ModuleList has no forward to recompute; checkpoint its items, e.g. sch['blocks.0']"),
    "sync out= negative": (lambda: _sch()["a"].sync("fwd_post", to=Replicate(), axis="tp", out=-1), ScheduleError,
                           "out= must be an output index >= 0, got -1"),
    "sync out= on an input": (lambda: _sch()["a"].sync("fwd_pre", to=Replicate(), axis="tp", out=1), ScheduleError,
                              "out= picks an output, so it needs mode 'fwd_post'"),
    "sync op with a non-integer dim": (lambda: _sch()["a"].sync("fwd_post", op="all_gather", dim="0", axis="tp"),
                                       ScheduleError, "dim must be an integer tensor dim, got '0'"),
    # ---- losses and batches
    "no loss in the output": (lambda: treadle.loss.default_loss((torch.ones(2, dtype=torch.long),)),
                              TreadleError, "has no .loss and no floating tensor; pass loss_fn="),
    "loss_fn returns a vector": (lambda: treadle.loss.call_loss(lambda o: o, torch.ones(3), "verify"),
                                 TreadleError, "verify: loss_fn must return a scalar tensor, got shape (3,)"),
    "verify batch smaller than dp": (_verify_small_batch, TreadleError,
                                     "verify: the global batch 1 is smaller than the data-parallel size 2 (mesh axis 'dp')"),
    "verify batch not divisible by dp": (_verify_uneven_batch, TreadleError,
                                         "verify: the global batch 6 does not divide by the data-parallel size 4"),
    "train batch not divisible by dp": (_train_uneven_batch, TreadleError,
                                        "train: the global batch 6 does not divide by the data-parallel size 4"),
    "profile output with no loss": (
        lambda: treadle.profile.profile(NoFloat(), (torch.randn(2, 8),)), ProfileError,
        "cannot find a loss in the model output: loss: the model output (tuple) has no .loss and no floating tensor"),
    # ---- planner arguments
    "pin on an unknown axis": (lambda: _plan(pins={"*.c_fc.weight": {"zz": 1}}), PlanError,
                               "pin '*.c_fc.weight' names mesh axis 'zz', which no mesh has; mesh axes: ['dp', 'tp']"),
    "pin dim out of range": (lambda: _plan(pins={"*.c_fc.weight": {"tp": 5}}), PlanError,
                             "axis 'tp': dim 5 is out of range for 'transformer.h.0.mlp.c_fc.weight' of shape (64, 256)"),
    "pin glob matching nothing": (lambda: _plan(pins={"*.nope": {"tp": 0}}), PlanError,
                                  "pin '*.nope' matches no parameter"),
    "pin on a forbidden axis": (lambda: _plan(pins={"*.c_fc.weight": {"tp": 1}}, forbid_axes=("tp",)), PlanError,
                                "but forbid_axes keeps every op replicated on 'tp'"),
    "pin on the data-parallel axis": (lambda: _plan(pins={"*.c_fc.weight": {"dp": 1}}, dp_axis="dp"), PlanError,
                                      "but dp_axis='dp' gives it to data parallelism"),
    "forbid an unknown axis": (lambda: _plan(forbid_axes=("pp",)), PlanError,
                               "forbid_axes names ['pp'], which no mesh has"),
    "forbid_axes as a string": (lambda: _plan(forbid_axes="tp"), PlanError,
                                "not the string 'tp'; write forbid_axes=('tp',)"),
    "negative budget": (lambda: _plan(memory_budget_bytes=-1), PlanError,
                        "memory_budget_bytes must be a positive number of bytes (or None for no limit); got -1"),
    "unknown dp axis": (lambda: _plan(dp_axis="data"), PlanError, "dp_axis 'data' is not a mesh axis"),
    # ---- harness
    "spawn with no ranks": (lambda: testing.spawn(_shell_factory, 0), SpawnError, "world_size must be >= 1, got 0"),
}


@pytest.mark.parametrize("name", list(MISUSES))
def test_misuse_raises_a_named_error(name):
    fn, exc_type, fragment = MISUSES[name]
    with pytest.raises(exc_type) as info:
        fn()
    assert fragment in str(info.value), str(info.value)


def test_registered_refs_load_from_files_and_code_refs_need_no_registration():
    text = _file([{"op": "set_attr", "path": "", "args": {"*": "tag", "value": {
        "ref": "test_misuse:_shell_factory", "kwargs": {}}}}])
    with pytest.raises(ScheduleError, match="treadle.register_ref"):
        _load(text)
    try:
        assert treadle.register_ref(_shell_factory) is _shell_factory
        sch = _load(text)
        assert sch._state.attrs[0][2].target == "test_misuse:_shell_factory"
    finally:
        from treadle.schedule import gate

        gate.unregister("test_misuse:_shell_factory")
    # a schedule made in code round-trips to its own ranks with what it names (verify, train)
    from treadle.schedule.replay import trusted_load_args

    s = _sch()
    s.set_attr("tag", treadle.Ref.of(_shell_factory))
    s["a"].replace(nn.Linear(8, 8))
    again = treadle.load_schedule(Two(), s.to_json(), **trusted_load_args(s))
    assert [r.op for r in again.records] == ["set_attr", "replace"]


class ScaledEmbedding(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 3.0


class PlainSubclass(nn.Linear):
    pass


def test_leaf_rules_apply_only_where_they_reproduce_the_forward():
    from treadle.forms.vocab.embedding import embedding_forward
    from treadle.sharding_rules import leaf_plan
    from treadle.schedule.state import ParamShard

    vocab = {"weight": [ParamShard(0, "tp")]}
    own = leaf_plan("emb", ScaledEmbedding(16, 4), vocab)
    assert own.gathered == vocab and own.vocab_axis is None and own.out == {}  # its own forward, gathered weights
    plain = leaf_plan("emb", nn.Embedding(16, 4), vocab)
    assert plain.vocab_axis == "tp" and plain.gathered is None
    same = leaf_plan("fc", PlainSubclass(4, 4), {"weight": [ParamShard(0, "tp")], "bias": [ParamShard(0, "tp")]})
    assert same.gathered is None and same.out == {"tp": Shard(-1)}
    # the planner shards only what a rule computes on shards: it costs a leaf's output split as the rule makes it,
    # where build makes a subclass with its own forward whole (a plan's syncs from that split would be refused)
    from treadle.planner.capabilities import runtime_capabilities
    from treadle.sharding_rules import computes_on_shards, has_leaf_rule

    assert has_leaf_rule(ScaledEmbedding(16, 4)) and not computes_on_shards(ScaledEmbedding(16, 4))
    assert computes_on_shards(nn.Embedding(16, 4)) and computes_on_shards(PlainSubclass(4, 4))
    model = nn.ModuleDict({"own": ScaledEmbedding(16, 4), "plain": nn.Embedding(16, 4), "fc": PlainSubclass(4, 4)})
    is_leaf_param, is_leaf_module = runtime_capabilities(model)
    assert [is_leaf_module(p) for p in ("own", "plain", "fc")] == [False, True, True]
    assert not is_leaf_param("own.weight") and is_leaf_param("plain.weight") and is_leaf_param("fc.bias")
    # a vocab-sharded lookup raises on an id outside the vocab, as nn.Embedding does
    local = nn.Embedding(8, 4)  # rank 1's half of a 16-row table
    fwd = embedding_forward(8, 16)
    assert fwd(local, torch.tensor([[9, 3]])).shape == (1, 2, 4)
    with pytest.raises(IndexError, match=r"index out of range in self: ids \[16\] outside \[0, 16\)"):
        fwd(local, torch.tensor([[16, 3]]))
    with pytest.raises(IndexError, match="index out of range"):
        fwd(local, torch.tensor([[-1]]))


def _build_misuses(rank, world):
    out = {}
    s = _sch()
    s.sync("fwd_post", op="all_reduce", axis="tp", out=5)
    model = treadle.build(s)
    try:
        model(torch.randn(2, 8))
    except BuildError as exc:
        out["out"] = str(exc)
    try:
        s["a"].annotate("weight", "k", 1)
    except ScheduleError as exc:
        out["annotate"] = str(exc)
    s = _sch()
    s["b"].sync("fwd_pre", op="all_gather", dim=5, axis="tp")
    model = treadle.build(s)
    try:
        model(torch.randn(2, 8))
    except BuildError as exc:
        out["dim"] = str(exc)
    return out


@pytest.mark.slow
def test_misuses_that_show_at_build_or_forward_name_the_module():
    got = testing.spawn(_build_misuses, 2, timeout_s=120)[0]
    assert got["out"] == "sync at sch['']: out=5, but the module returns a tuple of 2 items"
    assert got["annotate"].startswith("annotate at sch['a']: this schedule was already built")
    assert got["dim"] == ("sync at sch['b']: sync op all_gather: dim=5, but the tensor has 2 dims (shape (2, 8))")


def test_cli_user_errors_are_one_line_with_exit_2(tmp_path, capsys):
    from treadle.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    cases = [
        (["verify", str(bad), "--model", "tiny-gpt2"], f"treadle verify: error: {bad}: not a JSON file"),
        (["verify", str(tmp_path / "none.json"), "--model", "tiny-gpt2"],
         f"treadle verify: error: No such file or directory: {tmp_path / 'none.json'}"),
        (["profile", "no-such-model"], "treadle profile: error: unknown model 'no-such-model'"),
        (["plan", "tiny-gpt2", "--cluster", "2x2:cpu", "--batch", "4", "--seq", "16", "--memory", "lots"],
         "treadle plan: error: cannot read memory size 'lots'"),
        (["plan", "tiny-gpt2", "--cluster", "zz:cpu", "--batch", "4", "--seq", "16"],
         "treadle plan: error: parse_cluster: 'zz' in 'zz:cpu'"),
        (["plan", "tiny-gpt2", "--cluster", "2x2:cpu", "--batch", "4", "--seq", "16", "--pin", "*.c_fc.weight=zz:1"],
         "treadle plan: error: pin '*.c_fc.weight' names mesh axis 'zz'"),
    ]
    sched = tmp_path / "s.json"
    sched.write_text(_file([]))
    cases.append((["verify", str(sched), "--model", "tiny-gpt2", "--world", "4"],
                  f"treadle verify: error: {sched}: the schedule's mesh {{'tp': 2}} needs world size 2, not --world 4"))
    for argv, expected in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(expected), (argv, err)
    with pytest.raises(TreadleError, match="not a JSON file"):
        main(["--debug", "verify", str(bad), "--model", "tiny-gpt2"])
