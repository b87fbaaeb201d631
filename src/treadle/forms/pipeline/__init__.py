"""Pipeline parallelism — stages cut from a sequential container, run by `torch.distributed.pipelining`'s schedules
over a ``pp`` mesh axis — as one parallel form.

How a user states it: ``sch[block].cut_pipeline_stage()`` and ``sch.pipeline(axis="pp", schedule=...,
n_microbatches=...)``, primitives of the language (`treadle.schedule.graph_primitives`). Here:

- `stages.py`    the model captured by need on one micro-batch and split into stage graphs ("pre_materialize"
                 step);
- `meta.py`      a model made on meta: the capture on stand-ins, the modules a rank never runs (NOTE [pipeline
                 on meta]);
- `runtime.py`   what `build` installs: the local stages under the data parallelism, the schedule that runs
                 them, `PipelineModel` ("wrap" step);
- `facts.py`     the action order each schedule class runs, the stage of each rank and of each rehearsed record;
- `fsdp.py`      FSDP2 beside the pipeline: when each stage is gathered, held and reduced (NOTE [pipeline FSDP2]);
- `timeline.py`  the step's timeline from that order (NOTE [pipeline timeline]);
- `price.py`     the price of a pipelined step (NOTE [pipeline price]), the `price_schedule` face;
- `plan.py`      the planner's pipeline role and its decisions (NOTE [pipeline in the plan]);
- `cuts.py`      the stages of a cost graph, the cuts proposed, the micro-batches in flight, each schedule's fill;
- `kinds.py`     which schedules a role assignment weighs (NOTE [zero-bubble schedules in the plan]);
- `milp.py`      the MILP of a pipelined step, per cut (the proposed ones, then their neighbours: NOTE [cuts
                 beside the proposed ones]), with its direct evaluation; `oracle.py` its exhaustive test oracle;
- `floors.py`    lower bounds that skip cuts and role assignments no plan of which can win or fit;
- `zero.py`      ZeRO-3 / HSDP beside a planned pipeline (NOTE [pipeline FSDP2 in the plan]).
"""

from __future__ import annotations

from ...form import Form
from . import plan as _plan
from .floors import memory_floor
from .kinds import price_variants
from .moments import tied_terms
from .price import price_pipeline
from .runtime import wrap_pipeline
from .stages import capture_root


class PipelineForm(Form):
    """The faces of pipeline parallelism (each delegates to the module that holds it)."""

    name = "pipeline"

    def capture_facts(self, model):
        return _plan.capture_facts(model)

    def role_options(self, mesh, live, *, batch, request):
        return _plan.role_options(mesh, live, batch=batch, request=request)

    def keep_roles(self, options):
        return _plan.keep_roles(options)

    def role_label(self, roles):
        return _plan.role_label(roles)

    def prepare(self, b):
        _plan.prepare(b)

    def graph_terms(self, b, cg):
        tied_terms(b, cg)

    def solve(self, cg, *, budget_bytes, checkpoint, time_limit_s, rel_gap, min_ckpt, minimise, cutoff_s=None):
        return _plan.solve(cg, budget_bytes=budget_bytes, checkpoint=checkpoint, time_limit_s=time_limit_s,
                           rel_gap=rel_gap, min_ckpt=min_ckpt, minimise=minimise, cutoff_s=cutoff_s)

    def price_variants(self, cg, sol):
        return price_variants(cg, sol)

    def memory_floor(self, ft):
        return memory_floor(ft)

    def decisions(self, cg, choice, ckpt, ctx):
        return _plan.decisions(cg, choice, ckpt, ctx)

    def price_schedule(self, sch, example_inputs, cluster, options):
        return price_pipeline(sch, example_inputs, cluster, options)


FORM = PipelineForm()
BUILD_STEPS = {"pre_materialize": capture_root, "wrap": wrap_pipeline}
