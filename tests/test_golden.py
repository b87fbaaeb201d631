"""No behaviour change where none is meant: the planner's decisions and the price's step and peak on the golden
cases (`tests/golden/make_golden.py`: the README's GPU plans, the demo's CPU plans on a fixed cluster file, every
parallel form on tiny LLaMA, the bench's recipe schedules) equal the figures written before the refactor of issue
"One module per parallel form" (relative difference <= 1e-9)."""

import json

import pytest

from golden import make_golden


def check_part(part: str) -> None:
    """The golden cases of `part` (`make_golden.PARTS`) as written."""
    got = make_golden.PARTS[part]()
    want = json.loads(make_golden.GOLDEN.read_text())
    assert got and set(got) <= set(want), sorted(got)
    diff = make_golden.differences({k: want[k] for k in got}, got)
    assert not diff, "plans or prices changed:\n" + "\n".join(diff[:40])


def test_the_parts_cover_every_golden_case():
    """Each golden case belongs to one part (the GPU ones named by their model), so the parts check them all."""
    want = json.loads(make_golden.GOLDEN.read_text())
    cpu = {"demo gpt2 2x2:cpu", "forms tiny-llama 2x2:cpu"}
    assert cpu <= set(want)
    assert {p.removeprefix("gpu ") for p in make_golden.PARTS if p.startswith("gpu ")} == {
        k.split(" ")[0] for k in set(want) - cpu}
    assert set(make_golden.PARTS) - {p for p in make_golden.PARTS if p.startswith("gpu ")} == {"demo", "forms"}


@pytest.mark.slow
@pytest.mark.parametrize("part", [p for p in make_golden.PARTS if not p.startswith("gpu ")])
def test_golden_plans_and_prices_unchanged(part):
    check_part(part)


def test_differences_sees_a_change():
    base = {"a": {"step_s": 0.1, "decisions": ["x", "y"]}}
    assert make_golden.differences(base, {"a": {"step_s": 0.1 * (1 + 1e-12), "decisions": ["x", "y"]}}) == []
    assert make_golden.differences(base, {"a": {"step_s": 0.1 * (1 + 1e-8), "decisions": ["x", "y"]}})
    assert make_golden.differences(base, {"a": {"step_s": 0.1, "decisions": ["x", "z"]}})
    assert make_golden.differences(base, {"a": {"step_s": 0.1, "decisions": ["x"]}})
    assert make_golden.differences(base, {"a": {"decisions": ["x", "y"]}}) == ["/a: missing 'step_s'"]
