"""Selective checkpoint policies in the planner's search: per block template, how many blocks run under each
policy a user allows, beside the full checkpoint count, in the same MILP (the facts: `policy_facts.py`).

NOTE [checkpoint policies in the plan]: with `TrainSpec.checkpoint_policies`, each block template t gets, besides
its full checkpoint count c_t, one count c_{t,p} per policy p, c_t + sum_p c_{t,p} <= L_t (policy_count). A block
under p keeps its input and the kept ops' outputs (In + K_p, held outside autograd), recomputes in backward what p
does not keep up to the block's last saving op (F_p, NOTE [recompute stops early]), and, while its backward runs,
holds again what autograd saves less what the cache already holds (A - S_p):

    memory += c_{t,p} (In + K_p - A)        T >= q_{t,p} (A - S_p)        time += c_{t,p} (F_p + host_p)

each product linearised per bit as the full count's (`ckpt_vars.checkpoint_vars`). host_p is checkpointing's host
cost of the ops p recomputes and of the region (`recompute_host_s`), plus selective checkpointing's dispatch modes
on every op of the block's forward and recompute (`selective_host_s`: ~10 us an op on a CPU core, which makes op
SAC slower than full checkpointing there, as measured; 0 on a GPU preset). Block 0's input at the backward's end
(NOTE [the backward's end]) is counted when any block of its template is checkpointed either way
(`any_checkpointed`). Which blocks: the full checkpoints as `spread` places them, then each policy's blocks spread
over the rest (`pick`), so block 0 is checkpointed whenever any block is. Not offered for a template with block
variants (NOTE [block variants]: their recompute credit assumes full checkpoints) or in the two-stage mode; inside a
pipeline's stages each stage weighs them in its own MILP (NOTE [checkpoint policies in a pipeline's stages] in
`treadle.forms.pipeline.stage_policies`). A policy that would keep nothing less than a full checkpoint does is still
offered: the solver weighs it.
"""

from __future__ import annotations

import math
from typing import Any

from .ckpt_vars import _block_exprs, _upper, checkpoint_vars


def spread(members: list[str], count: int) -> list[str]:
    """`count` of `members`, evenly spaced (the first and last included when count >= 2): which blocks of a
    template are checkpointed."""
    if count <= 0:
        return []
    if count >= len(members):
        return list(members)
    step = len(members) / count
    return [members[int(i * step)] for i in range(count)]


def offered(cg, *, stages: bool = False) -> list[tuple[int, str]]:
    """(template, policy) pairs the MILP weighs (NOTE [checkpoint policies in the plan]): the core's without a
    pipeline; with `stages`, those each stage of a pipeline weighs (NOTE [checkpoint policies in a pipeline's
    stages] in `treadle.forms.pipeline.stage_policies`)."""
    if not cg.policies or (cg.roles.pp is not None) != stages or not cg.graph.sac:
        return []
    return [(t, p) for t in cg.templates if not cg.variants.get(t) for p in cg.policies if p in cg.graph.sac]


def block_terms(cg, choice: list[int], t: int, p: str) -> tuple[float, float, float]:
    """A block of template t under policy p with `choice`: (bytes it keeps, recompute seconds, bytes it holds
    again while its backward runs beyond what it keeps): In + K_p, F_p, A - S_p."""
    info = cg.templates[t]
    K = F = S = A = 0.0
    for u in info.units:
        c = cg.units[u].costs[choice[u]]
        k, f, s = c.sac.get(p, (0.0, c.rec_s, 0.0))
        K, F, S, A = K + k, F + f, S + s, A + c.act_bytes
    In = info.input_bytes[choice[info.input_unit]] if info.input_unit is not None else 0.0
    return In + K, F, A - S


def host_s(cg, t: int, p: str) -> float:
    """Host seconds of one block of t under p (`CostGraph.sac_host_s`; 0 where not computed)."""
    return cg.sac_host_s.get((t, p), 0.0)


def evaluate(cg, choice: list[int], policies: dict[tuple[int, str], int]) -> tuple[float, float, float]:
    """(recompute seconds, activation bytes beyond the blocks' saved ones, largest transient) of the policy counts
    (NOTE [checkpoint policies in the plan]), the terms `add_vars` states."""
    rec = act = trans = 0.0
    for (t, p), n in policies.items():
        if not n:
            continue
        keep, F, again = block_terms(cg, choice, t, p)
        A = sum(cg.units[u].costs[choice[u]].act_bytes for u in cg.templates[t].units)
        rec += n * (F + host_s(cg, t, p))
        act += n * (keep - A)
        trans = max(trans, again)
    return rec, act, trans


def policy_exprs(cg, s, t: int, p: str, *, seconds: float, nbytes: float):
    """A block of template t under policy p as linear expressions over the strategy variables `s` (scaled: NOTE [row
    scaling]): (A what autograd saves without checkpointing, F_p what it recomputes, In + K_p what it keeps, A - S_p
    what it holds again while its backward runs) and their upper bounds (A, F_p, In + K_p)."""
    info = cg.templates[t]
    A, _, In = _block_exprs(cg, s, t)
    F: dict[int, float] = {}
    K = dict(In)
    again: dict[int, float] = {}
    for u in info.units:
        for k, c in enumerate(cg.units[u].costs):
            kb, f, sb = c.sac.get(p, (0.0, c.rec_s, 0.0))
            j = s[u, k]
            if f:
                F[j] = F.get(j, 0.0) + f * seconds
            if kb:
                K[j] = K.get(j, 0.0) + kb * nbytes
            if c.act_bytes - sb:
                again[j] = again.get(j, 0.0) + (c.act_bytes - sb) * nbytes
    Amax = max(_upper(cg, info.units, "act_bytes") * nbytes, 1e-9)
    Fmax = max(sum(max(c.sac.get(p, (0.0, c.rec_s, 0.0))[1] for c in cg.units[u].costs) for u in info.units)
               * seconds, 1e-9)
    Kmax = max((max(info.input_bytes, default=0.0)
                + sum(max(c.sac.get(p, (0.0, 0.0, 0.0))[0] for c in cg.units[u].costs) for u in info.units))
               * nbytes, 1e-9)
    return A, F, K, again, (Amax, Fmax, Kmax)


def add_vars(m, cg, s, *, enabled: bool, seconds: float, nbytes: float) -> dict[tuple[int, str], Any]:
    """Per offered (template, policy) a count with its McCormick products (`ckpt_vars.checkpoint_vars`: zA = y A,
    zF = y F_p, zI = y (In + K_p), zT = q (A - S_p)), scaled (NOTE [row scaling])."""
    out = {}
    for t, p in offered(cg):
        A, F, K, again, bounds = policy_exprs(cg, s, t, p, seconds=seconds, nbytes=nbytes)
        out[t, p] = checkpoint_vars(m, cg.templates[t].count, A, F, K, bounds, host=host_s(cg, t, p) * seconds,
                                    enabled=enabled, transient=again)
    return out


def add_rows(m, cg, full_bits: dict[int, list[int]], pol: dict) -> None:
    """c_t + sum_p c_{t,p} <= L_t (policy_count)."""
    for t, info in cg.templates.items():
        row = {y: float(2 ** b) for b, y in enumerate(full_bits.get(t, []))}
        extra = [cv for (t2, _), cv in pol.items() if t2 == t]
        if not extra:
            continue
        for cv in extra:
            for b, y in enumerate(cv.ys):
                row[y] = row.get(y, 0.0) + float(2 ** b)
        m.row(row, -math.inf, float(info.count), "policy_count")


def any_checkpointed(m, t: int, q_full: int, pol: dict) -> int:
    """A binary that is 1 when a block of template t is checkpointed either way (for block 0's input at the
    backward's end); q_full itself when no policy is offered on t."""
    qs = [cv.q for (t2, _), cv in pol.items() if t2 == t]
    if not qs:
        return q_full
    z = m.var(integer=True)
    for q in (q_full, *qs):
        m.row({z: 1.0, q: -1.0}, 0.0, math.inf, "policy_any")
    return z


def counts_of(x, pol: dict) -> dict[tuple[int, str], int]:
    """The solver's count per (template, policy)."""
    return {key: int(round(sum(2 ** b * x[y] for b, y in enumerate(cv.ys)))) for key, cv in pol.items()}


def pick(members: list[str], full: int, counts: dict[str, int]) -> dict[str, str]:
    """{block path: policy} for a template's blocks (NOTE [checkpoint policies in the plan]): the full checkpoints
    where `spread` puts them, then each policy's blocks (in name order) spread over the rest."""
    out = {b: "full" for b in spread(members, full)}
    for p in sorted(counts):
        rest = [b for b in members if b not in out]
        for b in spread(rest, counts[p]):
            out[b] = p
    return out


__all__ = ["spread", "offered", "policy_exprs", "block_terms", "host_s", "evaluate", "add_vars", "add_rows",
           "any_checkpointed", "counts_of", "pick"]
