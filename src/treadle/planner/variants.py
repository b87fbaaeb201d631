"""Block variants: a count per block template of the blocks that a parallel form builds differently from the
template, chosen in the MILP as the checkpoint count is.

NOTE [block variants]: the solver gives all blocks of one template one strategy per unit. A form may offer a
*variant* of a template's blocks (`Variant`: the experts of an MoE block kept whole on each rank while the other
blocks split them, NOTE [experts split in part of the blocks] in `treadle.forms.expert.plan`) whose every
difference from a block as the template's units price it is a constant: `delta`, a `StrategyCost` of what one
block of the variant adds (negative: saves), valid while the template's units take strategies other than
`excludes`. The MILP then chooses an integer count w in [0, `most`] per variant (family variant_count):

    min  ... + w (delta.compute_s + delta.comm_s) - rec_credit_s o
    s.t. w <= most z;  s[u,k] + z <= 1  for (u,k) in excludes          (variant_excludes; z in {0,1})
         memory: + w (delta.static_bytes + delta.act_bytes)            (every memory point)
         o <= w;  o <= c_t - q_t                                       (variant_checkpointed)
         data parallelism: the exposure row takes w (delta.dp_comm_s - window(delta)), the backward's end
         w (delta.static_bytes + delta.grad_bytes) (`treadle.forms.data.plan`)

A variant block is never the template's first block (`most` <= count - 1; `pick` chooses them), so what the
backward's-end row counts of block 0 stays the template's. o is the number of variant blocks also checkpointed,
each recomputing `rec_credit_s` less: `pick` takes the variant blocks first among the checkpointed ones other
than the first (`to_schedule._spread` checkpoints the first block whenever any is), so that number is min(w, c -
1) for c > 0, the o the objective drives to its bound. `evaluate` computes the same terms directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import PlanError
from .node_costs import StrategyCost


@dataclass(frozen=True, slots=True)
class Variant:
    """A variant `name` of form `form` that at most `most` blocks of one template may take (NOTE [block variants]).
    Its bytes only add (`delta.static_bytes + delta.act_bytes >= 0`): the memory floor, made before the variants
    (NOTE [a memory floor before the costs] in floors.py), counts none. Raises PlanError otherwise."""

    form: str
    name: str
    most: int
    delta: StrategyCost
    rec_credit_s: float = 0.0
    excludes: tuple[tuple[int, int], ...] = ()
    module: str = ""  # the row of a plan's explanation the difference is billed to ("": the step row)

    def __post_init__(self) -> None:
        if self.delta.static_bytes + self.delta.act_bytes < 0 or self.delta.grad_bytes < 0:
            raise PlanError(f"block variant {self.name!r} of form {self.form!r} saves memory "
                            f"({self.delta.static_bytes + self.delta.act_bytes:.0f} B, gradients "
                            f"{self.delta.grad_bytes:.0f} B): the memory floor would not hold; a variant may only add")


def variants_of(cg) -> dict[tuple[int, str], Variant]:
    """Every variant of a cost graph, by (template, name)."""
    return {(t, v.name): v for t, vs in sorted(cg.variants.items()) for v in vs}


def add_variant_vars(m, cg, s, seconds: float) -> dict[tuple[int, str], int]:
    """The count variables w (variant_count, variant_excludes), each costing its delta's time in the objective
    (scaled by `seconds`: NOTE [row scaling] in ilp.py)."""
    out = {}
    for key, v in variants_of(cg).items():
        w = m.var(ub=float(v.most), integer=True, cost=(v.delta.compute_s + v.delta.comm_s) * seconds)
        out[key] = w
        if v.excludes:
            z = m.var(integer=True)
            m.row({w: 1.0, z: -float(v.most)}, -math.inf, 0.0, "variant_count")
            for u, k in v.excludes:
                m.row({s[u, k]: 1.0, z: 1.0}, -math.inf, 1.0, "variant_excludes")
    return out


def link_checkpoints(m, cg, w: dict[tuple[int, str], int], bits: dict, q: dict, seconds: float) -> None:
    """o <= w and o <= c_t - q_t per variant with a recompute credit (variant_checkpointed)."""
    for (t, name), v in variants_of(cg).items():
        if not v.rec_credit_s or t not in bits:
            continue
        o = m.var(ub=float(v.most), cost=-v.rec_credit_s * seconds)
        m.row({o: 1.0, w[t, name]: -1.0}, -math.inf, 0.0, "variant_checkpointed")
        m.row({o: 1.0, q[t]: 1.0, **{y: -float(2 ** b) for b, y in enumerate(bits[t])}}, -math.inf, 0.0,
              "variant_checkpointed")


def memory_terms(cg, w: dict[tuple[int, str], int], nbytes: float) -> dict[int, float]:
    """What the variant blocks add to every memory point (scaled by `nbytes`)."""
    return {w[key]: (v.delta.static_bytes + v.delta.act_bytes) * nbytes for key, v in variants_of(cg).items()}


def checkpointed(count: int, ckpt: int) -> int:
    """How many of `count` variant blocks are also checkpointed when `ckpt` blocks are (NOTE [block variants])."""
    return min(count, ckpt - 1) if ckpt > 0 else 0


def evaluate(cg, counts: dict[tuple[int, str], int], ckpt: dict[int, int]) -> dict[str, float]:
    """The variant blocks' terms of a solution, as the MILP states them: compute, comm, recompute, static and
    activation bytes."""
    out = dict.fromkeys(("compute_s", "comm_s", "recompute_s", "static_bytes", "act_bytes"), 0.0)
    for (t, name), v in variants_of(cg).items():
        w = counts.get((t, name), 0)
        out["compute_s"] += w * v.delta.compute_s
        out["comm_s"] += w * v.delta.comm_s
        out["recompute_s"] -= checkpointed(w, ckpt.get(t, 0)) * v.rec_credit_s
        out["static_bytes"] += w * v.delta.static_bytes
        out["act_bytes"] += w * v.delta.act_bytes
    return out


def pick(members: list[str], count: int, checkpointed_members: list[str]) -> list[str]:
    """The `count` blocks (of a template's `members`, real paths in order) that take a variant: from the last, first
    the checkpointed ones, then the others, never the first block (NOTE [block variants])."""
    ck = set(checkpointed_members)
    rest = members[1:][::-1]
    order = [m for m in rest if m in ck] + [m for m in rest if m not in ck]
    return order[:count]
