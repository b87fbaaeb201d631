"""treadle.run checkpoints reshard on load: save under one schedule, load under another on the same 4 gloo
ranks; the global parameters are identical and the next two steps' losses (parameters, then AdamW states)
continue within fp tolerance of the run that saved."""

from __future__ import annotations

import pytest
import torch

from treadle.testing import spawn

SCHEDULES = {
    "tp2xdp2": ("megatron", (2, 2)),        # GPT-2 c_attn is split in 3 interleaved blocks: the gathered path
    "megatron-fsdp2x2": ("megatron-fsdp", (2, 2)),
    "ddp4": ("ddp", (4, 1)),
    "fsdp4": ("fsdp", (4, 1)),
    "tp4": ("megatron", (1, 4)),
    "hsdp2x2": ("hsdp", (2, 2)),            # FSDP2 over tp, replicated over dp: a 2-D (replicate, shard) mesh
    "fsdp-all2x2": ("fsdp-all", (2, 2)),    # FSDP2 over the flattened (dp, tp) group
}


def _make(recipe: str, shape: tuple[int, int], build_fn=None):
    from treadle import Mesh, build, create_schedule
    from treadle.models import megatron
    from treadle.models.zoo import named_model
    from treadle.run.config import RunConfig
    from treadle.run.layout import layouts, shards_by_name
    from treadle.run.optim import init_optimizer_state, make_optimizer

    torch.manual_seed(0)
    model, _ = named_model("tiny-gpt2", batch=1, seq=16, dropout=False)
    sch = create_schedule(model, mesh=Mesh(shape, ("dp", "tp")))
    dp = "dp" if shape[0] > 1 else None
    if recipe.startswith("megatron"):
        megatron(sch, tp="tp", dp=dp, zero3=recipe.endswith("fsdp"))
    elif recipe == "hsdp":
        sch.data_parallel(axis="tp", shard=True, replicate="dp")
    elif recipe == "fsdp-all":
        sch.data_parallel(axis=("dp", "tp"), shard=True)
    else:
        sch.data_parallel(axis="dp", shard=recipe == "fsdp")
    before = shards_by_name(sch)
    built = (build_fn or build)(sch)
    spec = sch._state.data_parallel
    lay = layouts(built, before, sch.mesh, spec.shard_axes if spec is not None and spec.shard else None)
    cfg = RunConfig(model="tiny-gpt2", data=["unused"], lr=1e-2, warmup_steps=0, steps=10)
    opt = make_optimizer(built, lay, cfg)
    init_optimizer_state(opt)
    return sch, built, lay, opt


def _step(sch, built, lay, opt, batch: torch.Tensor, *, with_norm: bool = False):
    from treadle.run.loop import train_step
    from treadle.run.setup import data_parallel_coords

    n, i = data_parallel_coords(sch)
    loss, norm = train_step(built, opt, lay, sch.mesh, [batch.chunk(n)[i]], clip_norm=1.0)
    return (loss, norm) if with_norm else loss


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (4, 16), generator=g) for _ in range(4)]


def _reference_first_step() -> tuple[float, float]:
    """Loss and global gradient norm of the first batch on the unbuilt model in this process."""
    from treadle.models.zoo import named_model

    torch.manual_seed(0)
    model, _ = named_model("tiny-gpt2", batch=1, seq=16, dropout=False)
    ids = _batches()[0]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss), float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


def _reshard_rank(rank: int, world: int, src: str, dst: str, path: str):
    from treadle.run import checkpoint as ckpt
    from treadle.run.layout import unwrap

    batches = _batches()
    a = _make(*SCHEDULES[src])
    first = _step(*a, batches[0], with_norm=True)
    _step(*a, batches[1])
    ckpt.Checkpointer(path).save(a[1], a[3], a[2], a[0].mesh, step=2)
    full_a = {n: a[2][n].gather_full(p, a[0].mesh) for n, p in unwrap(a[1]).named_parameters()}
    after_a = [_step(*a, b) for b in batches[2:]]
    b_ = _make(*SCHEDULES[dst])
    step = ckpt.load(ckpt.step_dir(path, 2), b_[1], b_[3], b_[2], b_[0].mesh)
    full_b = {n: b_[2][n].gather_full(p, b_[0].mesh) for n, p in unwrap(b_[1]).named_parameters()}
    after_b = [_step(*b_, b) for b in batches[2:]]
    max_diff = {n: float((full_a[n] - full_b[n]).abs().max()) for n in full_a}
    return step, sorted(full_a) == sorted(full_b), max_diff, after_a, after_b, first, full_a if rank == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("src,dst", [("tp2xdp2", "fsdp4"), ("ddp4", "megatron-fsdp2x2"), ("fsdp4", "tp4"),
                                     ("hsdp2x2", "fsdp-all2x2")])
def test_reshard_on_load(tmp_path, src, dst):
    results = spawn(_reshard_rank, 4, src, dst, str(tmp_path / "ck"), timeout_s=240)
    ref_loss, ref_norm = _reference_first_step()
    for step, same_names, max_diff, after_a, after_b, (loss0, norm0), _ in results:
        # the norm over tensor-parallel shards, FSDP shards and replicas is the single-process norm
        assert norm0 == pytest.approx(ref_norm, rel=1e-5) and loss0 == pytest.approx(ref_loss, rel=1e-5)
        assert step == 2
        assert same_names
        assert max(max_diff.values()) == 0.0, {n: d for n, d in max_diff.items() if d}  # copied, never recomputed
        torch.testing.assert_close(torch.tensor(after_b), torch.tensor(after_a), rtol=1e-5, atol=1e-6)

    if src == "tp2xdp2":  # a Hugging Face export of the sharded checkpoint holds the global weights
        from transformers import GPT2LMHeadModel

        from treadle.models.zoo import named_model
        from treadle.run.checkpoint import export_hf, step_dir

        fresh, _ = named_model("tiny-gpt2", batch=1, seq=16, dropout=False)
        export_hf(step_dir(tmp_path / "ck", 2), fresh, tmp_path / "hf")
        assert (tmp_path / "hf" / "model.safetensors").is_file()
        loaded = dict(GPT2LMHeadModel.from_pretrained(tmp_path / "hf").named_parameters())
        for name, full in results[0][6].items():
            torch.testing.assert_close(loaded[name], full, rtol=0, atol=0, msg=name)


def _meta_rank(rank: int, world: int):
    from treadle import Mesh, build, create_schedule
    from treadle.models import megatron
    from treadle.run.layout import layouts, shards_by_name, unwrap
    from treadle.run.setup import load_run_model

    out = {}
    for recipe in ("ddp", "megatron-fsdp"):
        model = load_run_model("tiny-llama", seq=16, seed=0, meta=True)
        assert all(p.is_meta for p in model.parameters())
        sch = create_schedule(model, mesh=Mesh((2, 2), ("dp", "tp")) if recipe != "ddp" else Mesh((4, 1), ("dp", "tp")))
        if recipe == "ddp":
            sch.data_parallel(axis="dp")
        else:
            megatron(sch, tp="tp", dp="dp", zero3=True)
        before = shards_by_name(sch)
        built = build(sch)
        lay = layouts(built, before, sch.mesh)
        out[recipe] = {n: lay[n].gather_full(p, sch.mesh) for n, p in unwrap(built).named_parameters()}
    return out


@pytest.mark.slow
def test_meta_init_gives_the_same_weights_under_any_schedule():
    out = spawn(_meta_rank, 4, timeout_s=240)[0]
    ddp, tp = out["ddp"], out["megatron-fsdp"]
    assert sorted(ddp) == sorted(tp)
    for name, w in ddp.items():
        torch.testing.assert_close(tp[name], w, rtol=0, atol=0, msg=name)
    matrices = [w for w in ddp.values() if w.dim() == 2]
    assert all(float(w.std()) > 1e-3 for w in matrices)  # initialised, not left empty or zero
