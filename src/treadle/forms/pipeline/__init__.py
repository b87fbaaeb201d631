"""Pipeline parallelism — stages cut from a sequential container, run by `torch.distributed.pipelining`'s schedules
over a ``pp`` mesh axis — as one parallel form.

How a user states it: ``sch[block].cut_pipeline_stage()`` and ``sch.pipeline(axis="pp", schedule=...,
n_microbatches=...)``, primitives of the language (`treadle.schedule.graph_primitives`). Here:

- `stages.py`    the model captured by need on one micro-batch and split into stage graphs ("pre_shard" step);
- `runtime.py`   what `build` installs: the local stages under the data parallelism, the schedule that runs
                 them, `PipelineModel` ("wrap" step);
- `facts.py`     the action order each schedule class runs, the stage of each rank and of each rehearsed record;
- `fsdp.py`      FSDP2 beside the pipeline: when each stage is gathered, held and reduced (NOTE [pipeline FSDP2]);
- `timeline.py`  the step's timeline from that order (NOTE [pipeline timeline]);
- `price.py`     the price of a pipelined step (NOTE [pipeline price]), the `price_schedule` face.
"""

from __future__ import annotations

from ...form import Form
from .price import price_pipeline
from .runtime import wrap_pipeline
from .stages import capture_root


class PipelineForm(Form):
    """The faces of pipeline parallelism (each delegates to the module that holds it)."""

    name = "pipeline"

    def price_schedule(self, sch, example_inputs, cluster, options):
        return price_pipeline(sch, example_inputs, cluster, options)


FORM = PipelineForm()
BUILD_STEPS = {"pre_shard": capture_root, "wrap": wrap_pipeline}
