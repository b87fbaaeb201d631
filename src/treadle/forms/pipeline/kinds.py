"""Which schedules the planner weighs for a pipeline role assignment (NOTE [pipeline in the plan] in `plan.py`):
those of `cuts.SCHEDULES` whose stage count the blocks and pinned boundaries allow, that build runs with the role
assignment, and whose class takes the micro-batch count; and where the zero-bubble ones are weighed."""

from __future__ import annotations

from dataclasses import replace as dc_replace

from ...errors import PlanError
from ...planner.capture import TensorMeta
from .conflicts import SPLIT_BACKWARD, shared_stage_conflict, split_backward_conflict, stage_rank
from .moments import tied_params
from .cuts import SCHEDULES
from .facts import action_order
from .zero import zero_terms

# NOTE [zero-bubble schedules in the plan]: the split-backward schedules (interleaved_zb, zbv; dualpipev, whose
# order splits the warm-up's and cool-down's backwards) are weighed with or
# without a memory budget, without checkpointed blocks (so not where checkpoints are required, nor when the smallest
# peak is sought). Measured on gloo
# (bench/bench_pipeline_plans.py --budget, tiny LLaMA, PP2 x DP2 at 0.6x the free peak): the planner's interleaved_zb
# plan with checkpointed blocks ran 1.80x its price, where every other schedule's plan ran 0.78-1.01x: torch's split
# backward runs a checkpointed block's forward again for the weight gradients (counted: a checkpointed module's
# forward runs twice under `stage_backward`, three times under `stage_backward_input` then `stage_backward_weight`;
# the price now times it in W). Without checkpoints, the memory a split backward holds was not priced within 5%, and
# they were weighed only without a budget
# (the last stage's graph lived to the step's end: NOTE [a split backward's memory] in price.py); now rank 0's saved
# bytes and the output gradients each I holds for its W (PP2 on 2 gloo ranks, tiny LLaMA,
# `bench/bench_pipeline_memory.py`) measure 1.00x / 1.11x the price for interleaved ZB over 2 / 8 micro-batches and
# 0.95x / 0.99x for ZBV, 1F1B and interleaved 1F1B 0.98-1.02x.


def price_variants(cg, sol) -> list[tuple[object, bool]]:
    """The role assignment of `cg` pinned to each schedule its solve weighed (`PipelineChoice.weighed`), as
    (cost graph, whether `sol` runs that schedule); [] where the schedule was pinned or only one was weighed (NOTE
    [each schedule priced on its own] in `treadle.planner.candidates`). The cost graph is the same: a strategy's
    cost is per micro-batch whatever the schedule, which only the pipeline's own solve reads."""
    stages = getattr(sol, "stages", None)
    if cg.roles.pp is None or cg.roles.pp_schedule is not None or stages is None or len(stages.weighed) < 2:
        return []
    return [(dc_replace(cg, roles=dc_replace(cg.roles, pp_schedule=kind)), kind == stages.schedule)
            for kind in stages.weighed]


def _tied_bytes(cg) -> int:
    """Bytes of the parameters both the first and the last stage read (a tied embedding and head: `tied_params`)."""
    tied = tied_params(cg)
    return sum(n.out.nbytes for n in cg.graph.nodes
               if n.kind == "param" and n.param in tied and isinstance(n.out, TensorMeta))


def schedules(cg) -> list[str]:
    """The schedules the pipeline solve weighs for a role assignment: the pinned one, else every one of `SCHEDULES`
    whose stage count the blocks and the pinned boundaries allow and whose class takes the micro-batch count."""
    return [kind for kind in _stage_counts_allow(cg) if _torch_takes(cg, kind)]


def _stage_counts_allow(cg) -> list[str]:
    """`schedules` without torch's check of the micro-batch count (`_torch_takes`)."""
    roles = cg.roles
    p = cg.cluster.mesh.size(roles.pp)
    n = sum(info.count for info in cg.templates.values())
    return [kind for kind in ([roles.pp_schedule] if roles.pp_schedule else list(SCHEDULES))
            if len(roles.pp_cuts) < p * SCHEDULES[kind] <= n and _runs(cg, kind)]


def _runs(cg, kind: str) -> bool:
    """Whether `build` runs `kind` with this role assignment, by the checks build makes (`conflicts.py`): not a split
    backward under ZeRO-3 that reshards after forward, and not two stages of one rank reading one parameter (a tied
    embedding and head on the first and last stage, which the V schedules put on rank 0) under a split backward or
    under data parallelism. Raises PlanError, build's reason, where the schedule is pinned and its stages share a
    parameter (no role assignment runs it)."""
    zt = zero_terms(cg)
    if kind in SPLIT_BACKWARD and zt is not None and zt.reshard:
        return False
    p = cg.cluster.mesh.size(cg.roles.pp)
    S = p * SCHEDULES[kind]
    if not (kind in SPLIT_BACKWARD or cg.roles.dp) or stage_rank(kind, 0, p) != stage_rank(kind, S - 1, p):
        return True  # (the tie check reads the graph: only where the two stages share a rank)
    readers = [("the tied embedding and head", {0, S - 1})] if _tied_bytes(cg) else []
    why = split_backward_conflict(kind, p, readers)
    if why and cg.roles.pp_schedule == kind:
        raise PlanError(f"pipeline: {why}")
    return not why and not (cg.roles.dp and shared_stage_conflict(kind, p, readers, "/".join(cg.roles.dp)))


def _torch_takes(cg, kind: str) -> bool:
    """Whether torch's schedule class takes the micro-batch count (building its order, remembered per process: the
    floors and the fill read it too)."""
    p = cg.cluster.mesh.size(cg.roles.pp)
    try:
        action_order(kind, p * SCHEDULES[kind], p, cg.roles.pp_microbatches)
    except PlanError:
        return False
    return True
