"""The schedule language in one process: tree, primitives, their errors, the log and its replay."""

import json

import pytest
import torch
from torch import nn

import treadle
import treadle.models
from treadle import Mesh, Partial, Ref, Replicate, Shard
from treadle.errors import MeshError, ScheduleError
from tiny_models import tiny_bert, tiny_gpt2, tiny_llama

TP2 = Mesh((2,), ("tp",))
DP2TP2 = Mesh((2, 2), ("dp", "tp"))


class Gelu2(nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x)


def make_gelu2(old):
    return Gelu2()


def test_mesh_data_and_errors():
    m = Mesh((2, 4), ("dp", "tp"))
    assert m.world_size == 8 and m.size("tp") == 4 and str(m) == "Mesh(dp=2, tp=4)"
    assert m.coordinate(5) == {"dp": 1, "tp": 1}
    assert m.ranks_along("tp", 5) == [4, 5, 6, 7] and m.ranks_along("dp", 5) == [1, 5]
    with pytest.raises(MeshError, match=r"2 sizes \(2, 2\) but 1 axis names"):
        Mesh((2, 2), ("tp",))
    with pytest.raises(MeshError, match="unique"):
        Mesh((2, 2), ("tp", "tp"))
    with pytest.raises(MeshError, match=r"axis 'pp' does not exist; this mesh has axes \['dp', 'tp'\]"):
        m.size("pp")
    with pytest.raises(MeshError, match="torch.distributed is not initialised"):
        m.bind()


def test_tree_indexing_and_named_schedules():
    model = tiny_bert()
    sch = treadle.create_schedule(model, mesh=TP2)
    sub = sch["bert.encoder.layer.0.attention"]
    assert sub.mod is model.bert.encoder.layer[0].attention and sub.path == "bert.encoder.layer.0.attention"
    assert sub["self.query"].path == "bert.encoder.layer.0.attention.self.query"
    assert sch["bert"]["encoder.layer.1"].mod is model.bert.encoder.layer[1]
    paths = [p for p, _ in sch.named_schedules()]
    assert paths == [p for p, _ in model.named_modules()]
    assert [s.path for s in sch.find(r"bert\.encoder\.layer\.\d+\.attention\.self\.(query|key|value)")] == [
        f"bert.encoder.layer.{i}.attention.self.{n}" for i in range(2) for n in ("query", "key", "value")]


def test_unknown_path_names_nearest():
    sch = treadle.create_schedule(tiny_bert(), mesh=TP2)
    with pytest.raises(ScheduleError, match=r"unknown module path 'bert.encoder.layer.0.atention' .*"
                                            r"nearest existing paths: \['bert.encoder.layer.0.attention'"):
        sch["bert.encoder.layer.0.atention"]
    with pytest.raises(ScheduleError, match=r"'bert.encoder.layer.7' does not exist"):
        sch["bert.encoder.layer.7.attention"]


def test_shard_errors():
    sch = treadle.create_schedule(tiny_gpt2(), mesh=Mesh((3,), ("tp",)))
    fc = sch["transformer.h.0.mlp.c_fc"]
    with pytest.raises(ScheduleError, match=r"sch\['transformer.h.0.mlp.c_fc'\]: parameter 'weight' dim 0 has size 64, "
                                            r"not divisible by mesh axis 'tp' of size 3"):
        fc.shard("weight", dim=0, axis="tp")
    with pytest.raises(ScheduleError, match=r"has no parameter 'wieght'; its parameters: \['weight', 'bias'\]"):
        fc.shard("wieght", dim=0, axis="tp")
    with pytest.raises(ScheduleError, match=r"shard at .*: mesh axis 'mp' does not exist"):
        fc.shard("weight", dim=0, axis="mp")
    with pytest.raises(ScheduleError, match=r"has 2 dims \(shape \(64, 256\)\); dim=2 is out of range"):
        fc.shard("weight", dim=2, axis="tp")
    sch2 = treadle.create_schedule(tiny_gpt2(), mesh=TP2)
    sch2["transformer.h.0.mlp.c_fc"].shard("weight", dim=1, axis="tp")
    with pytest.raises(ScheduleError, match=r"already split on mesh axis 'tp' \(dim 1\)"):
        sch2["transformer.h.0.mlp.c_fc"].shard("weight", dim=0, axis="tp")


def test_tied_parameters_share_their_layout():
    sch = treadle.create_schedule(tiny_gpt2(), mesh=TP2)
    sch["transformer.wte"].shard("weight", dim=0, axis="tp")
    # lm_head.weight is the same Parameter: sharding it again on tp is the second shard of one tensor
    with pytest.raises(ScheduleError, match="already split on mesh axis 'tp'"):
        sch["lm_head"].shard("weight", dim=0, axis="tp")


def test_sync_validation():
    sch = treadle.create_schedule(tiny_gpt2(), mesh=DP2TP2)
    s = sch["transformer.h.0.attn"]
    with pytest.raises(ScheduleError, match=r"unknown mode 'fwd'; use one of \['fwd_pre', 'fwd_post', 'bwd_post'\]"):
        s.sync("fwd", op="all_reduce", axis="tp")
    with pytest.raises(ScheduleError, match=r"unknown op 'allreduce'"):
        s.sync("fwd_post", op="allreduce", axis="tp")
    with pytest.raises(ScheduleError, match=r"op='all_gather' needs \['dim'\]"):
        s.sync("fwd_post", op="all_gather", axis="tp")
    with pytest.raises(ScheduleError, match=r"op='all_to_all' needs \['split_dim', 'concat_dim'\]"):
        s.sync("fwd_post", op="all_to_all", axis="tp")
    with pytest.raises(ScheduleError, match="exactly one of op= .* or to="):
        s.sync("fwd_post", axis="tp")
    with pytest.raises(ScheduleError, match=r"to= has 1 placements but Mesh\(dp=2, tp=2\) has 2 axes"):
        s.sync("fwd_post", to=[Replicate()])
    with pytest.raises(ScheduleError, match="give axis= with a single placement"):
        s.sync("fwd_post", to=Replicate())
    with pytest.raises(ScheduleError, match=r"mesh axis 'sp' does not exist"):
        s.sync("fwd_post", op="all_reduce", axis="sp")
    s.sync("fwd_post", to=[Replicate(), Replicate()], from_=[Replicate(), Partial()])
    assert len(sch.records) == 1


def test_root_only_and_replace_errors():
    sch = treadle.create_schedule(tiny_gpt2(), mesh=DP2TP2)
    with pytest.raises(ScheduleError, match="call it on the root schedule"):
        sch["transformer"].data_parallel(axis="dp")
    with pytest.raises(ScheduleError, match="cannot replace the root module"):
        sch.replace(nn.Identity())
    with pytest.raises(ScheduleError, match="no module of type Gelu2 here"):
        sch.replace_all(Gelu2, make_gelu2)
    with pytest.raises(ScheduleError, match="not importable by name"):
        sch.replace_all(nn.Dropout, lambda old: nn.Identity())
    with pytest.raises(ScheduleError, match=r"attribute 'num_heads' = 4 is not divisible by mesh axis 'dp'") as e:
        treadle.create_schedule(tiny_gpt2(), mesh=Mesh((8,), ("dp",)))["transformer.h.0.attn"].shard_attr(
            "num_heads", axis="dp")
    assert e.type is ScheduleError


def test_replace_carries_hooks_and_records():
    model = tiny_gpt2()
    act = model.transformer.h[0].mlp.act
    seen = []
    act.register_forward_pre_hook(lambda m, a: seen.append("pre"))
    act.register_forward_hook(lambda m, a, o: seen.append("post"))
    act.register_full_backward_hook(lambda m, gi, go: seen.append("bwd"))
    sch = treadle.create_schedule(model, mesh=TP2)
    new = sch["transformer.h.0.mlp.act"].replace(Gelu2())
    assert isinstance(model.transformer.h[0].mlp.act, Gelu2) and new.mod is model.transformer.h[0].mlp.act
    model.transformer.h[0].mlp(torch.randn(2, 3, 64, requires_grad=True)).sum().backward()
    assert seen == ["pre", "post", "bwd"]
    assert sch._state.original is not None and isinstance(sch._state.original.transformer.h[0].mlp.act, nn.Module)
    assert not isinstance(sch._state.original.transformer.h[0].mlp.act, Gelu2)


def test_replace_all_by_factory():
    model = tiny_llama()
    sch = treadle.create_schedule(model, mesh=TP2)
    act_type = type(model.model.layers[0].mlp.act_fn)
    paths = sch.replace_all(act_type, make_gelu2)
    assert paths == ["model.layers.0.mlp.act_fn", "model.layers.1.mlp.act_fn"]
    assert all(isinstance(layer.mlp.act_fn, Gelu2) for layer in model.model.layers)


def test_log_to_python_and_json_replay():
    sch = treadle.create_schedule(tiny_gpt2(), mesh=DP2TP2)
    h = sch["transformer.h.0"]
    h["attn.c_attn"].shard("weight", dim=1, axis="tp", blocks=3).shard("bias", dim=0, axis="tp", blocks=3)
    h["attn"].shard_attr("split_size", axis="tp")
    h["attn.c_proj"].shard("weight", dim=0, axis="tp").sync("fwd_post", to=Replicate(), axis="tp")
    h["mlp.c_fc"].sync("fwd_pre", op="all_gather", dim=1, axis="tp")
    h["mlp"].fork_rng(axis="tp").checkpoint()
    h["ln_1"].reduce_grads(axis="tp")
    h["mlp.c_proj"].annotate("weight", "init", "scaled")
    sch.set_attr("loss_function", Ref("treadle.runtime.losses:VocabParallelLoss", axis="tp", causal=True))
    sch.data_parallel(axis="dp", shard=True)
    py = sch.to_python()
    assert py.splitlines()[0] == "sch['transformer.h.0.attn.c_attn'].shard('weight', dim=1, axis='tp', blocks=3)"
    assert "sch['transformer.h.0.attn.c_proj'].sync('fwd_post', to=Replicate(), axis='tp')" in py
    assert "sch.set_attr('loss_function', value=Ref('treadle.runtime.losses:VocabParallelLoss', axis='tp', causal=True))" in py
    assert py.splitlines()[-1] == "sch.data_parallel(axis='dp', shard=True)"
    text = sch.to_json()
    doc = json.loads(text)
    assert doc["mesh"] == {"shape": [2, 2], "names": ["dp", "tp"]} and len(doc["records"]) == 12
    again = treadle.load_schedule(tiny_gpt2(), text)
    assert again.to_python() == py and again.to_json() == text
    st = again._state
    assert (st.data_parallel.axes, st.data_parallel.shard_axes) == (("dp",), ("dp",))
    assert st.checkpoints == ["transformer.h.0.mlp"]
    assert len(st.param_shards) == 3 and st.syncs[0].to == (("tp", Replicate()),)
    with pytest.raises(ScheduleError, match="lacks axes \\['dp'\\]"):
        treadle.load_schedule(tiny_gpt2(), text, Mesh((4,), ("tp",)))
    with pytest.raises(ScheduleError, match="does not parse"):
        treadle.load_schedule(tiny_gpt2(), "{nope")
    with pytest.raises(ScheduleError, match="not a treadle schedule"):
        treadle.load_schedule(tiny_gpt2(), "{}")


def test_python_log_pastes_back():
    sch = treadle.create_schedule(tiny_llama(), mesh=TP2)
    treadle.models.megatron(sch, tp="tp", checkpoint_fraction=0.5)
    code = sch.to_python()
    fresh = treadle.create_schedule(tiny_llama(), mesh=TP2)
    exec(code, {"sch": fresh, "Replicate": Replicate, "Shard": Shard, "Partial": Partial, "Ref": Ref})
    assert fresh.to_json() == sch.to_json()


def test_megatron_recipe_errors():
    with pytest.raises(ScheduleError, match=r"4 attention heads do not divide over tensor-parallel size 8"):
        treadle.models.megatron(treadle.create_schedule(tiny_bert(), mesh=Mesh((8,), ("tp",))), tp="tp")
    with pytest.raises(ScheduleError, match="sequence parallelism is not supported for post-norm"):
        treadle.models.megatron(treadle.create_schedule(tiny_bert(), mesh=TP2), tp="tp", sequence_parallel=True)
    with pytest.raises(ScheduleError, match=r"megatron: no Linear-like weight inside the repeated blocks at '0' "
                                            r"\(Sequential\); nothing to split over 'tp'"):
        treadle.models.megatron(treadle.create_schedule(nn.Sequential(nn.ModuleList([nn.Sequential()])), mesh=TP2))
    with pytest.raises(ScheduleError, match=r"checkpoint fraction must be in \[0, 1\]"):
        treadle.models.megatron(treadle.create_schedule(tiny_gpt2(), mesh=TP2), checkpoint_fraction=2.0)


def test_checkpoint_fraction_spreads_layers():
    sch = treadle.create_schedule(tiny_gpt2(n_layer=4), mesh=TP2)
    treadle.models.megatron(sch, tp="tp", checkpoint_fraction=0.5)
    assert sch._state.checkpoints == ["transformer.h.0", "transformer.h.2"]


def test_adam_step_check_leaves_ill_conditioned_entries_to_the_gradient_check():
    from treadle.verify.compare import tolerance
    from treadle.verify.verify import _step_diff

    ref = torch.ones(4)
    grad = torch.tensor([1e-9, 1e-3, 1e-3, 1e-3])
    near_eps = ref.clone()
    near_eps[0] += 5e-4  # half an lr=1e-3 step, where |grad| ~ eps: rounding can do that
    d = _step_diff(near_eps, ref, grad, tolerance(torch.float32))
    assert d.ok and d.note == "1 entries with |grad| <= 1e-06 left to the gradient check"
    wrong = ref.clone()
    wrong[2] += 5e-4  # the same deviation where the update is well conditioned is a real mismatch
    assert not _step_diff(wrong, ref, grad, tolerance(torch.float32)).ok
