"""bf16 mixed precision in treadle.run: FSDP schedules compute in bf16 through FSDP2's MixedPrecisionPolicy,
DDP / tensor-parallel schedules through autocast; parameters, gradients and AdamW states stay fp32, and the
losses follow the fp32 run within bf16 tolerance. Gradient accumulation over micro-batches matches one step."""

from __future__ import annotations

import pytest
import torch

from treadle.testing import spawn


def _precision_rank(rank: int, world: int, recipe: str, shape: tuple[int, int]):
    from test_run_reshard import _batches, _make

    from treadle.run.config import RunConfig
    from treadle.run.layout import unwrap
    from treadle.run.loop import autocast_for, build_for, train_step
    from treadle.run.setup import data_parallel_coords

    out = {}
    for precision, accum in (("fp32", 1), ("bf16", 1), ("fp32", 2)):
        cfg = RunConfig(model="tiny-gpt2", data=["unused"], precision=precision)
        sch, built, lay, opt = _make(recipe, shape, build_fn=lambda s: build_for(s, cfg))
        seen = []
        head = unwrap(built).lm_head  # a bias-free matmul: its output dtype is the compute dtype
        head.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
        n, i = data_parallel_coords(sch)
        losses = [train_step(built, opt, lay, sch.mesh, list(b.chunk(n)[i].chunk(accum)), clip_norm=1.0,
                             autocast=autocast_for(sch, cfg, sch.mesh.device))[0] for b in _batches()[:3]]
        dtypes = {str(p.dtype) for p in unwrap(built).parameters()}
        dtypes |= {str(v.dtype) for st in opt.state.values() for k, v in st.items() if k != "step"}
        out[precision if accum == 1 else f"{precision}-accum{accum}"] = (losses, sorted({str(d) for d in seen}), sorted(dtypes))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipe,shape", [("fsdp", (4, 1)), ("megatron", (2, 2))])
def test_bf16_compute_fp32_master(recipe, shape):
    res = spawn(_precision_rank, 4, recipe, shape, timeout_s=240)[0]
    (l32, act32, st32), (l16, act16, st16) = res["fp32"], res["bf16"]
    assert act32 == ["torch.float32"] and act16 == ["torch.bfloat16"]
    assert st32 == st16 == ["torch.float32"]  # master weights and optimizer states
    torch.testing.assert_close(torch.tensor(l16), torch.tensor(l32), rtol=2e-2, atol=0)
    assert l16 != l32  # bf16 really ran
    # two micro-batches of half the samples (DDP syncs on the last only) = one step on all of them
    torch.testing.assert_close(torch.tensor(res["fp32-accum2"][0]), torch.tensor(l32), rtol=1e-5, atol=0)
