"""The generality suite, part 3 of 3 (`test_generality.py` says what it checks)."""

from __future__ import annotations

import pytest

import arch_suite


@pytest.mark.slow
@pytest.mark.parametrize("name", arch_suite.PARTS[2])
def test_every_step_passes_or_is_refused_at_schedule_time(name):
    arch_suite.check_steps(name)
