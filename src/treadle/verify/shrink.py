"""Carry a schedule written for a large model onto a shrunken model of the same architecture.

A plan for Llama-2-70B on 64 GPUs cannot run on a laptop, but its decisions can: the same primitives (which
parameter is sharded on which dim over which mesh axis, which module output is synced to which layout, the
data-parallel roles, the checkpointed blocks, the loss) applied to the same architecture with fewer repeated
blocks and smaller widths, on a mesh with the same axis names and fewer ranks, then `verify`-ed.

`carry_schedule(sch, model, mesh=...)` replays `sch`'s records on `model` (unbuilt, nothing else changes):

* records outside the repeated blocks (embedding, final norm, head, loss, data parallelism) verbatim;
* the shrunken model's block ``j`` takes the records of the large model's block ``j``, except its last block,
  which takes those of the large model's last block (a plan's first block may carry the sequence slice where
  the residual stream enters the blocks; the last may differ too). Every large block's primitives (checkpoints
  aside) must equal those of a carried block, with the block index replaced: otherwise the shrunken model
  would not exercise them, and carrying is refused (ScheduleError naming the block and the primitive);
* checkpoints: a large schedule that checkpoints ``c`` of ``N`` blocks (all with the same primitive) checkpoints
  ``round(c * n / N)`` of the ``n`` shrunken blocks, at least one when ``c > 0`` and at least one left out when
  ``c < N`` (both kinds of block are exercised), spread as the planner spreads them.

* a pipeline (`cut_pipeline_stage` + `pipeline(...)`) keeps its axis and schedule, and its stages per rank v as far
  as the shrunken blocks allow (at least 2 for a multi-stage schedule): the shrunken model is cut evenly into
  v x (the shrunken mesh's pp size) stages, over the shrunken example inputs
  (`example_inputs`, required then, with the large schedule's plain flags such as ``use_cache=False``) in as many
  micro-batches as the large schedule's where the shrunken batch
  splits so, else the most it splits into (at least one per stage).

Sizes are not carried: every primitive re-checks divisibility on the shrunken model and mesh. Only primitives
whose arguments hold no module, graph or integer sized for the large model are carried (shard, sync,
shard_attr, reduce_grads, fork_rng, checkpoint, checkpoint_selective, annotate, set_attr of a Ref or a plain
flag, data_parallel, expert_parallel (its axes and stated load), float8 (a recipe and globs: its linears are found
again on the shrunken model, also where it is stated on the block list itself), and a pipeline as above); any
other raises ScheduleError naming it.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from ..errors import ScheduleError
from ..mesh import Mesh
from ..models.common import block_container
from ..schedule.core import Schedule, create_schedule
from ..schedule.replay import replay
from ..schedule.log import Record, Ref

logger = logging.getLogger(__name__)

CARRIED_OPS = ("shard", "sync", "shard_attr", "reduce_grads", "fork_rng", "checkpoint", "checkpoint_selective",
               "annotate", "set_attr", "data_parallel", "expert_parallel", "float8", "cut_pipeline_stage", "pipeline")
WHOLE_LIST_OPS = ("float8",)  # may be stated on the block list itself: carried as is, onto every shrunken block
PIPELINE_OPS = ("cut_pipeline_stage", "pipeline")
CHECKPOINT_OPS = ("checkpoint", "checkpoint_selective")


@dataclass(frozen=True)
class CarriedSchedule:
    """The shrunken model's schedule and what was carried onto it.

    `source_blocks[j]` is the large block whose primitives shrunken block ``j`` took; `per_block` counts them by
    primitive (of block ``source_blocks[0]``; `kinds` distinct block signatures exist in the large schedule);
    `shared` counts the records outside the blocks; `checkpointed` lists the shrunken blocks checkpointed, for
    `checkpointed_big` of `n_big` large blocks."""

    schedule: Schedule
    blocks: str
    n_big: int
    source_blocks: tuple[int, ...]
    kinds: int
    per_block: dict[str, int]
    shared: dict[str, int]
    shared_records: tuple[str, ...]
    checkpointed_big: int
    checkpointed: tuple[int, ...]
    checkpoint_op: str | None = None
    block_records: tuple[str, ...] = field(default=())

    def summary(self) -> str:
        """One line: blocks mapped, primitives per block and outside, checkpoints."""
        def ops(c: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none"

        src = ",".join(str(i) for i in self.source_blocks)
        ck = f"ckpt {self.checkpointed_big}/{self.n_big}->{len(self.checkpointed)}/{len(self.source_blocks)}"
        if self.checkpoint_op:
            ck += f" ({self.checkpoint_op})"
        return (f"{self.n_big}->{len(self.source_blocks)} blocks from [{src}] ({self.kinds} kind"
                f"{'s' if self.kinds != 1 else ''}); per block: {ops(self.per_block)}; outside: {ops(self.shared)}; "
                f"{ck}")


def _blocks_path(model: nn.Module) -> str:
    best = block_container(model)
    if best is None:
        raise ScheduleError("carry_schedule: the model has no nn.ModuleList (or nn.ModuleDict keyed 0, 1, ...) of "
                            "repeated blocks")
    return best


def _key(r: Record, rel: str) -> str:
    """A record as comparable text, its block prefix dropped."""
    return f"{r.op} {rel!r} " + repr(sorted(r.args.items(), key=lambda kv: kv[0]))


def _check_carriable(r: Record) -> None:
    if r.op not in CARRIED_OPS:
        raise ScheduleError(f"carry_schedule: primitive {r.op!r} at {r.path!r} holds modules or graphs built for "
                            f"the original model's sizes and cannot be carried; carried primitives: "
                            f"{', '.join(CARRIED_OPS)}")
    if r.op in ("set_attr", "annotate"):
        v = r.args.get("value")
        if not (isinstance(v, (Ref, str, bool, float)) or v is None):
            raise ScheduleError(f"carry_schedule: {r.op} at {r.path!r} sets {r.args.get('*')!r} to a "
                                f"{type(v).__name__} ({v!r}), which may hold a size of the original model; only "
                                f"a Ref or a plain flag is carried")


def checkpoint_count(c: int, n_big: int, n: int) -> int:
    """Shrunken blocks to checkpoint for `c` of `n_big`: proportional, >= 1 when c > 0, <= n - 1 when c < n_big."""
    if c <= 0:
        return 0
    if c >= n_big:
        return n
    return min(max(round(c * n / n_big), 1), max(n - 1, 1))


def carry_schedule(sch: Schedule, model: nn.Module, *, mesh: Mesh, blocks: str | None = None,
                   example_inputs: dict | None = None) -> CarriedSchedule:
    """Replay `sch`'s records on `model` (same architecture, fewer blocks, smaller sizes) on `mesh`; see the
    module doc for what is carried. `blocks` is the path of the repeated blocks (default: the longest
    nn.ModuleList of `sch.model`), the same path in both models. `example_inputs`: the shrunken model's batch, for
    a pipeline (its micro-batches split it).

    Raises ScheduleError when `mesh` has other axis names than `sch.mesh`, the shrunken model has more blocks
    than the large one or none, a primitive cannot be carried, a large block's primitives are carried by no
    shrunken block, checkpointed blocks differ in how, or a primitive does not hold on the shrunken sizes."""
    if tuple(mesh.names) != tuple(sch.mesh.names):
        raise ScheduleError(f"carry_schedule: the schedule is for {sch.mesh}; the shrunken mesh {mesh} must have "
                            f"the same axis names {list(sch.mesh.names)}")
    blocks = blocks if blocks is not None else _blocks_path(sch.model)
    try:
        n_big, n = len(sch.model.get_submodule(blocks)), len(model.get_submodule(blocks))
    except AttributeError as exc:
        raise ScheduleError(f"carry_schedule: no repeated blocks at {blocks!r} in both models ({exc})") from None
    if not 1 <= n <= n_big:
        raise ScheduleError(f"carry_schedule: the shrunken model has {n} blocks at {blocks!r}; it needs 1 to "
                            f"{n_big} (the original's count)")
    pat = re.compile(re.escape(blocks) + r"\.(\d+)((?:\..*)?)$")
    shared: list[Record] = []
    per: dict[int, list[tuple[Record, str]]] = {i: [] for i in range(n_big)}
    ckpts: dict[int, list[tuple[Record, str]]] = {}
    order: list[tuple[Record, int | None, str]] = []  # (record, block index or None, path below the block)
    piped = [r for r in sch.records if r.op in PIPELINE_OPS]
    for r in sch.records:
        _check_carriable(r)
        if r.op in PIPELINE_OPS:  # carried as a pipeline of the shrunken model (`_carry_pipeline`)
            continue
        if r.path == blocks and r.op not in WHOLE_LIST_OPS:
            raise ScheduleError(f"carry_schedule: primitive {r.op!r} on the block list {blocks!r} itself has no "
                                f"per-block meaning and cannot be carried")
        m = pat.match(r.path)
        if m is None:
            shared.append(r)
            order.append((r, None, ""))
            continue
        i, rel = int(m.group(1)), m.group(2)
        (ckpts.setdefault(i, []) if r.op in CHECKPOINT_OPS else per[i]).append((r, rel))
        order.append((r, i, rel))
    sig = {i: tuple(_key(r, rel) for r, rel in per[i]) for i in range(n_big)}
    src = tuple(list(range(n - 1)) + [n_big - 1])
    carried = {sig[s] for s in src}
    for i in range(n_big):
        if sig[i] not in carried:
            ref = sig[src[min(i, n - 1)]]
            pairs = list(zip(sig[i], ref))
            first = next((f"{a} vs {b}" for a, b in pairs if a != b), None)
            if first is None:  # one list extends the other
                first = (f"extra {sig[i][len(ref)]}" if len(sig[i]) > len(ref) else f"missing {ref[len(sig[i])]}")
            raise ScheduleError(f"carry_schedule: block {blocks}.{i} has primitives that none of the {n} shrunken "
                                f"blocks (taken from blocks {list(src)}) carries; first difference: {first}; "
                                f"use more shrunken blocks or a schedule uniform over its blocks")
    ck_sigs = {tuple(_key(r, rel) for r, rel in v) for v in ckpts.values()}
    if len(ck_sigs) > 1:
        raise ScheduleError(f"carry_schedule: blocks under {blocks!r} are checkpointed in different ways "
                            f"({sorted(ck_sigs)[:2]}); carrying needs one checkpoint primitive for every "
                            f"checkpointed block")
    k = checkpoint_count(len(ckpts), n_big, n)
    ck_small = tuple(sorted({int(j * n / k) for j in range(k)})) if k else ()
    ck_template = next(iter(ckpts.values())) if ckpts else []

    def at(j: int, r: Record, rel: str) -> Record:
        return Record(r.op, f"{blocks}.{j}{rel}", dict(r.args))

    small_of = {s: j for j, s in enumerate(src)}
    records: list[Record] = []
    ck_done = False
    for r, i, rel in order:  # the original order: a carried block's records stay where they were
        if i is None:
            records.append(r)
        elif r.op not in CHECKPOINT_OPS:
            if i in small_of:
                records.append(at(small_of[i], r, rel))
        elif not ck_done:  # the shrunken model's checkpoints, where the first one was
            ck_done = True
            records += [at(j, c, crel) for j in ck_small for c, crel in ck_template]
    records += _carry_pipeline(piped, sch, blocks, n, mesh, example_inputs)
    out = replay(create_schedule(model, mesh=mesh), records)
    logger.info("carry_schedule: %d -> %d blocks, %d records", n_big, n, len(records))
    return CarriedSchedule(
        schedule=out, blocks=blocks, n_big=n_big, source_blocks=src, kinds=len(set(sig.values())),
        per_block=dict(Counter(r.op for r, _ in per[src[0]])), shared=dict(Counter(r.op for r in shared)),
        shared_records=tuple(r.to_python() for r in shared), checkpointed_big=len(ckpts), checkpointed=ck_small,
        checkpoint_op=ck_template[0][0].op if ck_template else None,
        block_records=tuple(at(0, r, rel).to_python() for r, rel in per[src[0]]))


def _carry_pipeline(piped: list[Record], sch: Schedule, blocks: str, n: int, mesh: Mesh,
                    example_inputs: dict | None) -> list[Record]:
    """The shrunken model's pipeline records (module doc): even cuts into v x pp stages, the large schedule's
    micro-batches where the shrunken batch splits so. Raises ScheduleError without example inputs, with cuts but no
    pipeline, or with fewer blocks than stages."""
    if not piped:
        return []
    pipe = next((r for r in piped if r.op == "pipeline"), None)
    cuts = [r for r in piped if r.op == "cut_pipeline_stage"]
    if pipe is None:
        raise ScheduleError(f"carry_schedule: {len(cuts)} cut_pipeline_stage without pipeline(...): nothing to carry")
    if example_inputs is None:
        raise ScheduleError("carry_schedule: the schedule is a pipeline; give the shrunken model's example_inputs "
                            "(its micro-batches split them)")
    args = dict(pipe.args)
    axis = args["axis"]
    big_v = (len(cuts) + 1) // sch.mesh.size(axis)
    v = min(big_v, n // mesh.size(axis))  # as many stages a rank as the shrunken blocks allow...
    if v < (2 if big_v > 1 else 1):  # ...keeping a multi-stage schedule multi-stage
        raise ScheduleError(f"carry_schedule: the pipeline runs {big_v} stages a rank over {axis!r}; the shrunken "
                            f"model's {n} blocks make {n // mesh.size(axis)} a rank on {mesh.size(axis)} ranks; use "
                            f"at least {min(big_v, 2) * mesh.size(axis)} blocks")
    stages = v * mesh.size(axis)
    dp = sch.view().data_parallel
    replicas = dp.size(mesh) if dp is not None else 1
    batch = next(int(t.shape[0]) for t in example_inputs.values() if hasattr(t, "shape") and len(t.shape))
    per = batch // replicas
    m = next((k for k in range(int(args["n_microbatches"]), 0, -1) if per % k == 0 and k >= stages // v), None)
    if m is None:
        raise ScheduleError(f"carry_schedule: a batch of {batch} over {replicas} replicas splits into no micro-batch "
                            f"count of at least {stages // v}; use a larger shrunken batch")
    out = [Record("cut_pipeline_stage", f"{blocks}.{(s + 1) * n // stages - 1}", {}) for s in range(stages - 1)]
    flags = {k: x for k, x in (args.get("example_inputs") or {}).items() if not isinstance(x, dict)}  # use_cache=...
    args.update(n_microbatches=m, example_inputs={**flags, **example_inputs})
    out.append(Record("pipeline", "", args))
    return out


__all__ = ["CarriedSchedule", "carry_schedule", "checkpoint_count", "CARRIED_OPS"]
