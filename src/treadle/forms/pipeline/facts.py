"""What a pipeline runs, stated once: the order of each rank's actions as `torch.distributed.pipelining`'s schedule
classes run them, which rank holds which stage, and which records of a rehearsed step belong to which stage.

NOTE [pipeline action order]: a multi-stage schedule's order is not re-derived here. `action_order` asks the
schedule class that `build` uses (or any other multi-stage one of `torch.distributed.pipelining`'s) for its
``pipeline_order`` — the per-rank list of actions its runtime executes, computed in its constructor — on
stand-in stage objects that carry only the stage's index,
the stage count and the pp group's size and rank; the compute actions are kept in order (F forward, B full
backward, I input-gradient backward, W weight-gradient backward; an overlapped F+B action is its parts in
order) and the communication, reduce-grad and idle slots dropped (the timeline derives the waits itself).
GPipe and 1F1B run a loop of their own, written out as that loop runs (`_single_stage_order`). A
stage's rank is the rank whose list computes it (loop placement for GPipe / 1F1B / interleaved, V placement
for the zero-bubble V schedules).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

from ...errors import PlanError
from .runtime import SCHEDULE_CLASSES  # schedule name -> the class build runs (one table)

SINGLE_STAGE = ("gpipe", "1f1b")  # one stage per rank
COMPUTE = ("F", "B", "I", "W")


@dataclass(frozen=True, slots=True)
class Action:
    """One compute action of a pipeline: `kind` F / B / I / W of `stage` on micro-batch `mb`."""

    stage: int
    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def action_order(schedule: str, n_stages: int, pp: int, n_microbatches: int) -> dict[int, list[Action]]:
    """Rank of the pp group -> its compute actions in the order the schedule class runs them (NOTE [pipeline
    action order]). Raises PlanError for an unknown schedule, a stage count the schedule cannot place on `pp`
    ranks, or a micro-batch count it refuses (its own message). A function of its four integers and torch's
    schedule classes only: remembered per process (the planner asks it for every candidate cut), each call
    returns lists of its own."""
    return {r: list(acts) for r, acts in _action_order(schedule, n_stages, pp, n_microbatches)[0].items()}


def overlap_pairs(schedule: str, n_stages: int, pp: int, n_microbatches: int) -> dict[Action, Action]:
    """The forward of each overlapped (forward, backward) pair of the schedule class's order (DualPipeV's
    OVERLAP_F_B) -> the backward run with it, after which torch sends that forward's output: its runtime runs the
    pair as one action and issues both parts' sends when the pair ends (NOTE [an overlapped pair's sends] in
    `timeline.py`). Empty for a schedule without pairs."""
    return dict(_action_order(schedule, n_stages, pp, n_microbatches)[1])


@functools.lru_cache(maxsize=256)
def _action_order(schedule: str, n_stages: int, pp: int, n_microbatches: int
                  ) -> tuple[dict[int, tuple[Action, ...]], tuple[tuple[Action, Action], ...]]:
    from torch.distributed.pipelining import schedules as torch_schedules

    if schedule not in SCHEDULE_CLASSES:
        raise PlanError(f"pipeline price: unknown schedule {schedule!r}; known: {sorted(SCHEDULE_CLASSES)}")
    if n_stages < 1 or pp < 1 or n_stages % pp:
        raise PlanError(f"pipeline price: {n_stages} stages do not spread evenly over {pp} pp ranks")
    if schedule in SINGLE_STAGE and n_stages != pp:
        raise PlanError(f"pipeline price: schedule {schedule!r} runs one stage per rank; {n_stages} stages on {pp} "
                        f"ranks need a multi-stage schedule (interleaved_1f1b, ...)")
    if schedule in SINGLE_STAGE:
        return {r: tuple(_single_stage_order(schedule, r, n_stages, n_microbatches)) for r in range(pp)}, ()
    cls = getattr(torch_schedules, SCHEDULE_CLASSES[schedule])
    from torch import nn

    def stand_in(i: int) -> SimpleNamespace:  # what the constructors read of a stage
        return SimpleNamespace(num_stages=n_stages, group_size=pp, group_rank=0, stage_index=i, is_first=i == 0,
                               is_last=i == n_stages - 1, submod=nn.Identity())

    if not issubclass(cls, torch_schedules.PipelineScheduleSingle):
        # the order only: a constructor computes `pipeline_order`, then lowers it with its sends, receives and
        # FSDP2 unshards for its runtime (`_prepare_schedule_with_comms`: seconds for hundreds of stages, and not
        # read here), which this subclass of the very class skips
        cls = type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": lambda self, *a, **k: None})
    try:
        if issubclass(cls, torch_schedules.PipelineScheduleSingle):
            sched = cls(stand_in(0), n_microbatches)
        else:
            sched = cls([stand_in(i) for i in range(n_stages // pp)], n_microbatches)
    except (ValueError, RuntimeError, AssertionError) as exc:
        raise PlanError(f"pipeline price: {SCHEDULE_CLASSES[schedule]} with {n_stages} stages on {pp} ranks and "
                        f"{n_microbatches} micro-batches: {exc}") from exc
    order = sched.pipeline_order
    if order is None:
        raise PlanError(f"pipeline price: {SCHEDULE_CLASSES[schedule]} states no action order")
    out: dict[int, tuple[Action, ...]] = {}
    pairs: list[tuple[Action, Action]] = []
    for rank in range(pp):
        acts: list[Action] = []
        for a in order.get(rank, []):
            if a is None:
                continue
            parts = [Action(x.stage_index, x.computation_type.value, x.microbatch_index)
                     for x in (a.sub_actions or (a,)) if x.computation_type.value in COMPUTE]
            acts += parts
            if a.sub_actions and [x.kind for x in parts] == ["F", "B"]:  # OVERLAP_F_B: (forward, full backward)
                pairs.append((parts[0], parts[1]))
        out[rank] = tuple(acts)
    return out, tuple(pairs)


def _single_stage_order(schedule: str, rank: int, n_stages: int, m: int) -> list[Action]:
    """GPipe and 1F1B as their `_step_microbatches` run them (their ``pipeline_order`` is a description only, and
    1F1B's is off by one micro-batch on the last rank in torch 2.13): GPipe every forward, then every backward;
    1F1B ``min(m, n_stages - rank)`` forwards, then a backward and a forward in turn while forwards remain, then
    the remaining backwards. Raises PlanError where the class refuses the micro-batch count."""
    if schedule == "gpipe":
        return [Action(rank, "F", i) for i in range(m)] + [Action(rank, "B", i) for i in range(m)]
    if m < n_stages:
        raise PlanError(f"pipeline price: Schedule1F1B needs at least as many micro-batches as stages ({n_stages}); "
                        f"got {m}")
    warm = min(m, n_stages - rank)
    out = [Action(rank, "F", i) for i in range(warm)]
    f, b = warm, 0
    while True:
        out.append(Action(rank, "B", b))
        b += 1
        if f == m:
            break
        out.append(Action(rank, "F", f))
        f += 1
    out += [Action(rank, "B", i) for i in range(b, m)]
    return out


def stage_ranks(order: dict[int, list[Action]]) -> dict[int, int]:
    """Stage -> the pp rank that computes it, read off the action order."""
    out: dict[int, int] = {}
    for rank, acts in order.items():
        for a in acts:
            out.setdefault(a.stage, rank)
    return out


def block_stage(path: str, cuts: list[str]) -> int | None:
    """The stage of module `path` when it is (inside) an element of the cut container (a cut after element k
    ends a stage), else None."""
    container = cuts[0].rpartition(".")[0]
    prefix = container + "." if container else ""  # "": the root itself is the sequential container
    if not path.startswith(prefix):
        return None
    head = path[len(prefix):].split(".", 1)[0]
    if not head.isdigit():
        return None
    return sum(1 for c in cuts if int(head) > int(c.rpartition(".")[2]))


def stage_of_records(records, cuts: list[str]) -> list[int]:
    """The stage of each rehearsed record (a whole step of the unpipelined model, in op order): the blocks of the
    cut container by their index (`block_stage`); any other op by where it ran — in forward, before the
    container's first block (embeddings, masks) the first stage, after it (final norm, head, loss) the last; in
    backward, mirrored: before the first block's backward the last stage, after it the first."""
    n_last = len(cuts)
    seen = {"forward": False, "backward": False}
    out: list[int] = []
    for r in records:
        phase = "forward" if r.phase == "forward" else "backward"
        s = block_stage(r.module, cuts)
        if s is not None:
            out.append(s)
            seen[phase] = True
        elif phase == "forward":
            out.append(n_last if seen["forward"] else 0)
        else:
            out.append(0 if seen["backward"] else n_last)
    return out


def stage_flops(records, cuts: list[str]) -> list[int]:
    """Useful FLOPs (forward + backward, no recomputation: the MFU numerator of `treadle.profile.model_flops`) of
    each stage, the profile's records assigned as the price assigns them (`stage_of_records`); they sum to the
    model's FLOPs."""
    out = [0] * (len(cuts) + 1)
    for r, s in zip(records, stage_of_records(records, cuts)):
        if r.phase in ("forward", "backward"):
            out[s] += r.flops
    return out
