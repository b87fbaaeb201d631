"""Write the pictures the CLI's --trace / --html / --png flags ask for (one call per command), and compare a
measured trace with the predicted step."""

from __future__ import annotations

from .chrome import write_chrome_trace
from .plan_timeline import timeline_from_plan
from .timeline import Timeline


def write_plan_pictures(plan, *, trace: str | None = None, html: str | None = None,
                        png: str | None = None, measured: dict | None = None) -> list[str]:
    """Write the predicted step of `plan` as a Chrome trace (`trace`), an HTML report (`html`) and PNG
    figures (`png` prefix: PREFIX-memory.png, -breakdown.png, -timeline.png). `measured`: a `measured_trace`
    document whose steps the HTML report shows beside the predicted one. Returns the paths written.
    Raises ImportError (naming the `viz` extra) for `png` without matplotlib, before writing anything."""
    if png:
        from .png import require_matplotlib

        require_matplotlib()  # fail before any file is written
    tl = timeline_from_plan(plan)
    out: list[str] = []
    if trace:
        out.append(write_chrome_trace(tl, trace))
    if html:
        from .html import plan_html

        from .measured import step_times_s

        with open(html, "w") as f:
            f.write(plan_html(plan, timeline=tl, measured_s=step_times_s(measured) if measured else None))
        out.append(html)
    if png:
        from .png import save_plan_pngs

        out += save_plan_pngs(tl, png)
    return out


def write_price_pictures(price, *, trace: str | None = None, html: str | None = None, png: str | None = None,
                         title: str = "", world_size: int | None = None,
                         measured_pipeline: dict | None = None) -> list[str]:
    """Write the step of a `treadle.pricing.Price` (or its to_dict()) as a Chrome trace, an HTML page
    and PNG figures (as `write_plan_pictures`). `measured_pipeline`: a pipeline's measured step (the
    ``otherData.measured_pipeline`` of ``treadle.run --trace``'s ``-pipeline`` file), drawn beside the predicted
    one: the trace's second process, the page's second timeline with a table of both. Returns the paths written."""
    from .price_timeline import timeline_from_price

    if png:
        from .png import require_matplotlib

        require_matplotlib()
    tl = timeline_from_price(price, title=title or None, world_size=world_size)
    mtl = None
    if measured_pipeline is not None:
        from .pipeline_timeline import pipeline_compare_rows, timeline_from_measured_pipeline

        p = price if isinstance(price, dict) else price.to_dict()
        pipeline_compare_rows(p, measured_pipeline)  # the same pipeline, else ValueError before anything is written
        mtl = timeline_from_measured_pipeline(measured_pipeline)
    out: list[str] = []
    if trace:
        if mtl is None:
            out.append(write_chrome_trace(tl, trace))
        else:
            import json

            from .chrome import chrome_trace, merge_chrome_traces

            doc = merge_chrome_traces([chrome_trace(tl), chrome_trace(mtl, process="treadle measured step")])
            with open(trace, "w") as f:
                json.dump(doc, f)
            out.append(trace)
    if html:
        from .html import price_html

        with open(html, "w") as f:
            f.write(price_html(price, timeline=tl, title=title, measured_pipeline=measured_pipeline))
        out.append(html)
    if png:
        from .png import save_plan_pngs

        out += save_plan_pngs(tl, png)
    return out


def write_profile_pictures(prof, *, trace: str | None = None, html: str | None = None, png: str | None = None,
                           depth: int = 2) -> list[str]:
    """Write a profile's op-level Chrome trace (`trace`), HTML report (`html`) and memory figure (`png`
    prefix). Returns the paths written."""
    out: list[str] = []
    if png:
        from .png import require_matplotlib

        require_matplotlib()
    if trace:
        from .profile_timeline import timeline_from_profile

        out.append(write_chrome_trace(timeline_from_profile(prof), trace))
    if html:
        from .html import profile_html

        with open(html, "w") as f:
            f.write(profile_html(prof, depth=depth))
        out.append(html)
    if png:
        from .png import save_profile_png

        out += save_profile_png(prof, png)
    return out


def compare_lines(tl: Timeline, measured_doc: dict) -> list[str]:
    """Predicted step vs the steps of a `measured_trace` file, as text lines."""
    from .measured import step_times_s

    steps = step_times_s(measured_doc)
    if not steps:
        return ["measured trace: no 'treadle step <i>' ranges (write it with treadle.viz.measured_trace)"]
    ratio = f" (fastest / predicted = {min(steps) / tl.step_s:.2f}x)" if tl.step_s > 0 else ""
    return [f"predicted step {tl.step_s * 1e3:.3f} ms; measured {len(steps)} step(s): "
            + ", ".join(f"{s * 1e3:.3f} ms" for s in steps) + ratio]
