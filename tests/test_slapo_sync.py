"""Slapo parity, syncs: an explicit sync replaces the collective build would derive at that place (never adds
to it), is checked against the known layout, and typed fwd_post syncs on one module chain. Numerics against
the single-process model on 2 and 4 gloo ranks: outputs, input gradients, every parameter gradient."""

import pytest
import torch
from torch import nn

import treadle
from treadle import Mesh, Partial, Replicate, Shard, testing
from treadle.errors import ScheduleError
from treadle.runtime.params import assemble

D, H = 8, 16


class Attn(nn.Module):
    """q and k read the module's input (column-parallel), o is row-parallel: Slapo's attention shape."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.o = nn.Linear(D, H), nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.o(self.q(x) * torch.sigmoid(self.k(x)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.attn = Attn()
        self.ln2 = nn.LayerNorm(D)
        self.mlp = MLP()

    def forward(self, x):
        h = x + self.attn(self.ln(x))
        return h + self.mlp(self.ln2(h))


def make_block():
    torch.manual_seed(0)
    return Block()


def make_sp():
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(D), MLP())


def _column(s, tp="tp"):
    s.shard(["weight", "bias"], dim=0, axis=tp)


def schedule(sch, form: str):
    """One Megatron block in Slapo's spelling (`form` picks the variant)."""
    if form == "sp":  # sequence parallel: LN on a sequence shard, gather before fc1, reduce-scatter after fc2
        sch["0"].sync("fwd_pre", op="split", dim=1, axis="tp")
        sch["0"].reduce_grads(axis="tp")
        _column(sch["1.fc1"])
        sch["1.fc1"].sync("fwd_pre", op="all_gather", dim=1, axis="tp")
        sch["1.fc1"].sync("bwd_post", op="reduce_scatter", dim=1, axis="tp")
        sch["1.fc2"].shard("weight", dim=1, axis="tp").sync("fwd_post", op="reduce_scatter", dim=1, axis="tp")
        sch["1"].sync("fwd_post", op="all_gather", dim=1, axis="tp")
        return sch
    for proj in ("attn.q", "attn.k", "mlp.fc1"):
        _column(sch[proj])
    sch["attn.o"].shard("weight", dim=1, axis="tp")
    sch["mlp.fc2"].shard("weight", dim=1, axis="tp")
    if form == "op":  # Slapo: bwd_post all-reduce on the attention module (q and k at once) and on fc1
        sch["attn"].sync("bwd_post", op="all_reduce", axis="tp")
        sch["attn.o"].sync("fwd_post", op="all_reduce", axis="tp")
        sch["mlp.fc1"].sync("bwd_post", op="all_reduce", axis="tp")
        sch["mlp.fc2"].sync("fwd_post", op="all_reduce", axis="tp")
    elif form == "typed":
        sch["attn"].sync("bwd_post", to=Replicate(), from_=Partial(), axis="tp")
        sch["attn.o"].sync("fwd_post", to=Replicate(), axis="tp")
        sch["mlp.fc1"].sync("bwd_post", to=Replicate(), axis="tp")  # source derived: a column leaf's gradient
        sch["mlp.fc2"].sync("fwd_post", to=Replicate(), axis="tp")
    elif form == "parent_out":  # the row-parallel pending sum reduced at the parent's output
        sch["attn"].sync("fwd_post", op="all_reduce", axis="tp")
        sch["mlp"].sync("fwd_post", to=Replicate(), from_=Partial(), axis="tp")
    elif form == "chain":  # two typed syncs on one module: reduce-scatter, then gather from that shard
        sch["attn.o"].sync("fwd_post", to=Shard(1), axis="tp").sync("fwd_post", to=Replicate(), axis="tp")
        sch["mlp.fc2"].sync("fwd_post", op="reduce_scatter", dim=1, axis="tp")
        sch["mlp.fc2"].sync("fwd_post", to=Replicate(), axis="tp")
    elif form != "derived":  # derived: no syncs at all, build derives every collective
        raise ValueError(form)
    return sch


def _run(rank, world, form):
    model = make_sp() if form == "sp" else make_block()
    sch = schedule(treadle.create_schedule(model, mesh=Mesh((world,), ("tp",))), form)
    built = treadle.build(sch)
    torch.manual_seed(1)
    x = torch.randn(2, 4, D, requires_grad=True)
    y = built(x)
    (y * torch.arange(y.numel()).reshape(y.shape).sin()).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in built.named_parameters()}


def reference(form):
    model = make_sp() if form == "sp" else make_block()
    torch.manual_seed(1)
    x = torch.randn(2, 4, D, requires_grad=True)
    y = model(x)
    (y * torch.arange(y.numel()).reshape(y.shape).sin()).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def check_against_reference(form, world, results):
    y_ref, gx_ref, grads_ref = reference(form)
    mesh = Mesh((world,), ("tp",))
    sch = schedule(treadle.create_schedule(make_sp() if form == "sp" else make_block(), mesh=mesh), form)
    layouts = {n: sch._state.param_shards.get(id(p)) for n, p in sch.model.named_parameters()}
    for y, gx, _ in results:
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gx, gx_ref, atol=1e-5, rtol=1e-5)  # tp-size times too large before the fix
    for name, g_ref in grads_ref.items():
        by_coord = {(r,): res[2][name] for r, res in enumerate(results)}
        got = assemble(by_coord, layouts[name], ("tp",), {"tp": world}) if layouts[name] else by_coord[(0,)]
        torch.testing.assert_close(got, g_ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("form", ["op", "typed", "derived", "parent_out", "chain", "sp"])
def test_explicit_syncs_replace_derived_collectives_tp2(form):
    check_against_reference(form, 2, testing.spawn(_run, 2, form, timeout_s=120))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["op", "sp"])
def test_explicit_syncs_replace_derived_collectives_tp4(form):
    check_against_reference(form, 4, testing.spawn(_run, 4, form, timeout_s=180))


def _errors(rank, world):
    out = {}
    cases = {
        "reduce_column": lambda s: (_column(s["mlp.fc1"]),
                                    s["mlp.fc1"].sync("fwd_post", op="all_reduce", axis="tp")),
        "gather_row": lambda s: (s["mlp.fc2"].shard("weight", dim=1, axis="tp"),
                                 s["mlp.fc2"].sync("fwd_post", op="all_gather", dim=-1, axis="tp")),
        "typed_from_contradicts": lambda s: (_column(s["mlp.fc1"]),
                                             s["mlp.fc1"].sync("fwd_post", to=Replicate(), from_=Partial(), axis="tp")),
        "bwd_on_row": lambda s: (s["mlp.fc2"].shard("weight", dim=1, axis="tp"),
                                 s["mlp.fc2"].sync("bwd_post", op="all_reduce", axis="tp")),
        "rs_without_gather": lambda s: (_column(s["mlp.fc1"]),
                                        s["mlp.fc1"].sync("bwd_post", op="reduce_scatter", dim=1, axis="tp")),
        "parent_twice": lambda s: (s["mlp.fc2"].shard("weight", dim=1, axis="tp"),
                                   s["mlp.fc2"].sync("fwd_post", op="all_reduce", axis="tp"),
                                   s["mlp"].sync("fwd_post", op="all_reduce", axis="tp")),
        "gather_row_input": lambda s: (s["mlp.fc2"].shard("weight", dim=1, axis="tp"),
                                       s["mlp.fc2"].sync("fwd_pre", op="all_gather", dim=-1, axis="tp")),
        "reduced_twice": lambda s: (_column(s["mlp.fc1"]), s["mlp"].sync("bwd_post", op="all_reduce", axis="tp"),
                                    s["mlp.fc1"].sync("bwd_post", op="all_reduce", axis="tp")),
    }
    for name, apply in cases.items():
        sch = treadle.create_schedule(make_block(), mesh=Mesh((world,), ("tp",)))
        apply(sch)
        try:
            treadle.build(sch)
            out[name] = None
        except ScheduleError as exc:
            out[name] = str(exc)
    return out


def test_explicit_ops_that_contradict_the_known_layout_are_refused():
    msgs = testing.spawn(_errors, 2, timeout_s=120)[0]
    m = msgs["reduce_column"]
    assert m and "sch['mlp.fc1']" in m and "'tp'" in m and "Partial()" in m and "Shard(dim=-1)" in m, m
    assert "column-parallel" in m
    m = msgs["gather_row"]
    assert m and "sch['mlp.fc2']" in m and "Shard(dim=-1)" in m and "Partial()" in m and "row-parallel" in m, m
    m = msgs["typed_from_contradicts"]
    assert m and "from_=Partial() on axis 'tp' contradicts" in m and "Shard(dim=-1)" in m, m
    m = msgs["bwd_on_row"]
    assert m and "sch['mlp.fc2']" in m and "no column-parallel leaf" in m and "'mlp.fc2': 'Partial()'" in m, m
    m = msgs["rs_without_gather"]
    assert m and "sync('fwd_pre', op='all_gather', dim=1, axis='tp')" in m, m
    m = msgs["parent_twice"]
    assert m and "sch['mlp']" in m and "'mlp.fc2': 'Replicate()'" in m, m
    m = msgs["gather_row_input"]
    assert m and "row-parallel 'mlp.fc2' reads its input as Shard(dim=-1)" in m, m
    m = msgs["reduced_twice"]
    assert m and "column-parallel 'mlp.fc1' over axis 'tp', which sync at sch['mlp']" in m and "counted twice" in m, m
