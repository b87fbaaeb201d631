"""Expert parallelism — a mixture-of-experts layer's experts split over a data-parallel mesh axis, tokens sent to
their experts' ranks and back by all-to-all — as one parallel form.

How a user states it: ``sch["model.layers.0.mlp.experts"].expert_parallel(axis="dp")``, a primitive of the
language (`treadle.schedule.expert_primitive` checks and records it), or the recipe step `expert_parallel_moe`
for every experts module of a model. Everything else is here:

- `facts.py`     which modules are experts modules, by structure (found once, for the recipe and the price);
- `dispatch.py`  the token dispatch and combine build installs (NOTE [expert dispatch]);
- `runtime.py`   the build steps (the local forward, the experts' gradients: NOTE [expert gradients]);
- `steps.py`     the recipe step;
- `price.py`     its part of a priced step: the all-to-alls and the local experts' memory (`treadle.pricing`).
"""

from __future__ import annotations

from ...form import Form
from ...schedule.expert_primitive import expert_param_names
from .runtime import plan_experts
from .steps import expert_parallel_moe


class ExpertParallelForm(Form):
    """The faces of expert parallelism."""

    name = "expert"

    def own_params(self, model, view):
        return expert_param_names(model, view.extras)  # NOTE [expert gradients]


FORM = ExpertParallelForm()
BUILD_STEPS = {"pre_shard": plan_experts}
__all__ = ["FORM", "BUILD_STEPS", "expert_parallel_moe"]
