"""FSDP2 beside a pipeline, stated once: when each stage's parameters are gathered, held and reduced over one
pipelined step (NOTE [pipeline FSDP2]), and what that costs per action (`FsdpTerms`, for `price.py`).

NOTE [pipeline FSDP2]: `build` wraps each local stage in FSDP2 (its blocks, then the stage; `runtime.py`), and
torch 2.13's pipelining drives it so (`PipelineStage.backward_maybe_with_nosync`, `perform_reduce_grad`,
`_add_unshard_reshard`): every backward runs with ``reshard_after_backward=False`` and no gradient sync, so a
stage's parameters stay gathered after a backward and its gradients accumulate unsharded; its reduce-scatters
run once, at its REDUCE_GRAD after its last backward, and are waited on there. Per stage, starting sharded:
- F gathers the stage if it is sharded (FSDP2's pre-forward hooks, one unit ahead) and leaves it sharded under
  ``reshard_after_forward`` (else gathered);
- B and I gather it if it is sharded and leave it gathered; W neither gathers nor reshards — except on the first
  stage, whose I is empty and whose W runs the whole backward;
- the multi-stage schedules (interleaved, looped, zero bubble, V) add UNSHARD before a stage's next compute
  (an asynchronous gather, prefetching up to three stages) and RESHARD (no traffic) when it leaves that window,
  as `_add_unshard_reshard` lowers the order; GPipe and 1F1B only run the hooks.
So a 1F1B rank under ``reshard_after_forward`` gathers in each warm-up forward and each backward after a
forward, not once per step; `tests/test_pipeline_fsdp.py` checks these states against the gathers and
reduce-scatters FSDP2 issues on gloo.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .facts import SINGLE_STAGE, Action


@dataclass(slots=True)
class RankFsdp:
    """FSDP2 over one pp rank's actions (NOTE [pipeline FSDP2]): `gathers`, the compute actions whose own hooks
    gather their stage; `prefetch`, (stage, the compute action an UNSHARD's gather is issued before); `reduce_after`,
    stage -> the action after which its reduce-scatters run; `held`, per compute action in order, the local
    stages gathered while it runs (its own included)."""

    gathers: set[Action] = field(default_factory=set)
    prefetch: list[tuple[int, Action]] = field(default_factory=list)
    reduce_after: dict[int, Action] = field(default_factory=dict)
    held: list[frozenset[int]] = field(default_factory=list)


def fsdp_states(schedule: str, order: dict[int, list[Action]], reshard_after_forward: bool) -> dict[int, RankFsdp]:
    """Rank -> when FSDP2 gathers, holds and reduces each of its stages over `order` (`facts.action_order`),
    as torch's pipelining drives it (NOTE [pipeline FSDP2])."""
    out = {}
    for rank, acts in order.items():
        st = RankFsdp()
        sharded: dict[int, bool] = {a.stage: True for a in acts}
        pending: list[int] = []  # stages an UNSHARD gathered, waiting for the next compute action
        for item in _lowered(schedule, acts):
            if isinstance(item, tuple):
                what, s = item
                if what == "UNSHARD" and sharded[s]:
                    sharded[s] = False
                    pending.append(s)
                elif what == "RESHARD":
                    sharded[s] = True
                continue
            a = item
            for s in pending:
                st.prefetch.append((s, a))
            pending = []
            if _runs_backward_or_forward(a) and sharded[a.stage]:
                st.gathers.add(a)
                sharded[a.stage] = False
            st.held.append(frozenset(s for s, sh in sharded.items() if not sh))
            if a.kind == "F" and reshard_after_forward:
                sharded[a.stage] = True
            if a.kind != "F":
                st.reduce_after[a.stage] = a  # the last backward of the stage, once the loop ends
        out[rank] = st
    return out


def _runs_backward_or_forward(a: Action) -> bool:
    """Whether `a` runs the stage's modules (and so FSDP2's hooks): F, B and I do, W only on the first stage — its I
    is empty (no input needs a gradient) and its W runs the whole backward (`PipelineStage.backward_one_chunk`)."""
    return a.kind in ("F", "B") or (a.kind == "I") == (a.stage != 0)


def _lowered(schedule: str, acts: list[Action]) -> list:
    """A rank's compute actions with the UNSHARD / RESHARD steps torch's runtime adds for FSDP2 (as
    ("UNSHARD", stage) / ("RESHARD", stage)); GPipe and 1F1B add none."""
    if schedule in SINGLE_STAGE:
        return list(acts)
    from torch.distributed.pipelining import schedules as ts

    torch_acts = [ts._Action(a.stage, ts._ComputationType.from_str(a.kind), a.mb) for a in acts]
    by_key = {(a.stage, a.kind, a.mb): a for a in acts}
    out: list = []
    for t in ts._add_unshard_reshard(torch_acts):
        kind = t.computation_type.value
        if kind in ("UNSHARD", "RESHARD"):
            out.append((kind, t.stage_index))
        else:
            out.append(by_key[(t.stage_index, kind, t.microbatch_index)])
    return out


@dataclass(slots=True)
class FsdpTerms:
    """What FSDP2 adds to a pipelined step (NOTE [pipeline FSDP2 price] in `price.py`): seconds per compute action
    (`extra_s`), per rank its gathered parameter bytes while each of its actions runs (`gathered`, in order),
    the ranks parameters are sharded over (`n`), and per rank the seconds of its gathers and reduce-scatters."""

    extra_s: dict[Action, float]
    gathered: dict[int, list[float]]
    n: int
    gather_s: dict[int, float]
    reduce_s: dict[int, float]


def fsdp_terms(states: dict[int, RankFsdp], order: dict[int, list[Action]], units: dict[int, dict[str, tuple]],
               passes: dict[tuple[int, str], list], duration: dict[tuple[int, str], float], *, dp, mesh, cluster,
               hw, groups: dict[str, tuple] | None = None) -> FsdpTerms:
    """The seconds and bytes of `states` (`fsdp_states`). `units[stage][unit]`: (all parameter bytes, trainable
    bytes, parameter count) of each FSDP2 unit the stage holds ("" its root); `passes[(stage, "fwd" / "bwd")]`: the
    stage's compute segments of one micro-batch's forward / backward, with the unit of each (`(segment, unit)`);
    `duration`: the actions' seconds without FSDP2; `groups[unit]`: (axes label, ranks, link, replicas, replicas'
    link) of a unit on axes of its own (the local experts: NOTE [experts under FSDP2]), the others on `dp`'s."""
    from ...cost.collective_cost import collective_time_s
    from ...cost.overlap import simulate
    from ..data.facts import fsdp_copy_s, fsdp_host_s, fsdp_kept_host_s
    from ..data.price import prefetched_gathers

    n = dp.shard_size(mesh)
    axis = ",".join(dp.shard_axes)
    link = cluster.group_link(dp.shard_axes)
    overlap = cluster.rank_device().overlap
    rep = dp.replicate_size(mesh) if dp.replicate_axes else 1
    rep_link = cluster.group_link(dp.replicate_axes) if rep > 1 else None
    own = dict(groups or {})

    def grp(u: str) -> tuple:  # (axes label, ranks, link, replicas, replicas' link) of unit u
        return own.get(u, (axis, n, link, rep, rep_link))

    def gather_total(s: int) -> float:  # every unit of the stage, one after another (an UNSHARD's prefetch)
        return sum(collective_time_s("all_gather", b, grp(u)[1], grp(u)[2]) for u, (b, _, _) in units[s].items() if b)

    def copies(s: int, which: int) -> float:  # FSDP2's copy-in / copy-out around each unit's collective
        return sum(fsdp_copy_s(us[which], grp(u)[1], hw) for u, us in units[s].items() if us[which])

    def in_pass(s: int, phase: str) -> float:
        """The exposed part of gathering the stage one unit ahead inside one pass (NOTE [overlap model])."""
        segs = [sg for sg, _ in passes.get((s, phase), [])]
        first: dict[str, int] = {}
        for i, (_, u) in enumerate(passes.get((s, phase), [])):
            first.setdefault(u, i)
        if phase == "fwd" and "" in units[s]:
            first[""] = 0  # the stage's root gathers in its pre-forward hook, before any block
        got = [u for u in sorted(first, key=lambda u: (first[u], u != "")) if units[s].get(u, (0,))[0]]
        if not segs:
            return gather_total(s)
        byts = {u: units[s][u][0] for u in got}
        tl = simulate(segs, prefetched_gathers(got, first, byts, phase, 0, axis, n, link, own), overlap=overlap)
        return tl.step_s - sum(sg.compute_s for sg in segs)

    host = {s: sum(fsdp_host_s(1, u[2], hw) for u in us.values()) / 2 for s, us in units.items()}
    kept = {s: fsdp_kept_host_s(len(us), hw) / 2 for s, us in units.items()}  # the hooks of a gathered stage
    gather = {(s, ph): in_pass(s, ph) + copies(s, 0) for s in units for ph in ("fwd", "bwd")}
    extra: dict[Action, float] = {}
    gathered: dict[int, list[float]] = {}
    g_s: dict[int, float] = {}
    r_s: dict[int, float] = {}
    full = {s: sum(u[0] for u in us.values()) for s, us in units.items()}
    two = {s: 2 * max((u[0] for u in us.values()), default=0.0) for s, us in units.items()}
    for rank, acts in order.items():
        st = states[rank]
        g_s[rank] = r_s[rank] = 0.0
        for a in acts:
            # kept gathered (no reshard after forward), an action that does not gather runs the hooks alone (NOTE
            # [FSDP2 units]: measured 0.1-0.2 ms a unit against 0.8-1.1 ms with the gather and reduction); resharding
            # stages pay the full hooks on every action, as before (a forward that reshards measured ~0.35 ms, a
            # backward after a gathered forward not measured apart)
            hooks = kept if not dp.reshard_after_forward and a not in st.gathers else host
            t = hooks[a.stage] if _runs_backward_or_forward(a) else 0.0
            if a in st.gathers:
                g = gather[(a.stage, "fwd" if a.kind == "F" else "bwd")]
                t += g
                g_s[rank] += g
            extra[a] = t
        pos = {a: i for i, a in enumerate(acts)}
        for s, before in st.prefetch:  # an UNSHARD's gather, issued before `before`, waited on by s's next action
            t = gather_total(s)
            i = pos[before]
            if overlap:
                j = next((k for k in range(i, len(acts)) if acts[k].stage == s), i)
                t = max(0.0, t - sum(duration.get((acts[k].stage, acts[k].kind), 0.0) for k in range(i, j)))
            # kept gathered, the gather's bookkeeping on the host goes with the UNSHARD (its action pays the hooks alone)
            extra[before] += t + copies(s, 0) + (0.0 if dp.reshard_after_forward else host[s] - kept[s])
            g_s[rank] += t + copies(s, 0)
        for s, after in st.reduce_after.items():  # REDUCE_GRAD: every unit's reduce-scatter, waited on
            t = 0.0
            for u, (_, tb, _) in units[s].items():
                _, un, ulink, urep, urep_link = grp(u)
                if tb:
                    t += collective_time_s("reduce_scatter", tb, un, ulink)
                    if urep > 1:
                        t += collective_time_s("all_reduce", tb / un, urep, urep_link)
            t += copies(s, 1)
            extra[after] += t
            r_s[rank] += t
        gathered[rank] = [sum(full[x] for x in held)  # a forward that reshards holds about two units at a time
                          - (full[a.stage] - two[a.stage] if a.kind == "F" and a in st.gathers
                             and dp.reshard_after_forward else 0.0)
                          for a, held in zip(acts, st.held)]
    return FsdpTerms(extra, gathered, n, g_s, r_s)
