"""Pipeline parallelism — stages cut from a sequential container, run by `torch.distributed.pipelining`'s schedules
over a ``pp`` mesh axis — as one parallel form.

How a user states it: ``sch[block].cut_pipeline_stage()`` and ``sch.pipeline(axis="pp", schedule=...,
n_microbatches=...)``, primitives of the language (`treadle.schedule.graph_primitives`); what build installs is
`treadle.runtime.pipeline` (the stage capture and runner). Here:

- `facts.py`     the action order each schedule class runs, the stage of each rank and of each rehearsed record;
- `timeline.py`  the step's timeline from that order (NOTE [pipeline timeline]);
- `price.py`     the price of a pipelined step (NOTE [pipeline price]), the `price_schedule` face.
"""

from __future__ import annotations

from ...form import Form
from .price import price_pipeline


class PipelineForm(Form):
    """The faces of pipeline parallelism (each delegates to the module that holds it)."""

    name = "pipeline"

    def price_schedule(self, sch, example_inputs, cluster, options):
        return price_pipeline(sch, example_inputs, cluster, options)


FORM = PipelineForm()
BUILD_STEPS: dict = {}  # the stage capture and runner register themselves in treadle.runtime.pipeline
