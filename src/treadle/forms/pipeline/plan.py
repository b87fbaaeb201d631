"""Pipeline parallelism in the planner: the role option (a pp axis, its schedule and micro-batch count), the stage
cuts, and one MILP per cut that chooses every op's sharding jointly with each stage's checkpoint counts under each
pp rank's memory, minimising the pipelined step (NOTE [pipeline in the plan]); the decisions that state it.

NOTE [pipeline in the plan]: a role assignment with ``Roles.pp = a`` runs the model's repeated blocks (the largest
sequential container, `capture_facts`) as S = p v contiguous stages over the p ranks of axis `a`, v stages a rank
as torch places them (`conflicts.stage_rank`: a loop, stage s on rank s mod p, for "1f1b" (v = 1), "interleaved_1f1b"
and "interleaved_zb" (v = 2); a V for "zbv" and "dualpipev" (v = 2), rank r holding stages r and 2p - 1 - r), over M
micro-batches. The cost graph is built on one micro-batch (its batch divisor is the replicas times M), so every
strategy's cost is per micro-batch, and every stage runs the same sharding of each block template (a plan states
a template's layout once; checkpoints are per stage). The ops before the first block (embeddings) run on stage 0,
those after the last (final norm, head, loss) on stage S - 1.

The cuts are not a variable of the MILP: stage time is the sum over its blocks of a per-block cost that the MILP
chooses, so a variable cut would multiply two variables. `cuts.partitions` proposes, each exact by dynamic
programming over the blocks' costs under their cheapest strategies (embeddings and head included): the cut that
minimises the largest stage's time; under a budget, the fastest whose stages' memory lower bounds fit (a stage's
blocks' static bytes and saved bytes times the micro-batches it keeps in flight: 1F1B's first stages keep the most,
so they get fewer blocks) and the one that minimises the largest stage's memory; and the even cut. The MILP is
solved for each (and each schedule of `SCHEDULES` that build runs with the role assignment: `kinds._runs`) and the
fastest kept. Held to every contiguous cut
solved exhaustively on small cases (tests/test_pipeline_plan.py: 6 and 8 blocks over 4 stages, two block types,
three budgets) it finds the best cut in 11 of 12, and one 2.3% slower than the best in the last (6 GELU blocks at
60% of the free peak, where the best cut balances memory and time at once). For a fixed cut everything is linear:

    T_s = sum_u n_s(u) sum_k (compute - optimizer + comm)[u,k] s[u,k]        (per micro-batch, F + B)
          + sum_t sum_b 2^b (zF[t,s,b] + host_t y[t,s,b])                   (stage s's recomputes)
          + the input-gradient sums its units need                           (the tensor form's y, per block)
          - the sequence-parallel gathers' credit                            (the sequence form's z, per block)
          + a split backward's host cost (`cuts.split_host_s`; zero-bubble schedules, stages after the first,
            on the share of the micro-batches whose backward the order splits: all, or DualPipeV's warm-up and
            cool-down)
    R   >= sum_{s on rank r} T_s                                              (pp_rank_time, each rank r)
    Q   >= sum_{s on rank r} sum_u n_s(u) (optimizer + data-parallel sync)[u,k] s[u,k]   (pp_rank_tail)
    step = M R + fill / S sum_s T_s + Q + 2 sum_b send_b + tied

n_s(u) is the number of stage s's blocks that unit u's template stands for (1 for an embedding or head unit on
its stage, 0 elsewhere). `fill` is the schedule's warm-up and cool-down in stage-seconds, timed from the schedule
class's own order (NOTE [the fill of a planned schedule] in `cuts.py`): p - 1 for 1F1B (balanced stages of time t:
(M + p - 1) t, its makespan) and interleaved 1F1B with M >= p ((M v + p - 1) t); about (p - 1)(f + i - w) for the
zero-bubble schedules, whose weight-gradient work w fills the bubbles. An unbalanced cut pays its slowest rank M
times and the fill once. The sends: the first micro-batch's activation crosses every boundary between two ranks
forward and its gradient backward (send_recv_time_s of the block input's bytes on the pp link; a V schedule's
middle boundary is inside a rank); later sends overlap compute (`isend`). Under data parallelism the replicas
average each rank's gradients after the step (blocking: the pipeline's runtime), and each rank steps its own
optimizer: the slowest rank's tail Q. Tied parameters on the first and last stage (embedding and head) sum their
gradients over pp.

Memory, per pp rank r: its stages' parameters, gradients and optimizer state, the fixed bytes (buffers, inputs),
and activations as the schedule keeps them: for every moment of rank r's action order (`facts.action_order`,
torch's own) the micro-batches in flight on each of its stages (forward done, backward not yet), k_s, each holding
A_s = sum_t (n_t,s A_t - sum_b 2^b zA[t,s,b] + sum_b 2^b zI[t,s,b]) + its embedding / head activations; one row
per moment that no other moment dominates (1F1B: stage s keeps min(M, p - s); a split backward holds a micro-batch
until its W), plus the larger of one recomputed block
(pp_transient) and the largest backward working set of its stages' units (pp_working: the last stage's loss on a
large vocabulary; NOTE [a backward's working set] in `treadle.planner.grad_live`). So the first stages, which keep the most micro-batches, checkpoint more; with selective policies
allowed, each stage also weighs running blocks under them (NOTE [checkpoint policies in a pipeline's stages] in
`stage_policies.py`). `evaluate` computes the
same step and peak directly for a choice (the exhaustive oracle `oracle.solve_exhaustive` enumerates it on tiny cases);
`treadle.price` prices the plan as built from the schedule class's own timeline (NOTE [pipeline price]), and the
planner's final choice by price (NOTE [final choice by price]) reads that. ZeRO-3 / HSDP beside the pipeline: NOTE
[pipeline FSDP2 in the plan] in `zero.py` (also without reshard after forward, when `reshard_after_forward` allows it).
The zero-bubble schedules (and DualPipeV, whose order splits some backwards) are weighed where build runs them
(`kinds._runs`): not under ZeRO-3 that reshards after forward, not with a tied embedding and head where a V schedule
puts both on rank 0; and without checkpointed blocks (NOTE [zero-bubble schedules in the plan] in `kinds.py`).
Sequence parallelism inside the stages: each gather whose backward reduce-scatters (NOTE [gather with a
reduce-scatter backward]) is credited on the stages its blocks run in, as the core's objective credits it once; the
vocab-parallel loss is not offered under a pipeline (its loss runs as the model's own ops, traced on the last stage:
`forms.vocab.plan.prepare`; build refuses one stated by hand).
"""

from __future__ import annotations

import inspect

from torch import nn

from ...errors import PlanError
from ...planner.capture import TensorMeta
from ...planner.to_schedule import DECISION_RANKS, Decision
from .facts import action_order
from .cuts import SCHEDULES, PipelineChoice  # noqa: F401  (PipelineChoice: the plan's stages, as data)
from .milp import solve  # noqa: F401  (the form's face)

# ----------------------------------------------------------------------------- capture and roles
def capture_facts(model: nn.Module) -> dict | None:
    """The sequential container (nn.ModuleList / nn.Sequential) with the most elements that hold parameters: the
    blocks a pipeline cuts (`cut_pipeline_stage`), and whether the model's forward takes ``use_cache`` (a KV cache
    it would build inside the blocks, which a pipeline's capture refuses: the plan turns it off); None without
    one."""
    best: tuple[str, int] | None = None
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2 or (not path and m is not model):
            continue
        if sum(1 for c in m if any(True for _ in c.parameters())) < 2:
            continue
        if best is None or len(m) > best[1]:
            best = (path, len(m))
    if best is None:
        return None
    try:
        takes_cache = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_cache = False
    return {"container": best[0], "blocks": best[1], "use_cache": takes_cache}


def _facts(facts) -> dict | None:
    return (facts or {}).get("pipeline")


def microbatch_counts(p: int, batch: int | None) -> list[int]:
    """The micro-batch counts proposed for a pipeline of p ranks: p, 2p, 4p and 8p (1F1B needs at least p), those
    that divide the global batch (a count the replicas' share does not divide is refused by `prepare`)."""
    return [m for m in (p, 2 * p, 4 * p, 8 * p) if batch is None or batch % m == 0]


def role_options(mesh, live: tuple[str, ...], *, batch, request) -> list[dict] | None:
    """No pipeline, or one over a live axis of p >= 2 ranks whose container has at least p v blocks, with each
    proposed schedule (`SCHEDULES`) and micro-batch count (`microbatch_counts`). `request.pp_axis`: "auto" (any
    live axis), None (no pipeline), an axis name (a pipeline over it, nothing else); `request.pp_schedule`,
    `request.pp_microbatches` pin those; `request.pp_cuts` (stage boundaries every pipelined plan keeps) leave the
    schedules whose stage count can keep them. Raises PlanError for a pp axis that is not live, a model without a
    sequential container of blocks, or pins no pipeline meets."""
    want = request.pp_axis
    facts = _facts(request.facts)
    if want is None:
        return None
    if want != "auto":
        if want not in live:
            raise PlanError(f"pipeline axis {want!r} is not a live mesh axis of {mesh}; live axes: {list(live)}")
        if facts is None:
            raise PlanError(f"pipeline axis {want!r}: the model has no sequential container (nn.ModuleList / "
                            f"nn.Sequential) of blocks to cut into stages")
    if facts is None:
        return None
    cuts = tuple(getattr(request, "pp_cuts", ()) or ())
    ends = {f"{facts['container']}.{i}" if facts["container"] else str(i) for i in range(facts["blocks"] - 1)}
    for c in cuts:
        if c not in ends:
            raise PlanError(f"pinned stage boundary {c!r}: not a block of {facts['container']!r} that can end a stage "
                            f"(its blocks 0 .. {facts['blocks'] - 2}: e.g. {sorted(ends)[:1]})")
    kinds = {k: v for k, v in SCHEDULES.items() if getattr(request, "pp_schedule", None) in (None, k)}
    if getattr(request, "pp_schedule", None) not in (None, *SCHEDULES):
        raise PlanError(f"pipeline schedule {request.pp_schedule!r}: the planner plans {sorted(SCHEDULES)}")
    pinned = getattr(request, "pp_schedule", None)
    out: list[dict] = [] if want != "auto" else [{}]
    for a in (live if want == "auto" else (want,)):
        p = mesh.size(a)
        if p < 2 or not any(facts["blocks"] >= p * v and len(cuts) < p * v for v in kinds.values()):
            continue
        counts = ([request.pp_microbatches] if getattr(request, "pp_microbatches", None)
                  else microbatch_counts(p, batch))
        out += [{"pp": a, "pp_schedule": pinned, "pp_microbatches": m, "pp_cuts": cuts} for m in counts]
    if want != "auto" and not out:
        raise PlanError(f"pipeline axis {want!r}: {facts['blocks']} blocks in {facts['container']!r} do not make "
                        f"{mesh.size(want)} stages a rank's worth of a planned schedule, or the batch {batch} does not "
                        f"split into its micro-batches, or {len(cuts)} pinned boundaries need more stages")
    return out


def keep_roles(options: dict) -> bool:
    """The pipeline axis is not also data-parallel (ZeRO-3 / HSDP beside it with or without reshard after forward:
    NOTE [pipeline FSDP2 in the plan]; the local experts' own units included)."""
    pp = options.get("pp")
    return not pp or pp not in options.get("dp", ())


def role_label(roles) -> str | None:
    if roles.pp is None:
        return None
    kind = f"{roles.pp_schedule}, " if roles.pp_schedule else ""
    return f"pipeline {roles.pp} ({kind}{roles.pp_microbatches} micro-batches)"


def _blocks(b) -> list[str]:
    return [mb for blk in b.g.blocks for mb in blk.members]


def prepare(b) -> None:
    """Under a pp axis: the batch must split into replicas x micro-batches, the blocks must be the container's
    (the stages cut it), and the schedule must take the micro-batch count. Raises PlanError saying which."""
    roles = b.roles
    if roles.pp is None:
        return
    facts = _facts(b.g.facts)
    m = roles.pp_microbatches
    for n in b.nodes:
        if n.kind == "input" and isinstance(n.out, TensorMeta) and n.out.shape and n.out.shape[0] % b.dp_size:
            raise PlanError(f"pipeline over {roles.pp!r}: input {n.name!r} of batch {n.out.shape[0]} does not split "
                            f"into {b.dp_size // m} replicas x {m} micro-batches")
    if facts is None or not b.g.blocks:
        raise PlanError(f"pipeline over {roles.pp!r}: the capture found no repeated blocks to cut into stages")
    container = facts["container"]
    outside = [mb for blk in b.g.blocks for mb in blk.members if mb.rpartition(".")[0] != container]
    if outside:
        raise PlanError(f"pipeline over {roles.pp!r}: repeated blocks {outside[:2]} are outside the container "
                        f"{container!r} the stages cut")
    p = b.cluster.mesh.size(roles.pp)
    kinds = [roles.pp_schedule] if roles.pp_schedule else list(SCHEDULES)
    fits = [k for k in kinds if len(roles.pp_cuts) < p * SCHEDULES[k] <= len(_blocks(b))]
    if not fits:
        raise PlanError(f"pipeline over {roles.pp!r}: {len(_blocks(b))} blocks make no {kinds} stages of {p} ranks "
                        f"keeping {len(roles.pp_cuts)} pinned boundaries")
    action_order(fits[0], p * SCHEDULES[fits[0]], p, m)  # raises PlanError where torch refuses the count


# ----------------------------------------------------------------------------- decisions
def input_spec(cg) -> dict:
    """The model's example inputs as a spec (shapes and dtypes of the whole batch), from the capture."""
    return {n.name: {"shape": list(n.out.shape), "dtype": str(n.out.dtype).removeprefix("torch.")}
            for n in cg.graph.nodes if n.kind == "input" and isinstance(n.out, TensorMeta)}


def decisions(cg, choice, ckpt, ctx) -> list:
    """``cut_pipeline_stage`` after each stage's last block, ``pipeline(axis, schedule, n_microbatches,
    example_inputs, target)`` (the labels, where the model reads them, go to the last stage; ``use_cache=False``
    where the forward takes it, as training runs without a KV cache) and each stage's checkpointed blocks (fully,
    or under a selective policy)."""
    sp: PipelineChoice | None = ctx.memo.get("stages")
    if cg.roles.pp is None or sp is None:
        return []
    out = []
    for s, blocks in enumerate(sp.blocks[:-1]):
        out.append((DECISION_RANKS["cut_pipeline_stage"], blocks[-1],
                    Decision("cut_pipeline_stage", blocks[-1], {}, f"stage {s} ends ({len(blocks)} blocks)")))
    spec = input_spec(cg)
    if (_facts(cg.graph.facts) or {}).get("use_cache") and "use_cache" not in spec:
        spec["use_cache"] = False  # no KV cache in training (the pipeline's capture refuses one built in a block)
    args = {"axis": sp.axis, "schedule": sp.schedule, "n_microbatches": sp.n_microbatches, "example_inputs": spec}
    if "labels" in spec:
        args["target"] = "labels"
    out.append((DECISION_RANKS["pipeline"], "", Decision("pipeline", "", args, f"{sp.n_stages} stages over {sp.axis} "
                                                                            f"(NOTE [pipeline in the plan])")))
    for s, paths in enumerate(sp.checkpointed):
        for path in paths:
            out.append((DECISION_RANKS["checkpoint"], path,
                        Decision("checkpoint", path, {}, f"{len(paths)} of stage {s}'s {len(sp.blocks[s])} blocks")))
    for s, kept in enumerate(sp.policies):  # NOTE [checkpoint policies in a pipeline's stages] in stage_policies.py
        for path, policy in kept:
            n = sum(1 for _, p_ in kept if p_ == policy)
            out.append((DECISION_RANKS["checkpoint"], path,
                        Decision("checkpoint", path, {"policy": policy},
                                 f"{n} of stage {s}'s {len(sp.blocks[s])} blocks, policy {policy}")))
    return out
