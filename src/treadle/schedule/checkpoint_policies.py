"""Checkpoint policies as the peers define them, by name: what a checkpointed module keeps and what it recomputes.

NOTE [checkpoint policies as peers define them]: "selective" checkpointing means different things in different
projects, and a user comparing against a published run must be able to state the one that run used:

- ``"full"``: recompute the whole module's forward in backward (`Schedule.checkpoint()`; torchtitan's ``full``,
  Megatron's ``recompute_granularity=full``).
- ``"alternate-matmuls"``: torchtitan's op-level selective AC (``mode = "selective", selective_ac_option = "op"``):
  keep the outputs of the attention kernels, of the sequence-parallel reduce-scatters and of ``aten.max`` (the
  amax of float8 scaling), and of every *other* matmul (``aten.mm``: the 1st, 3rd, ... of the module's forward
  are kept, the 2nd, 4th, ... recomputed); recompute everything else.
- ``"attention-core"``: Megatron-LM's selective recomputation (``recompute_granularity=selective``,
  ``recompute_modules=["core_attn"]``): recompute the attention core only. Each
  ``F.scaled_dot_product_attention`` call the module makes runs under a checkpoint of its own (it keeps q, k, v;
  not its output and log-sum-exp, nor, on a math path, its scores and probabilities); everything else is saved
  as without checkpointing. An eager core (matmul, softmax, matmul written out) is not an SDPA call:
  `treadle.models.kernel_schedule` puts such cores on SDPA first (NOTE [attention by data flow]); a module
  whose forward makes no SDPA call is warned about once, at its first training step.
- layer-level every-k (torchtitan's ``selective_ac_option = "k"``): full checkpointing of every k-th block of a
  stack, `Schedule.checkpoint_every(k)` (it records one ``checkpoint`` per chosen block: a file says which).

"alternate-matmuls" runs as `torch.utils.checkpoint`'s selective checkpointing
(`create_selective_checkpoint_contexts`) around the module, "attention-core" as a checkpoint around each SDPA
call (`treadle.runtime.graph_steps`); either way what the price rehearses is what runs.

A policy is data (a name in this table), so a schedule file that names one runs nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ScheduleError

# the attention kernels PyTorch dispatches SDPA to (CUDA's flash / memory-efficient / cuDNN, the CPU's flash and
# the math fallback, whose ops are not one kernel but are listed for completeness)
_SDPA = ("aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
         "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
         "aten._scaled_dot_product_fused_attention_overrideable")


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """One named policy. `how`: "selective" (SAC over the module's ops, by the tables below) or
    "attention-calls" (each SDPA call checkpointed on its own). `keep`: ops whose outputs are kept (an op name ``ns.op`` matches every overload,
    ``ns.op.overload`` that one); `alternate`: ops of `keep` kept only at odd counts (1st, 3rd, ...) within one
    run of the module's forward and recomputed at even ones; `recompute`: ops recomputed when `default` is
    "keep"; `default`: what every other op does ("recompute" or "keep"). `source`: whose definition it is."""

    name: str
    how: str
    keep: tuple[str, ...]
    alternate: tuple[str, ...]
    recompute: tuple[str, ...]
    default: str
    source: str


CHECKPOINT_POLICIES: dict[str, CheckpointPolicy] = {
    "alternate-matmuls": CheckpointPolicy(
        "alternate-matmuls", "selective",
        keep=("aten.mm", *_SDPA, "_c10d_functional.reduce_scatter_tensor", "aten.max.default"),
        alternate=("aten.mm",), recompute=(), default="recompute",
        source="torchtitan op-level selective AC (torchtitan/distributed/activation_checkpoint.py, _save_list and "
               "the every-other-mm rule)"),
    "attention-core": CheckpointPolicy(
        "attention-core", "attention-calls", keep=(), alternate=(), recompute=(), default="keep",
        source="Megatron-LM selective recomputation, recompute_modules=['core_attn'] "
               "(megatron/core/transformer/transformer_config.py)"),
}

POLICY_NAMES = ("full", *CHECKPOINT_POLICIES)


def checkpoint_policy(name: object, where: str) -> CheckpointPolicy | None:
    """The policy named `name` (None for "full"). Raises ScheduleError naming the known ones."""
    if name == "full":
        return None
    if not isinstance(name, str) or name not in CHECKPOINT_POLICIES:
        raise ScheduleError(f"checkpoint at {where}: unknown policy {name!r:.60}; known: {list(POLICY_NAMES)} "
                            f"(NOTE [checkpoint policies as peers define them])")
    return CHECKPOINT_POLICIES[name]


def _ops(names) -> tuple[frozenset, frozenset]:
    """(packets, overloads) named by ``ns.op`` / ``ns.op.overload``; a name this torch does not have is skipped
    (a kernel of another backend or version: no op of it can run here)."""
    packets, overloads = set(), set()
    for name in names:
        ns, op, *ov = name.split(".")
        try:
            packet = getattr(getattr(torch.ops, ns), op)
        except (AttributeError, RuntimeError):
            continue
        if ov:
            overload = getattr(packet, ov[0], None)
            if overload is not None:
                overloads.add(overload)
        else:
            packets.add(packet)
    return frozenset(packets), frozenset(overloads)


class PolicyRun:
    """What a "selective" policy keeps, op by op, over one run of the checkpointed module's forward: the one
    decision the runtime asks (`treadle.runtime.graph_steps.NamedPolicy`) and the planner replays over a captured
    block's ops (NOTE [ops a policy keeps] in `treadle.planner.policy_facts`). The alternate ops are counted within
    the run, apart in the forward and in its recomputation, so both make the same choices."""

    def __init__(self, spec: CheckpointPolicy) -> None:
        self.keep = _ops(spec.keep)
        self.alternate = _ops(spec.alternate)
        self.recompute = _ops(spec.recompute)
        self.default_keep = spec.default == "keep"
        self.counts: dict[tuple[bool, object], int] = {}

    @staticmethod
    def _is(func, ops) -> bool:
        return func in ops[1] or getattr(func, "overloadpacket", None) in ops[0]

    def keeps(self, func: Any, *, recompute: bool = False) -> bool:
        """Whether the op `func` (an OpOverload) is kept, the next time it runs in this run's forward (or, with
        `recompute`, in its recomputation)."""
        if self._is(func, self.recompute):
            return False
        if self._is(func, self.keep):
            if self._is(func, self.alternate):
                key = (recompute, getattr(func, "overloadpacket", func))
                self.counts[key] = self.counts.get(key, 0) + 1
                return self.counts[key] % 2 == 1
            return True
        return self.default_keep


def resolve_ops(names: Sequence[str], where: str) -> list[Any]:
    """aten op packets from names like ``"aten.mm"``. Raises ScheduleError naming unknown ones."""
    out, bad = [], []
    for name in names:
        ns, _, op = name.partition(".") if isinstance(name, str) else ("", "", "")
        packet = None
        # a plain namespace and op name (private ops such as aten._scaled_dot_product_flash_attention are ops;
        # no dunder: nothing but an op packet is looked up)
        if ns.isidentifier() and op.isidentifier() and not ns.startswith("_") and not op.startswith("__"):
            try:
                packet = getattr(getattr(torch.ops, ns), op)
            except (AttributeError, RuntimeError):  # torch.ops says "no such op" either way
                packet = None
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            bad.append(name)
        else:
            out.append(packet)
    if bad:
        raise ScheduleError(f"checkpoint_selective at {where}: unknown ops {bad}; name aten ops as 'aten.<op>', "
                            f"e.g. 'aten.mm', 'aten.addmm'")
    return out
