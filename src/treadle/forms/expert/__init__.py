"""Expert parallelism — a mixture-of-experts layer's experts split over a data-parallel mesh axis (or the flattened
group of several), tokens sent to their experts' ranks and back by all-to-all — as one parallel form.

How a user states it: ``sch["model.layers.0.mlp.experts"].expert_parallel(axis="dp")``, a primitive of the
language (`treadle.schedule.expert_primitive` checks and records it), or the recipe step `expert_parallel_moe`
for every experts module of a model. Everything else is here:

- `facts.py`     which modules are experts modules, by structure (found once, for the recipe and the price),
                 and how FSDP2 shards them (NOTE [experts under FSDP2]);
- `dispatch.py`  the token dispatch and combine build installs (NOTE [expert dispatch]; experts that take E groups
                 of rows: `DenseExpertLeaf`, NOTE [dense experts]);
- `runtime.py`   the build steps (the local forward, the experts' gradients: NOTE [expert gradients]);
- `steps.py`     the recipe step;
- `plan.py`      the planner's role option, the experts' memory and exchanges in the cost graph, the decisions
                 (NOTE [experts in the plan]).
Its price needs no face of its own: the rehearsed step issues its exchanges (NOTE [expert load in a rehearsal]).
"""

from __future__ import annotations

from ...form import Form, ShardUnit
from ...schedule.expert_primitive import expert_param_names, expert_paths
from . import plan as _plan
from .facts import expert_fsdp
from .runtime import plan_experts
from .steps import expert_parallel_moe


class ExpertParallelForm(Form):
    """The faces of expert parallelism."""

    name = "expert"

    def own_params(self, model, view):  # NOTE [expert gradients]; FSDP2's units: NOTE [experts under FSDP2]
        fsdp = {p for p, axis in expert_paths(view.extras).items() if expert_fsdp(view, axis)[0]}
        return {n for n in expert_param_names(model, view.extras) if n.rpartition(".")[0] not in fsdp}

    def shard_units(self, model, view):  # NOTE [experts under FSDP2]
        out = []
        for path, axis in sorted(expert_paths(view.extras).items()):
            shard, rep = expert_fsdp(view, axis)
            if shard:
                out.append(ShardUnit(path, shard, rep))
        return out

    def capture_facts(self, model):
        return _plan.capture_facts(model)

    def param_placements(self, facts, param, module, n_tp):
        return _plan.param_placements(facts, param, module, n_tp)

    def role_options(self, mesh, live, *, batch, request):
        return _plan.role_options(mesh, live, batch=batch, request=request)

    def keep_roles(self, options):
        return _plan.keep_roles(options)

    def role_label(self, roles):
        return _plan.role_label(roles)

    def prepare(self, b):
        _plan.prepare(b)

    def keep_strategy(self, b, n, spec, combo):
        return _plan.keep_strategy(b, n, spec, combo)

    def node_cost(self, b, n, combo, pub, cost, rec):
        _plan.node_cost(b, n, combo, pub, cost, rec)

    def graph_terms(self, b, cg):
        _plan.graph_terms(b, cg)

    def decide_node(self, ctx, i, n, combo, raw, pub):
        return _plan.decide_node(ctx, i, n, combo, raw, pub)

    def decisions(self, cg, choice, ckpt, ctx):
        return _plan.decisions(cg, choice, ckpt, ctx)


FORM = ExpertParallelForm()
BUILD_STEPS = {"pre_shard": plan_experts}
__all__ = ["FORM", "BUILD_STEPS", "expert_parallel_moe"]
