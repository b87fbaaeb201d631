"""No behaviour change where none is meant: the planner's decisions and the price's step and peak on the golden
cases (`tests/golden/make_golden.py`: the README's GPU plans, the demo's CPU plans on a fixed cluster file, every
parallel form on tiny LLaMA, the bench's recipe schedules) equal the figures written before the refactor of issue
"One module per parallel form" (relative difference <= 1e-9)."""

import json

import pytest

from golden import make_golden


@pytest.mark.slow
def test_golden_plans_and_prices_unchanged():
    want = json.loads(make_golden.GOLDEN.read_text())
    got = make_golden.compute()
    diff = make_golden.differences(want, got)
    assert not diff, "plans or prices changed:\n" + "\n".join(diff[:40])


def test_differences_sees_a_change():
    base = {"a": {"step_s": 0.1, "decisions": ["x", "y"]}}
    assert make_golden.differences(base, {"a": {"step_s": 0.1 * (1 + 1e-12), "decisions": ["x", "y"]}}) == []
    assert make_golden.differences(base, {"a": {"step_s": 0.1 * (1 + 1e-8), "decisions": ["x", "y"]}})
    assert make_golden.differences(base, {"a": {"step_s": 0.1, "decisions": ["x", "z"]}})
    assert make_golden.differences(base, {"a": {"step_s": 0.1, "decisions": ["x"]}})
    assert make_golden.differences(base, {"a": {"decisions": ["x", "y"]}}) == ["/a: missing 'step_s'"]
