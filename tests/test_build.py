"""`build` on gloo ranks: weights sliced and never re-initialised, deterministic meta init, JSON replay,
collectives and their gradients, vocab-parallel cross-entropy, RNG forks, checkpoint memory, errors."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import treadle
import treadle.models
from treadle import Mesh, Replicate, Shard, testing
from treadle.errors import BuildError, MeshError
from treadle.runtime import collectives as C
from treadle.runtime.losses import vocab_parallel_cross_entropy
from treadle.runtime.params import assemble
from tiny_models import lm_inputs, tiny_gpt2, tiny_llama

TP2 = Mesh((2,), ("tp",))


def _layouts(sch):
    st = sch._state
    return {n: st.param_shards[id(p)] for n, p in sch.model.named_parameters(remove_duplicate=False)
            if id(p) in st.param_shards}


def _assemble_all(results, sch, mesh):
    layouts = _layouts(sch)
    sizes = dict(zip(mesh.names, mesh.shape))
    out = {}
    for name in results[0]:
        by_coord = {tuple(mesh.coordinate(r).values()): res[name] for r, res in enumerate(results)}
        out[name] = assemble(by_coord, layouts[name], mesh.names, sizes) if name in layouts else by_coord[(0,) * mesh.ndim]
    return out


def _megatron_gpt2(model, mesh):
    sch = treadle.create_schedule(model, mesh=mesh)
    treadle.models.megatron(sch, tp="tp")
    sch["transformer.h.1.mlp.c_fc"].annotate("weight", "owner", "mlp")
    return sch


def _build_and_dump(rank, world, meta: bool):
    if meta:
        with torch.device("meta"):
            model = tiny_gpt2(n_layer=2)
    else:
        model = tiny_gpt2(n_layer=2)
    sch = _megatron_gpt2(model, Mesh((world,), ("tp",)))
    built = treadle.build(sch)
    params = {n: p.detach().clone() for n, p in built.named_parameters(remove_duplicate=False)}
    return params, treadle.annotations(built)


def test_pretrained_weights_sliced_and_gathered_back_exactly():
    model = tiny_gpt2(n_layer=2)
    results = testing.spawn(_build_and_dump, 2, False, timeout_s=120)
    sch = _megatron_gpt2(tiny_gpt2(n_layer=2), TP2)
    got = _assemble_all([r[0] for r in results], sch, TP2)
    ref = dict(model.named_parameters(remove_duplicate=False))
    assert sorted(got) == sorted(ref)
    for name, p in ref.items():
        assert torch.equal(got[name], p.detach()), name
    # local shapes really are shards: c_attn (64, 192) column-split in q|k|v blocks -> (64, 96)
    assert results[0][0]["transformer.h.0.attn.c_attn.weight"].shape == (64, 96)
    assert results[1][0]["transformer.wte.weight"].shape == (128, 64)
    # tied parameters stay tied, and annotations survive build
    assert torch.equal(results[1][0]["lm_head.weight"], results[1][0]["transformer.wte.weight"])
    assert results[0][1] == {"transformer.h.1.mlp.c_fc.weight": {"owner": "mlp"}}


def test_meta_model_materialises_same_global_weights_for_any_mesh():
    one = testing.spawn(_build_and_dump, 1, True, timeout_s=120)
    two = testing.spawn(_build_and_dump, 2, True, timeout_s=120)
    with torch.device("meta"):
        sch2 = _megatron_gpt2(tiny_gpt2(n_layer=2), TP2)
        sch1 = _megatron_gpt2(tiny_gpt2(n_layer=2), Mesh((1,), ("tp",)))
    g1 = _assemble_all([r[0] for r in one], sch1, Mesh((1,), ("tp",)))
    g2 = _assemble_all([r[0] for r in two], sch2, TP2)
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name
        assert not g1[name].is_meta and torch.isfinite(g1[name]).all()
    assert g1["transformer.h.0.mlp.c_fc.weight"].std() > 0.01  # really initialised, not zeros


def _json_round_trip(rank, world, text):
    a = treadle.create_schedule(tiny_llama(), mesh=TP2)
    treadle.models.megatron(a, tp="tp", sequence_parallel=True, checkpoint_fraction=0.5)
    assert a.to_json() == text
    b = treadle.load_schedule(tiny_llama(), text, TP2)
    ma, mb = treadle.build(a), treadle.build(b)
    for (na, pa), (nb, pb) in zip(ma.named_parameters(), mb.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    batch = lm_inputs()
    la, lb = ma(**batch).loss, mb(**batch).loss
    la.backward()
    lb.backward()
    return la.item(), lb.item(), all(torch.equal(pa.grad, pb.grad) for pa, pb in zip(ma.parameters(), mb.parameters()))


def test_json_round_trip_rebuilds_identical_model():
    sch = treadle.create_schedule(tiny_llama(), mesh=TP2)
    treadle.models.megatron(sch, tp="tp", sequence_parallel=True, checkpoint_fraction=0.5)
    for la, lb, grads_equal in testing.spawn(_json_round_trip, 2, sch.to_json(), timeout_s=120):
        assert la == lb and grads_equal


class Twin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y, *, scale=1.0):
        return self.lin(x) * scale + y


def _multi_input(rank, world):
    torch.manual_seed(0)
    m = Twin()
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    ref = m(x, y, scale=2.0)
    sch = treadle.create_schedule(m, mesh=TP2)
    sch.sync("fwd_pre", op="split", dim=0, axis="tp", arg="x")  # x by name
    sch.sync("fwd_pre", op="split", dim=0, axis="tp", arg=1)  # y by position
    sch.sync("fwd_post", op="all_gather", dim=0, axis="tp")
    built = treadle.build(sch)
    got_pos = built(x, y, scale=2.0)
    got_kw = built(x, y=y, scale=2.0)
    # a split batch may take another matmul kernel than the whole one (rounding differs in the last bit)
    return torch.allclose(got_pos, ref, rtol=1e-6, atol=1e-6), torch.allclose(got_kw, ref, rtol=1e-6, atol=1e-6)


def test_sync_keeps_every_positional_and_keyword_input():
    for pos_ok, kw_ok in testing.spawn(_multi_input, 2, timeout_s=60):
        assert pos_ok and kw_ok


def _collectives(rank, world):
    g = dist.group.WORLD
    out = {}
    torch.manual_seed(0)
    full = torch.randn(4, 6, 8)  # the same "global" tensor on every rank
    mine = full.chunk(world, dim=1)[rank].clone().requires_grad_()
    y = C.all_gather(mine, 1, g)
    (y * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
    out["gather"] = (y.detach(), mine.grad)
    part = (full * (rank + 1)).requires_grad_()
    y = C.reduce_scatter(part, 2, g)
    y.sum().backward()
    out["reduce_scatter"] = (y.detach(), part.grad)
    rep = full.clone().requires_grad_()
    y = C.split(rep, 0, g)
    (y * 3).sum().backward()
    out["split"] = (y.detach(), rep.grad)
    x = full.chunk(world, dim=2)[rank].clone().requires_grad_()
    y = C.all_to_all(x, 1, 2, g)  # Shard(2) -> Shard(1)
    (y * y).sum().backward()
    out["all_to_all"] = (y.detach(), x.grad)
    x = full.clone().requires_grad_()
    y = C.all_reduce(x * (rank + 1), g)
    y.sum().backward()
    out["all_reduce"] = (y.detach(), x.grad)
    x = full.clone().requires_grad_()
    y = C.grad_all_reduce(x, g)
    (y * (rank + 1)).sum().backward()
    out["grad_all_reduce"] = (y.detach(), x.grad)
    return out


def test_collectives_forward_and_backward():
    torch.manual_seed(0)
    full = torch.randn(4, 6, 8)
    res = testing.spawn(_collectives, 2, timeout_s=60)
    weights = torch.arange(full.numel()).reshape(full.shape).float()
    for r in range(2):
        y, g = res[r]["gather"]
        assert torch.equal(y, full) and torch.equal(g, weights.chunk(2, dim=1)[r])
        y, g = res[r]["reduce_scatter"]
        assert torch.allclose(y, (full * 3).chunk(2, dim=2)[r]) and torch.equal(g, torch.ones_like(full))
        y, g = res[r]["split"]
        assert torch.equal(y, full.chunk(2, dim=0)[r]) and torch.equal(g, torch.full_like(full, 3.0))
        y, g = res[r]["all_to_all"]
        assert torch.equal(y, full.chunk(2, dim=1)[r]) and torch.allclose(g, 2 * full.chunk(2, dim=2)[r])
        y, g = res[r]["all_reduce"]
        assert torch.allclose(y, full * 3) and torch.equal(g, torch.full_like(full, r + 1.0))
        y, g = res[r]["grad_all_reduce"]
        assert torch.equal(y, full) and torch.equal(g, torch.full_like(full, 3.0))


def _uneven(rank, world):
    try:
        C.split(torch.zeros(3, 5), 1, dist.group.WORLD)
    except Exception as exc:  # returned to the parent to assert on type and message
        return type(exc).__name__, str(exc)
    return None


def test_uneven_split_is_an_error_before_any_collective():
    name, msg = testing.spawn(_uneven, 2, timeout_s=60)[0]
    assert name == "LayoutError" and "tensor dim 1 has size 5 (shape (3, 5)), not divisible by the group size 2" in msg


def _vocab_ce(rank, world):
    torch.manual_seed(0)
    logits = torch.randn(10, 12)
    labels = torch.randint(0, 12, (10,))
    labels[3] = -100
    mine = logits.chunk(world, dim=1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, labels, dist.group.WORLD)
    loss.backward()
    return loss.detach(), mine.grad


def test_vocab_parallel_cross_entropy_matches_full_softmax():
    torch.manual_seed(0)
    logits = torch.randn(10, 12, requires_grad=True)
    labels = torch.randint(0, 12, (10,))
    labels[3] = -100
    ref = F.cross_entropy(logits, labels, ignore_index=-100)
    ref.backward()
    res = testing.spawn(_vocab_ce, 2, timeout_s=60)
    for r, (loss, grad) in enumerate(res):
        assert torch.allclose(loss, ref, rtol=1e-6)
        assert torch.allclose(grad, logits.grad.chunk(2, dim=1)[r], atol=1e-7)


class DropMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.5)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(self.drop(self.up(x)))


def _rng_streams(rank, world, ckpt: bool):
    torch.manual_seed(0)
    m = DropMLP()
    sch = treadle.create_schedule(m, mesh=TP2)
    sch["up"].shard(["weight", "bias"], dim=0, axis="tp")
    sch["down"].shard("weight", dim=1, axis="tp").sync("fwd_post", to=Replicate(), axis="tp")
    sch["drop"].fork_rng(axis="tp")
    if ckpt:
        sch.checkpoint()
    built = treadle.build(sch)
    torch.manual_seed(123)
    x = torch.ones(4, 16, requires_grad=True)
    masks = []
    sch["drop"].mod.register_forward_hook(lambda mod, a, o: masks.append((o == 0).clone()))
    built(x).sum().backward()
    return masks[0], x.grad, m.up.weight.grad


def test_fork_rng_differs_per_rank_and_replays_under_checkpoint():
    plain = testing.spawn(_rng_streams, 2, False, timeout_s=60)
    ckpt = testing.spawn(_rng_streams, 2, True, timeout_s=60)
    assert not torch.equal(plain[0][0], plain[1][0])  # each tp rank draws its own dropout mask
    for r in range(2):
        assert torch.equal(plain[r][0], ckpt[r][0])  # the same stream with checkpointing
        assert torch.equal(plain[r][1], ckpt[r][1]) and torch.equal(plain[r][2], ckpt[r][2])  # same recompute


def _saved_bytes(rank, world, checkpoint: bool, dropout: float):
    model = tiny_gpt2(n_layer=4, dropout=dropout)
    sch = treadle.create_schedule(model, mesh=Mesh((1,), ("tp",)))
    if checkpoint:
        for i in range(4):
            sch[f"transformer.h.{i}"].checkpoint()
    built = treadle.build(sch)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(7)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = built(**lm_inputs(batch=4, seq=32)).loss
    loss.backward()
    return sum(storages.values()), loss.item(), {n: p.grad.clone() for n, p in built.named_parameters()}


def test_checkpoint_all_layers_saves_memory_and_keeps_numerics():
    plain_bytes, plain_loss, plain_grads = testing.spawn(_saved_bytes, 1, False, 0.1, timeout_s=120)[0]
    ck_bytes, ck_loss, ck_grads = testing.spawn(_saved_bytes, 1, True, 0.1, timeout_s=120)[0]
    assert ck_bytes <= 0.4 * plain_bytes, (ck_bytes, plain_bytes)
    # dropout is active (p=0.1): the recomputed forward must draw the same masks to match exactly
    assert ck_loss == plain_loss
    for name, g in plain_grads.items():
        assert torch.allclose(ck_grads[name], g, rtol=1e-5, atol=1e-7), name


def _world_mismatch(rank, world):
    try:
        Mesh((4,), ("tp",)).bind()
    except MeshError as exc:
        return str(exc)
    return None


def test_world_size_that_does_not_match_the_mesh_is_an_error():
    msg = testing.spawn(_world_mismatch, 2, timeout_s=60)[0]
    assert msg == "Mesh(tp=4) needs world size 4 (4), but the launched world size is 2"


def _build_error(rank, world, which: str):
    model = tiny_gpt2()
    sch = treadle.create_schedule(model, mesh=TP2)
    if which == "no_rule":
        sch["transformer.h.0.ln_1"].shard("weight", dim=0, axis="tp")
    elif which == "bias":
        sch["transformer.h.0.mlp.c_fc"].shard("weight", dim=1, axis="tp")
    try:
        treadle.build(sch)
    except BuildError as exc:
        return str(exc)
    return None


def test_build_errors_name_path_and_fix():
    msg = testing.spawn(_build_error, 2, "no_rule", timeout_s=60)[0]
    assert "'transformer.h.0.ln_1' (LayerNorm) has sharded parameters ['weight']" in msg
    assert "rules exist for ['BatchNorm2d', 'Conv1D', 'Conv2d', 'Embedding', 'Float8Linear', 'Linear']" in msg
    msg = testing.spawn(_build_error, 2, "bias", timeout_s=60)[0]
    assert ("'transformer.h.0.mlp.c_fc' weight is split on output dim 1 over axis 'tp' (column parallel) but its "
            "bias is not split the same way; add sch['transformer.h.0.mlp.c_fc'].shard('bias', dim=0, axis='tp')") in msg


class Double(nn.Module):
    def forward(self, x):
        return x * 2


def _bwd_post(rank, world, typed: bool):
    from treadle import Partial

    sch = treadle.create_schedule(Double(), mesh=TP2)
    if typed:
        sch.sync("bwd_post", to=Replicate(), from_=Partial(), axis="tp")
    else:
        sch.sync("bwd_post", op="all_reduce", axis="tp")
    built = treadle.build(sch)
    x = torch.ones(3, requires_grad=True)
    y = built(x)
    (y * (rank + 1)).sum().backward()  # each rank's gradient is its own share of a pending sum
    return y.detach(), x.grad


@pytest.mark.parametrize("typed", [False, True], ids=["op", "typed"])
def test_bwd_post_sync_reduces_the_input_gradient(typed):
    for y, g in testing.spawn(_bwd_post, 2, typed, timeout_s=60):
        assert torch.equal(y, torch.full((3,), 2.0))  # forward untouched
        assert torch.equal(g, torch.full((3,), 2.0 * (1 + 2)))  # 2 * rank weight, summed over both ranks


def _two_axis_sync(rank, world):
    mesh = Mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    full = torch.randn(4, 6, 8)
    model = nn.Sequential(Double(), Double())
    sch = treadle.create_schedule(model, mesh=mesh)
    sch["0"].sync("fwd_post", to=[Shard(0), Shard(2)], from_=[Replicate(), Replicate()])  # two axes in one step
    sch["1"].sync("fwd_pre", to=[Replicate(), Shard(1)], from_=[Shard(0), Shard(2)])  # gather + all-to-all
    built = treadle.build(sch)
    x = full.clone().requires_grad_()
    mid = []
    sch["0"].mod.register_forward_hook(lambda m, a, o: mid.append(o.detach()))
    y = built(x)
    (y * y).sum().backward()
    return mid[0], y.detach(), x.grad


def test_typed_sync_over_two_axes_uses_the_conversion_planner():
    torch.manual_seed(0)
    full = torch.randn(4, 6, 8)
    res = testing.spawn(_two_axis_sync, 4, timeout_s=120)
    mesh = Mesh((2, 2), ("dp", "tp"))
    for r, (mid, y, g) in enumerate(res):
        c = mesh.coordinate(r)
        assert torch.equal(mid, (2 * full).chunk(2, 0)[c["dp"]].chunk(2, 2)[c["tp"]])
        assert torch.equal(y, (4 * full).chunk(2, 1)[c["tp"]])
    # each rank's output is its shard of the global y = 4x (dim 1 split over tp, replicated over dp); with
    # complete gradients the adjoint path returns d/dx sum(y^2) = 32 x to every rank's replicated input
    for r, (_, _, g) in enumerate(res):
        assert torch.allclose(g, 32 * full), (r, (g - 32 * full).abs().max())


def _count_grad_reductions(rank, world):
    from treadle.runtime import collectives as coll

    model = tiny_llama(n_layer=2)
    sch = treadle.create_schedule(model, mesh=TP2)
    treadle.models.megatron(sch, tp="tp")
    built = treadle.build(sch)
    loss = built(**lm_inputs()).loss
    calls = []
    original = coll._all_reduce
    coll._all_reduce = lambda x, group: calls.append(tuple(x.shape)) or original(x, group)
    try:
        loss.backward()
    finally:
        coll._all_reduce = original
    return calls


def test_column_leaves_reading_one_input_reduce_its_gradient_once():
    calls = testing.spawn(_count_grad_reductions, 2, timeout_s=120)[0]
    # per layer one reduction for q|k|v and one for gate|up (Megatron's single "f"), plus the LM head
    assert len(calls) == 2 * 2 + 1, calls
