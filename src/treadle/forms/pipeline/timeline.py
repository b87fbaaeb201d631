"""The timeline of one pipelined step: each pp rank runs its actions in the schedule's order (NOTE [pipeline
action order]), an action starting when its rank is free and its inputs have arrived.

NOTE [pipeline timeline]: the model, for actions A of stage s on micro-batch m:
- F(s, m) needs F(s-1, m) and, when stage s-1 is on another rank, the activation's send on the pp link;
- B(s, m) (full backward) and I(s, m) (input-gradient backward) need F(s, m) on this rank and the backward of
  (s+1, m) — its I where the schedule splits that one, else its B (DualPipeV mixes both) — plus the gradient's
  send when s+1 is on another rank (the last stage's backward starts from its loss);
- W(s, m) (weight-gradient backward) needs I(s, m);
- a rank runs one action at a time, in order, never ahead of it; a send does not hold the sender (it is
  issued when the action ends and arrives `p2p_s` later; a send between stages of one rank costs nothing);
- NOTE [an overlapped pair's sends]: DualPipeV's overlapped (forward, backward) pairs run as one action of torch's
  runtime, one part after the other (build registers no overlap), and torch issues both parts' sends when the pair
  ends (`_add_send_recv` appends them after it): a paired forward's output reaches another rank's next stage only
  after the pair's backward (`sent_after`). Timed without that, DualPipeV's PP2 plan of tiny LLaMA on 2 x 2 gloo
  ranks measured 1.20x its price where the other schedules' measured 0.94-1.13x (bench_pipeline_plans.py).
An action's duration is its stage's per-micro-batch time of that kind (compute plus its blocking tensor-parallel
collectives), plus what that one action adds (`extra_s`: FSDP2's gathers it waits for, the reduce-scatters after
a stage's last backward). The step's pipelined part ends at the latest action's end (`makespan_s`); each rank's bubble is
the makespan minus its busy time, and the pipeline's bubble fraction their sum over the ranks' total time. The
critical path follows, from the last action back, whichever bound its start: its rank's previous action or
the input it waited for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import PlanError
from .facts import Action


@dataclass(slots=True)
class Slot:
    """One action as timed: `start_s`, `end_s`, the rank that ran it, and what bound its start (`after`: the
    rank's previous action, the input it received, or nothing)."""

    action: Action
    rank: int
    start_s: float
    end_s: float
    after: Action | None = None


@dataclass(slots=True)
class PipelineTimeline:
    """Every slot by rank in run order; `makespan_s`; per rank its busy seconds; the bubble fraction (idle share
    of ranks x makespan); the critical path, first action first."""

    slots: dict[int, list[Slot]]
    makespan_s: float
    busy_s: dict[int, float]
    bubble_fraction: float
    critical_path: list[Action] = field(default_factory=list)


def simulate(order: dict[int, list[Action]], duration: dict[tuple[int, str], float], *,
             stage_rank: dict[int, int], p2p_s: dict[int, float] | None = None,
             extra_s: dict[Action, float] | None = None,
             sent_after: dict[Action, Action] | None = None) -> PipelineTimeline:
    """Time `order` (rank -> actions) with `duration[(stage, kind)]` seconds per action and `p2p_s[b]` seconds for
    a send across boundary b (between stages b and b+1; one number for the activation and its gradient) when
    the two stages are on different ranks, plus `extra_s[action]` seconds for that action; a forward of
    `sent_after` sends its output when that action (its pair's backward: `facts.overlap_pairs`) ends (NOTE
    [pipeline timeline]). Raises PlanError for an action whose input never comes (an order that deadlocks)."""
    p2p_s = p2p_s or {}
    extra_s = extra_s or {}
    sent_after = sent_after or {}
    n_stages = 1 + max(stage_rank)
    done: dict[Action, float] = {}
    slots: dict[int, list[Slot]] = {r: [] for r in order}
    nxt = {r: 0 for r in order}
    free = {r: 0.0 for r in order}
    last: dict[int, Action | None] = {r: None for r in order}
    present = {a for acts in order.values() for a in acts}

    def send(b: int, src: int, dst: int) -> float:
        return 0.0 if stage_rank[src] == stage_rank[dst] else p2p_s.get(b, 0.0)

    def ready(a: Action) -> tuple[float, Action | None] | None:
        """(when its inputs are in, the input that came last), or None while one is missing."""
        deps: list[tuple[Action, float]] = []
        if a.kind == "F":
            if a.stage > 0:
                src, lag = Action(a.stage - 1, "F", a.mb), send(a.stage - 1, a.stage - 1, a.stage)
                if stage_rank[a.stage - 1] != stage_rank[a.stage]:  # sent when its pair ends (NOTE above)
                    src = sent_after.get(src, src)
                deps.append((src, lag))
        elif a.kind in ("B", "I"):
            deps.append((Action(a.stage, "F", a.mb), 0.0))
            if a.stage < n_stages - 1:  # the next stage's backward of this micro-batch, split or full
                up = Action(a.stage + 1, "I", a.mb)
                deps.append((up if up in present else Action(a.stage + 1, "B", a.mb),
                             send(a.stage, a.stage + 1, a.stage)))
        elif a.kind == "W":
            deps.append((Action(a.stage, "I", a.mb), 0.0))
        t, by = 0.0, None
        for d, lag in deps:
            if d not in done:
                return None
            if done[d] + lag > t:
                t, by = done[d] + lag, d
        return t, by

    total = sum(len(v) for v in order.values())
    while len(done) < total:
        progressed = False
        for r, acts in order.items():
            while nxt[r] < len(acts):
                a = acts[nxt[r]]
                got = ready(a)
                if got is None:
                    break
                t_in, by = got
                start = max(free[r], t_in)
                after = by if t_in > free[r] else last[r]
                end = start + duration.get((a.stage, a.kind), 0.0) + extra_s.get(a, 0.0)
                slots[r].append(Slot(a, r, start, end, after))
                done[a] = end
                free[r], last[r] = end, a
                nxt[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(acts[nxt[r]]) for r, acts in order.items() if nxt[r] < len(acts)}
            raise PlanError(f"pipeline timeline: the order deadlocks; each rank waits at {stuck}")
    makespan = max(done.values(), default=0.0)
    busy = {r: sum(s.end_s - s.start_s for s in v) for r, v in slots.items()}
    idle = sum(makespan - b for b in busy.values())
    bubble = idle / (makespan * len(order)) if makespan > 0 else 0.0
    return PipelineTimeline(slots, makespan, busy, bubble, _critical_path(slots, done))


def _critical_path(slots: dict[int, list[Slot]], done: dict[Action, float]) -> list[Action]:
    by_action = {s.action: s for v in slots.values() for s in v}
    if not done:
        return []
    cur: Action | None = max(done, key=done.__getitem__)
    path: list[Action] = []
    while cur is not None:
        path.append(cur)
        cur = by_action[cur].after
    return path[::-1]
