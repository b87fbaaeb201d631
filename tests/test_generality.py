"""The generality suite: every step of treadle on 25 architectures the recipes were not all written for
(`arch_suite.ARCHS`: Hugging Face decoders with q/k norms per head and over the whole projection, multi-query and
grouped attention, fused q|k|v in other layouts, parallel attention + MLP, ALiBi, mixture of experts; an encoder,
an encoder-decoder, an audio encoder-decoder, a vision transformer; torchtitan's and nanoGPT's plain-PyTorch code
shapes; two CNNs). Each step passes or is refused at schedule / plan time with a treadle error; nothing builds a
model that crashes or differs. The refusals are listed here, so a new one (or a lost one) fails the test.
The README's table comes from `bench/bench_generality.py`, which runs the same steps."""

from __future__ import annotations

import pytest

import arch_suite

# (architecture, step) -> a phrase the refusal's message holds
REFUSED: dict[tuple[str, str], str] = {
    ("falcon", "megatron"): "cannot hold",  # FalconLinear multiplies by weight.T: no sharded rule reads it
    ("resnet", "megatron"): "no Linear-like weight inside the repeated blocks",
    ("wide_resnet", "megatron"): "no Linear-like weight inside the repeated blocks",
    ("gemma", "kernels"): "GemmaRMSNorm is not an F.rms_norm of its weight",  # x * (1 + weight): fuse_norm=False
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(arch_suite.ARCHS))
def test_every_step_passes_or_is_refused_at_schedule_time(name):
    res = arch_suite.run_steps(name)
    assert set(res) == set(arch_suite.STEPS)
    for step, (outcome, detail) in res.items():
        want = REFUSED.get((name, step))
        if want is None:
            assert outcome == "ok", f"{name} {step}: {outcome}: {detail}"
        else:
            assert outcome == "refused" and want in detail, f"{name} {step}: {outcome}: {detail}"
