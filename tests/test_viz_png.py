"""PNG figures (matplotlib, the `viz` extra) of a fixed plan and a profile, compared by structure, not pixels."""

from __future__ import annotations

import pytest
from matplotlib.collections import PolyCollection

from test_viz import fixed_plan_dict
from treadle.planner.plan import Plan
from treadle.viz import timeline_from_plan
from treadle.viz.png import (breakdown_figure, memory_figure, profile_memory_figure, save_plan_pngs,
                             save_profile_png, timeline_figure)
from treadle.viz.timeline import MEMORY_CATEGORIES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tl():
    return timeline_from_plan(Plan.from_dict(fixed_plan_dict()))


def test_memory_figure_stacks_each_category_under_the_peak_and_budget(tl) -> None:
    (ax,) = memory_figure(tl).axes
    polys = [c for c in ax.collections if isinstance(c, PolyCollection) and c.get_label() in MEMORY_CATEGORIES]
    assert [c.get_label() for c in polys] == list(MEMORY_CATEGORIES)
    levels = {ln.get_label(): ln.get_ydata()[0] for ln in ax.lines}
    assert levels["predicted peak"] == pytest.approx(tl.peak_bytes / 2**20)  # MiB for this small plan
    assert levels["budget"] == pytest.approx(tl.budget_bytes / 2**20)
    top = max(max(v[1] for v in c.get_paths()[0].vertices) for c in polys)
    assert top == pytest.approx(max(p.total_bytes for p in tl.memory) / 2**20)
    assert "MiB" in ax.get_ylabel()


def test_breakdown_and_timeline_figures_add_up_to_the_step(tl) -> None:
    (ax,) = breakdown_figure(tl).axes
    widths = {c.get_label().split(":")[0]: c.patches[0].get_width() for c in ax.containers}
    assert sum(widths.values()) == pytest.approx(tl.step_s * 1e3, rel=0.01)
    assert set(widths) == {"forward", "backward", "recompute", "comm dp (exposed)", "comm dp+tp (exposed)"}
    (ax,) = timeline_figure(tl).axes
    assert [t.get_text() for t in ax.get_yticklabels()] == tl.tracks
    n_bars = sum(len(c.get_paths()) for c in ax.collections)
    assert n_bars == len(tl.spans)


def test_pngs_are_written(tl, tmp_path) -> None:
    paths = save_plan_pngs(tl, str(tmp_path / "fig"))
    assert [p.rsplit("-", 1)[1] for p in paths] == ["memory.png", "breakdown.png", "timeline.png"]
    for p in paths:
        assert open(p, "rb").read(8) == PNG_MAGIC


def test_profile_memory_figure_reaches_the_profile_peak(tmp_path) -> None:
    from treadle.models.zoo import named_model
    from treadle.profile import profile

    model, inputs = named_model("tiny-gpt2", batch=2, seq=16, fake=True)
    prof = profile(model, inputs, hardware="h100-sxm")
    (ax,) = profile_memory_figure(prof).axes
    polys = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(polys) == 2
    top = max(v[1] for v in polys[1].get_paths()[0].vertices)
    peak = {ln.get_label(): ln.get_ydata()[0] for ln in ax.lines}["peak"]
    assert top == pytest.approx(peak, rel=1e-6)
    (path,) = save_profile_png(prof, str(tmp_path / "prof"))
    assert open(path, "rb").read(8) == PNG_MAGIC


def test_figures_of_a_priced_schedule_add_up_to_its_step() -> None:
    """A timeline drawn from treadle.price: the breakdown bar is the price's step, split into its phases and
    each axis's exposed communication; every slice (waits included) is drawn."""
    import treadle
    from treadle import Mesh
    from treadle.cost.cluster import ClusterSpec
    from treadle.models.zoo import named_model
    from treadle.pricing import price
    from treadle.viz import timeline_from_price

    model, inputs = named_model("tiny-gpt2", batch=8, seq=32, dropout=False)
    mesh = Mesh((2, 2), ("dp", "tp"))
    sch = treadle.models.megatron(treadle.create_schedule(model, mesh=mesh), tp="tp", dp="dp")
    p = price(sch, inputs, ClusterSpec.uniform(mesh, "nvlink4", device="h100-sxm"))
    tl = timeline_from_price(p)
    (ax,) = breakdown_figure(tl).axes
    widths = {c.get_label().split(":")[0]: c.patches[0].get_width() for c in ax.containers}
    assert sum(widths.values()) == pytest.approx(p.step_s * 1e3, rel=1e-6)
    assert {"forward", "backward", "optimizer", "comm tp (exposed)"} <= set(widths)
    (ax,) = timeline_figure(tl).axes
    assert sum(len(c.get_paths()) for c in ax.collections) == len(tl.spans)
    (ax,) = memory_figure(tl).axes
    assert {ln.get_label(): ln.get_ydata()[0] for ln in ax.lines}["predicted peak"] == pytest.approx(
        p.peak_bytes / 2**20)


def test_timeline_figure_is_readable_without_the_code(tl) -> None:
    """A title with the step, a legend naming each phase and stream, the time axis in ms, the end of the forward
    named, module names on the slices wide enough, and no slice thinner than MIN_SLICE_FRACTION of the step."""
    from treadle.viz.png import MIN_SLICE_FRACTION

    (ax,) = timeline_figure(tl).axes
    assert tl.title in ax.get_title() and f"{tl.step_s * 1e3:.4g} ms" in ax.get_title()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["forward", "backward", "recompute", "comm dp (collectives)", "comm dp+tp (collectives)"]
    assert ax.get_xlabel() == "time in the step (ms)"
    texts = [t.get_text() for t in ax.texts]
    assert "\u2190 forward | backward \u2192" in texts
    assert {"emb", "head"} <= set(texts) and any(t.startswith("attn") for t in texts)  # module names on slices
    widths = [w for c in ax.collections for p in c.get_paths() for w in [p.get_extents().width]]
    assert min(widths) >= MIN_SLICE_FRACTION * tl.step_s * 1e3 * (1 - 1e-6)


def test_a_short_collective_is_drawn_wide_enough_to_see() -> None:
    from treadle.viz.png import MIN_SLICE_FRACTION
    from treadle.viz.timeline import COMPUTE, Span, Timeline

    spans = [Span(COMPUTE, "a", 0.0, 1.0, "forward", 1.0), Span("comm tp", "all_reduce a", 0.5, 1e-6, "forward", 0.0)]
    tiny = Timeline("t", spans, [COMPUTE, "comm tp"], 1.0, 1.0, [], 0.0, None, 2, {})
    (ax,) = timeline_figure(tiny).axes
    (comm,) = [c for c in ax.collections][1].get_paths()
    assert comm.get_extents().width == pytest.approx(MIN_SLICE_FRACTION * 1e3)
