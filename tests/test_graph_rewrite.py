"""replace_match / decompose / fuse / checkpoint_match / checkpoint_selective, each followed by treadle.verify
(outputs and all gradients against the original model, after replaying the saved schedule on the ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import treadle
from treadle import BuildError, Mesh, ScheduleError, create_schedule
from tiny_models import lm_inputs, tiny_gpt2

MESH1 = Mesh((1,), ("tp",))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 16)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.drop(self.fc2(self.act(self.fc1(x)))) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mlp = MLP()
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(self.mlp(x))


def bias_gelu(x, bias):
    return F.gelu(x + bias)


class BiasGeLU(nn.Module):
    def forward(self, x, bias):
        return F.gelu(x + bias)


def fused_bias_gelu(x, bias):
    return F.gelu(x + bias)


def wrong_names(inp, b):
    return F.gelu(inp + b)


def gelu_then_linear(x, w, b):
    return F.linear(F.gelu(x), w, b)


def _inputs():
    return {"x": torch.randn(4, 16, generator=torch.Generator().manual_seed(0))}


def _decomposed():
    sch = create_schedule(Net(), mesh=MESH1)
    sch["mlp"].trace()
    sch["mlp.fc1"].decompose()
    return sch


def test_decompose_then_verify():
    sch = _decomposed()
    ops = [n.target for n in sch["mlp"].graph.nodes if n.op == "call_function"]
    assert F.linear in ops and "fc1" not in [n.target for n in sch["mlp"].graph.nodes if n.op == "call_module"]
    treadle.verify(sch, _inputs())


def test_replace_match_with_module_then_verify():
    sch = _decomposed()
    (m,) = sch["mlp"].find_pattern(bias_gelu)
    assert m.inputs["bias"].target == "fc1.bias"
    sch["mlp"].replace_match(BiasGeLU(), m)
    assert "replaced_0" in [n.target for n in sch["mlp"].graph.nodes if n.op == "call_module"]
    assert isinstance(sch["mlp.replaced_0"].mod, BiasGeLU)  # the replacement is a sub-schedule
    rep = treadle.verify(sch, _inputs())
    assert rep.ok


def test_replace_match_with_function_then_verify_and_hooks_survive():
    sch = _decomposed()
    seen = []
    sch["mlp"].mod.register_forward_hook(lambda mod, a, out: seen.append(out.shape))
    sch["mlp"].replace_match(fused_bias_gelu, sch["mlp"].find_pattern(bias_gelu)[0])
    sch.model(**_inputs())
    assert seen == [torch.Size([4, 16])]  # the traced module's own hooks keep running
    assert "fused_bias_gelu" in sch.to_python()
    treadle.verify(sch, _inputs())


def test_replacement_that_cannot_bind_is_rejected_and_changes_nothing():
    sch = _decomposed()
    code = sch["mlp"].mod.code
    n_records = len(sch.records)
    with pytest.raises(ScheduleError, match=r"cannot bind the match inputs \['x', 'bias'\].*\['b', 'inp'\] have no "
                                            r"match input.*\['bias', 'x'\] would be dropped"):
        sch["mlp"].replace_match(wrong_names, sch["mlp"].find_pattern(bias_gelu)[0])
    assert sch["mlp"].mod.code == code and len(sch.records) == n_records


def test_fuse_aot_eager_then_verify():
    sch = _decomposed()
    (m,) = sch["mlp"].find_pattern(gelu_then_linear)
    sch["mlp"].fuse(m, compiler="aot_eager")
    assert [n.target for n in sch["mlp"].graph.nodes if n.op == "call_module"] == ["fused_0", "drop"]
    treadle.verify(sch, _inputs())


@pytest.mark.slow
def test_fuse_inductor_then_verify():
    sch = _decomposed()
    sch["mlp"].fuse(sch["mlp"].find_pattern(bias_gelu)[0], compiler="inductor")
    # inductor's fused kernel rounds differently (~1e-7); AdamW normalises every entry, so an entry whose
    # gradient is ~0 moves by about +-lr whatever its rounding: a small lr keeps the step check about gradients
    rep = treadle.verify(sch, _inputs(), lr=1e-6)
    assert any(c.kind == "param_grad" and c.diff.ok for c in rep.checks)


def test_fuse_with_unavailable_compiler_is_an_error():
    sch = _decomposed()
    m = sch["mlp"].find_pattern(bias_gelu)[0]
    with pytest.raises(ScheduleError, match=r"fuse at sch\['mlp'\]: compiler 'tvm-nope' is not a torch.compile "
                                            r"backend here; available: \[.*'aot_eager'.*'inductor'"):
        sch["mlp"].fuse(m, compiler="tvm-nope")


def test_checkpoint_match_then_verify():
    sch = _decomposed()
    sch["mlp"].checkpoint_match(sch["mlp"].find_pattern(gelu_then_linear)[0])
    assert "checkpointed_0" in [n.target for n in sch["mlp"].graph.nodes if n.op == "call_module"]
    treadle.verify(sch, _inputs())


def test_checkpoint_selective_then_verify_gpt2_block():
    model = tiny_gpt2(2)
    sch = create_schedule(model, mesh=MESH1)
    sch["transformer.h.0"].checkpoint_selective(save=["aten.addmm", "aten.mm"])
    with pytest.raises(ScheduleError, match=r"unknown ops \['aten.not_an_op'\]"):
        sch["transformer.h.1"].checkpoint_selective(save=["aten.not_an_op"])
    with pytest.raises(ScheduleError, match="already checkpointed"):
        sch["transformer.h.0"].checkpoint_selective(save=["aten.mm"])
    # no KV cache: a cache updated in forward would differ when the block is recomputed in backward
    treadle.verify(sch, {**lm_inputs(2, 8), "use_cache": False})


def test_decompose_column_parallel_under_tp_then_verify_row_parallel_is_rejected():
    sch = create_schedule(Net(), mesh=Mesh((2,), ("tp",)))
    sch["mlp"].trace()
    sch["mlp.fc1"].shard(["weight", "bias"], dim=0, axis="tp")
    sch["mlp.fc2"].shard("weight", dim=1, axis="tp").sync("fwd_post", to=treadle.Replicate(), axis="tp")
    sch["mlp.fc1"].decompose()
    sch["mlp"].replace_match(BiasGeLU(), sch["mlp"].find_pattern(bias_gelu)[0])
    treadle.verify(sch, _inputs())

    bad = create_schedule(Net(), mesh=Mesh((2,), ("tp",)))
    bad["mlp"].trace()
    bad["mlp.fc2"].shard("weight", dim=1, axis="tp")
    with pytest.raises(ScheduleError, match=r"decompose at 'mlp.fc2': the leaf has shard weight dim 1 over 'tp' "
                                            r"\(row parallel"):
        bad["mlp.fc2"].decompose()
    bad = create_schedule(Net(), mesh=Mesh((2,), ("tp",)))
    bad["mlp"].trace()
    bad["mlp.fc2"].decompose()
    bad["mlp.fc2"].shard("weight", dim=1, axis="tp")  # sharded after decompose: refused at build
    rep = treadle.verify(bad, _inputs(), raise_on_mismatch=False)
    assert not rep.ok and "'mlp.fc2' was decomposed but its weight is split on its input dim" in rep.error


def test_decompose_errors():
    sch = create_schedule(Net(), mesh=MESH1)
    with pytest.raises(ScheduleError, match=r"no traced ancestor; trace its parent first"):
        sch["mlp.fc1"].decompose()
    with pytest.raises(ScheduleError, match=r"GELU has no decomposition"):
        sch["mlp.act"].decompose()
