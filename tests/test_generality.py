"""The generality suite: every step of treadle on 27 architectures the recipes were not all written for
(`arch_suite.ARCHS`: Hugging Face decoders with q/k norms per head and over the whole projection, multi-query and
grouped attention, fused qkv in other layouts, parallel attention + MLP, ALiBi, mixture of experts; an encoder, an
encoder-decoder, an audio encoder-decoder, a vision transformer; torchtitan's, nanoGPT's and timm's plain-PyTorch
code shapes; three CNNs). Each step passes or is refused at schedule / plan time with a treadle error; nothing
builds a model that crashes or differs. The refusals are listed in `arch_suite.REFUSED`, so a new one (or a lost
one) fails the test. In CI it runs the 21 of them no other test file covers (`arch_suite.CI_ARCHS`), split over
three files (`arch_suite.PARTS`) so that the test workers share it, every step but "train" (`arch_suite.CI_STEPS`:
verify_plan already steps the same plan's optimizer against one process; the bench trains).
The README's table comes from `bench/bench_generality.py`, which runs the same steps."""

from __future__ import annotations

import pytest

import arch_suite


@pytest.mark.slow
@pytest.mark.parametrize("name", arch_suite.PARTS[0])
def test_every_step_passes_or_is_refused_at_schedule_time(name):
    arch_suite.check_steps(name)
