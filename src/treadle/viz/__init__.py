"""Pictures of plans and profiles in the tools people already open: Chrome-trace / Perfetto timelines,
self-contained HTML reports, and (with the optional `viz` extra, matplotlib) PNG figures.

    tl = timeline_from_plan(plan)                  # slices + memory of the predicted step (its price)
    tl = timeline_from_price(price(sch, inputs, cluster))  # any schedule, as treadle.price models it
    write_chrome_trace(tl, "step.json")            # open in https://ui.perfetto.dev or chrome://tracing
    open("report.html", "w").write(plan_html(plan))
"""

from .chrome import chrome_trace, validate_chrome_trace, write_chrome_trace
from .costs import CommCost, MemoryTotals, ModuleCosts, StepCosts, costs_from_plan
from .price_timeline import timeline_from_price
from .profile_timeline import timeline_from_profile
from .plan_timeline import timeline_from_plan
from .timeline import MemoryPoint, Span, Timeline, timeline_from_costs

__all__ = ["Span", "MemoryPoint", "Timeline", "timeline_from_costs", "timeline_from_plan", "CommCost",
           "ModuleCosts", "MemoryTotals", "StepCosts", "costs_from_plan", "chrome_trace", "write_chrome_trace",
           "validate_chrome_trace", "timeline_from_profile", "timeline_from_price"]
