"""Why a pipeline cannot run a schedule, one check each (build refuses what these name, and the price refuses
the same, reading these same functions): where each stage sits (`stage_rank`), a parameter two stages of one rank
read under a split-backward schedule or under data parallelism, and FSDP2 with a split backward."""

from __future__ import annotations

V_SCHEDULES = ("zbv", "dualpipev")
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")  # input- and weight-gradient backward apart


def stage_rank(schedule: str, stage: int, pp: int) -> int:
    """The pp rank that holds `stage` under `schedule`: in a V for zbv / dualpipev (rank r holds r and
    2 pp - 1 - r), else in a loop (stage mod pp) — as torch.distributed.pipelining places them."""
    if schedule in V_SCHEDULES:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def split_backward_conflict(schedule: str, pp: int, readers: list[tuple[str, set[int]]]) -> str | None:
    """Why `schedule` cannot run these stages, or None: a split-backward schedule (input, then weight gradients,
    per stage, around each weight's one gradient accumulator) on which two stages of one rank read one parameter
    (`readers`: (parameter name, the stages that read it)) — its gradient comes out wrong in torch 2.13."""
    if schedule not in SPLIT_BACKWARD:
        return None
    for name, stages in sorted(readers, key=lambda r: r[0]):
        by_rank: dict[int, list[int]] = {}
        for s in sorted(stages):
            by_rank.setdefault(stage_rank(schedule, s, pp), []).append(s)
        for same in by_rank.values():
            if len(same) > 1:
                return (f"schedule {schedule!r} places stages {same[0]} and {same[1]} on one rank and both read "
                        f"{name}; its split backward (input, then weight gradients) cannot share a parameter "
                        f"between two stages of a rank; untie it, or use a schedule that places them on different "
                        f"ranks (interleaved_1f1b, looped_bfs)")
    return None


def fsdp_split_conflict(schedule: str, dp) -> str | None:
    """Why `schedule` cannot run under data parallelism `dp`, or None: a split-backward schedule under FSDP2 / HSDP
    with ``reshard_after_forward``. A forward between a stage's I and W reshards the stage, and in torch 2.13 the
    gradients of that W come out wrong (measured: `treadle.verify` of PP2 x FSDP2 on a tiny LLaMA fails for
    interleaved_zb, zbv and dualpipev, and passes with ``reshard_after_forward=False``)."""
    if schedule in SPLIT_BACKWARD and dp is not None and dp.shard and dp.reshard_after_forward:
        return (f"schedule {schedule!r} splits each backward into input and weight gradients; under {dp} with "
                f"reshard_after_forward=True a forward between them reshards the stage and torch 2.13 computes "
                f"wrong weight gradients; state data_parallel(..., reshard_after_forward=False), or use a schedule "
                f"without a split backward (1f1b, interleaved_1f1b, looped_bfs)")
    return None


def shared_stage_conflict(schedule: str, pp: int, readers: list[tuple[str, set[int]]], dp: str) -> str | None:
    """Why data parallelism `dp` cannot wrap these stages, or None: two stages of one rank read one parameter
    (`readers`: (parameter name, the stages that read it)), and each stage's wrapper would reduce its gradient."""
    for name, stages in sorted(readers, key=lambda r: r[0]):
        by_rank: dict[int, list[int]] = {}
        for s in sorted(stages):
            by_rank.setdefault(stage_rank(schedule, s, pp), []).append(s)
        for same in by_rank.values():
            if len(same) > 1:
                return (f"stages {same[0]} and {same[1]} of schedule {schedule!r} are on one rank and both read "
                        f"{name}; under data parallelism ({dp}) each stage's wrapper reduces its own gradients, so "
                        f"they cannot share a parameter; untie it, or cut the stages so that one rank's stages "
                        f"share none")
    return None
