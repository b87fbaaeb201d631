"""Selective checkpoint policies inside a pipeline's stages: each stage's counts of blocks under each policy the
user allows, in the MILP of a cut (`milp.py`) and in its direct evaluation.

NOTE [checkpoint policies in a pipeline's stages]: with selective checkpoint policies allowed
(`TrainSpec.checkpoint_policies`; NOTE [checkpoint policies in the plan] in `treadle.planner.policies`), each stage
s weighs, per block template t on it and policy p, a count c_{t,s,p} beside its full checkpoint count c_{t,s},
c_{t,s} + sum_p c_{t,s,p} <= n_{t,s} ("policy_count"). A block under p keeps In + K_p in place of the A autograd
saves, recomputes F_p for its host cost host_p, and holds A - S_p again while its backward runs:

    A_s += c_{t,s,p} (In + K_p - A)        T_s += c_{t,s,p} (F_p + host_p)        transient_r >= q_{t,s,p} (A - S_p)

linearised per bit as the full counts are (`ckpt_vars.checkpoint_vars`, the expressions of `policies.policy_exprs`),
so the micro-batches in flight at each moment of the schedule hold each stage's kept bytes, and the recompute runs
in every micro-batch's backward on the stage's rank. A full checkpoint keeps less than any policy (In against
In + K_p, and one block's re-held A at most), so the memory floors still bound the MILP; the recompute floor (NOTE
[the recomputation a budget forces]) assumes a full checkpoint's seconds per byte saved, which a policy may beat, so
it is not applied when a policy is offered. Not for the split-backward schedules (solved without checkpoints: NOTE
[zero-bubble schedules in the plan]) nor templates with block variants. `evaluate` and the exhaustive oracle count
the same terms; the plan states each such block ``checkpoint(policy=p)``, the blocks picked as the core picks them
(`policies.pick`: full checkpoints first, then each policy's, spread over the stage's blocks).
"""

from __future__ import annotations

import math

from ...planner.ckpt_vars import _BYTES, _SECONDS, checkpoint_vars
from ...planner.ilp import as_var
from ...planner.policies import block_terms, host_s, offered, policy_exprs


def add_stage_policies(m, cg, s, lay, cut, A: list[dict], T: list[dict], zts: dict[int, list], ck: dict, *,
                       enabled: bool) -> dict[tuple[int, int, str], object]:
    """Per offered (template, policy) and stage holding blocks of the template, a count with its products, added to
    the stage's activations `A` and time `T` (scaled dicts, in place) and its rank's transients `zts`; one
    "policy_count" row per (template, stage) beside its full count `ck`. Returns (template, stage, policy) ->
    CheckpointVars."""
    pol: dict[tuple[int, int, str], object] = {}
    for t, p in offered(cg, stages=True):
        Ap, Fp, Kp, again, bounds = policy_exprs(cg, s, t, p, seconds=_SECONDS, nbytes=_BYTES)
        Ap, Fp, Kp, again = (as_var(m, e) for e in (Ap, Fp, Kp, again))
        host = host_s(cg, t, p) * _SECONDS
        for st in range(lay.n_stages):
            n_t = cut.n[st].get(t, 0)
            if not n_t:
                continue
            cv = checkpoint_vars(m, n_t, Ap, Fp, Kp, bounds, host=host, enabled=enabled, transient=again)
            pol[(t, st, p)] = cv
            for b, (za, zf, zi, y) in enumerate(zip(cv.zA, cv.zF, cv.zI, cv.ys)):
                w = float(2 ** b)
                for d, j, x in ((A[st], za, -w), (A[st], zi, w), (T[st], zf, w), (T[st], y, w * host)):
                    if x:
                        d[j] = d.get(j, 0.0) + x
            zts[lay.rank(st)].append(cv.zT)
    for (t, st), cv in ck.items():  # a stage's blocks of t: its full checkpoints and each policy's, at most n_t
        extra = [c for (t2, st2, _), c in pol.items() if (t2, st2) == (t, st)]
        if not extra:
            continue
        row = {y: float(2 ** b) for b, y in enumerate(cv.ys)}
        for c in extra:
            for b, y in enumerate(c.ys):
                row[y] = row.get(y, 0.0) + float(2 ** b)
        m.row(row, -math.inf, float(cut.n[st][t]), "policy_count")
    return pol


def policy_terms(cg, lay, choice: list[int], policies: dict[tuple[int, int, str], int], A: list[float],
                 T: list[float], rec: list[float], trans: list[float]) -> None:
    """The policy counts' terms for `milp.evaluate`, in place: a stage's activations per micro-batch `A` (what p
    keeps in place of what autograd saves), its time `T` and recompute `rec` (F_p + host_p each), and its rank's
    transient `trans` (A - S_p of one such block)."""
    for (t, st, p), n in policies.items():
        if not n:
            continue
        keep, F, again = block_terms(cg, choice, t, p)
        At = sum(cg.units[u].costs[choice[u]].act_bytes for u in cg.templates[t].units)
        A[st] += n * (keep - At)
        T[st] += n * (F + host_s(cg, t, p))
        rec[st] += n * (F + host_s(cg, t, p))
        trans[lay.rank(st)] = max(trans[lay.rank(st)], again)


__all__ = ["add_stage_policies", "policy_terms"]
