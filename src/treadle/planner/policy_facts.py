"""Selective checkpoint policies as the planner measures them: what each op of a captured block keeps under a
policy, and the per-strategy terms the cost graph adds.

NOTE [ops a policy keeps]: a selective policy (NOTE [checkpoint policies as peers define them]) decides op by op,
at run time, what `torch.utils.checkpoint`'s selective checkpointing keeps in its cache and what the backward
recomputes. The capture's measurement (NOTE [saved by autograd] in saved.py) records, per graph node, the ATen ops
its forward dispatches in order and the storages each op makes (`saved.OpTrace`); `sac_facts` asks the runtime's
own decision (`PolicyRun`, what `torch.utils.checkpoint` asks at run time) about them, one run per captured block in
forward order, so the alternation (torchtitan's every other ``aten.mm``) is counted over the block's forward as it is
over one run of the checkpointed module. Per node and
policy (`SacFact`): the global bytes of the storages the kept ops make (`kept_bytes`), of which autograd saves
(`kept_saved_bytes`), and the kept ops' share of the node's forward, which the recompute does not repeat (by their
FLOPs, else by the bytes they read and write, plus one dispatch each). The cost graph divides the bytes like the
node's saved bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import PlanError
from ..schedule.checkpoint_policies import CHECKPOINT_POLICIES, POLICY_NAMES, PolicyRun

SELECTIVE = tuple(p for p, x in CHECKPOINT_POLICIES.items() if x.how == "selective")  # what the search weighs


@dataclass(frozen=True, slots=True)
class SacFact:
    """One node under one policy (NOTE [ops a policy keeps]): the storages the kept ops make (bytes; of which
    autograd saves), and the kept ops' share of the node's forward: their FLOPs and argument/output bytes against
    the node's, and their count (each op pays the device's dispatch overhead)."""

    kept_bytes: int = 0
    kept_saved_bytes: int = 0
    kept_flops: int = 0
    flops: int = 0
    kept_io: int = 0
    io: int = 0
    kept_ops: int = 0

    def kept_share(self) -> float:
        """The kept ops' share of the node's forward compute: by FLOPs, else by bytes moved."""
        if self.flops:
            return self.kept_flops / self.flops
        return self.kept_io / self.io if self.io else 0.0


def check_policies(policies: Any) -> tuple[str, ...]:
    """The selective policies a plan may use, checked: names of `SELECTIVE` ("full" is always searched)."""
    if isinstance(policies, str):
        policies = (policies,)
    out = []
    for p in policies or ():
        if p == "full":
            continue
        if p not in SELECTIVE:
            raise PlanError(f"checkpoint_policies: {p!r:.60} is not a policy the planner searches; known: "
                            f"{['full', *SELECTIVE]} (of {list(POLICY_NAMES)}; \"attention-core\" is written by hand)")
        if p not in out:
            out.append(p)
    return tuple(out)


def sac_facts(nodes: list, blocks: list, trace: dict[str, list], packed: frozenset[int]
              ) -> dict[str, dict[int, SacFact]]:
    """{policy: {node index: SacFact}} for every selective policy and every op node of a captured block
    (NOTE [ops a policy keeps])."""
    out: dict[str, dict[int, SacFact]] = {}
    for name in SELECTIVE:
        pol = CHECKPOINT_POLICIES[name]
        facts: dict[int, SacFact] = {}
        for blk in blocks:
            run = PolicyRun(pol)  # one run of the checkpointed block's forward, as the runtime asks it
            for i in sorted(blk.nodes):
                if nodes[i].kind != "op":
                    continue
                ops = trace.get(nodes[i].name, [])
                kept = [op for op in ops if run.keeps(op.func)]
                facts[i] = SacFact(kept_bytes=sum(b for op in kept for _, b in op.made),
                                   kept_saved_bytes=sum(b for op in kept for sid, b in op.made if sid in packed),
                                   kept_flops=sum(op.flops for op in kept), flops=sum(op.flops for op in ops),
                                   kept_io=sum(op.io_bytes for op in kept), io=sum(op.io_bytes for op in ops),
                                   kept_ops=len(kept))
        out[name] = facts
    return out


def strategy_terms(b, i: int, c, fwd: float, rec: str, divisor: float) -> None:
    """Fill `c.sac` (policy -> (kept bytes, recompute seconds, kept bytes autograd also saves), per device) of node
    `i` under one strategy `c` (a `StrategyCost` whose `rec_s` is final): the bytes divided like its saved bytes
    (`divisor`); the recompute less the kept ops' share of the node's forward (`fwd`: its forward seconds, of
    which each dispatched op's overhead; `rec`: `NodeCosts.recomputed`). `b` is the cost graph builder."""
    oh = b.hw.op_overhead_s
    n_fwd = b.op_counts(i)[0]
    for p, facts in (b.g.sac or {}).items():
        f = facts.get(i, SacFact())
        r = c.rec_s
        if rec != "none" and f.kept_ops:
            r -= max(fwd - n_fwd * oh, 0.0) * f.kept_share() + f.kept_ops * oh
        c.sac[p] = (f.kept_bytes / divisor, max(r, 0.0), f.kept_saved_bytes / divisor)


__all__ = ["SELECTIVE", "SacFact", "check_policies", "sac_facts", "strategy_terms"]
