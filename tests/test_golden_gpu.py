"""The golden cases' GPU part (`tests/test_golden.py` has the rest): the README's plans and the bench's recipe
schedules, planned and priced on the GPU presets, as written (`tests/golden/make_golden.py`). Apart from the CPU
cases so that the two test workers share the golden cases."""

import pytest

from golden import make_golden
from test_golden import check_part


@pytest.mark.slow
@pytest.mark.parametrize("part", [p for p in make_golden.PARTS if p.startswith("gpu ")])
def test_golden_gpu_plans_and_prices_unchanged(part):
    check_part(part)
