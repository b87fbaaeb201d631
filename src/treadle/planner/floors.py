"""The memory floor of a role assignment, before its costs (NOTE [a memory floor before the costs]): what it reads
(`FloorTerms`), the floor of the ILP's memory row (`memory_floor`; a form that owns the step's formula states its
own, `Form.memory_floor`), and the refusal (`OverMemoryFloor`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cost.cluster import ClusterSpec
from ..errors import PlanError
from .assembly import TemplateInfo
from .capture import CapturedGraph
from .roles import Roles

if TYPE_CHECKING:
    from .cost_graph import Unit

# NOTE [a memory floor before the costs]: under a budget most role assignments of a large model on many devices
# cannot fit at all (405B on 512 GPUs: tensor parallelism over two or three axes with no data parallelism holds
# the whole batch's activations, thousands of GiB), and their cost graphs are the dearest to build (a layout
# change over three axes is a search of thousands of layouts). Memory needs no conversion times: each strategy's
# static and saved bytes (`NodeCosts.strategy_memory`, the same functions `strategy_cost` adds, which the forms only
# add to) give each unit's smallest, and a role assignment whose every plan needs more than the budget is refused
# before its costs (`OverMemoryFloor`): the solver would find it infeasible. The floor of the ILP's memory row
# (`memory_floor`): the fixed bytes, every unit's smallest static bytes times its count, every unit outside the
# blocks' smallest saved bytes, and each block of a template the smaller of its units' smallest saved bytes and its
# smallest kept input (a checkpointed block keeps its input: (L - c) A + c In >= L min(A, In)); the transient block
# and every form's further rows only add. A pipeline's rows are per rank (`Form.memory_floor`:
# NOTE [a memory floor of the stages] in `treadle.forms.pipeline.floors`). The search lists such a role assignment
# as infeasible and builds it only where no role assignment fits (the error then names the smallest budget any
# plan meets, from every solve).
class OverMemoryFloor(PlanError):
    """No plan of a role assignment fits the budget: its memory floor is over it (`floor_bytes`)."""

    def __init__(self, message: str, floor_bytes: float):
        super().__init__(message)
        self.floor_bytes = floor_bytes


@dataclass(slots=True)
class FloorTerms:
    """What a memory floor reads (NOTE [a memory floor before the costs]): the units and templates of a cost graph
    being built, each unit's smallest static bytes and saved bytes over its strategies (per execution), its smallest
    static bytes without its gradients (`base_min`: a pipeline stage holds its gradients from its first backward,
    NOTE [a rank's memory at each moment]), and the fixed bytes."""

    graph: CapturedGraph
    cluster: ClusterSpec
    roles: Roles
    units: list[Unit]
    templates: dict[int, TemplateInfo]
    static_min: list[float]
    act_min: list[float]
    base_min: list[float]
    fixed: float

    def block_min(self, t: int) -> float:
        """`block_min` of template t."""
        return block_min(self.templates[t], self.act_min)


def unit_memory_mins(unit: "Unit", nodes, memory) -> tuple[float, float, float]:
    """A unit's smallest static, saved and static-without-gradients bytes over its strategies, each strategy the sum
    of its members' `memory(node, combo, published)` (`NodeCosts.strategy_memory`: static, saved, gradients)."""
    per = []
    for members in unit.strategies:
        static = saved = grads = 0.0
        for i, (combo, pub) in members.items():
            a, b, c = memory(nodes[i], combo, pub)
            static += a
            saved += b
            grads += c
        per.append((static, saved, static - grads))
    return min(x[0] for x in per), min(x[1] for x in per), min(x[2] for x in per)


def block_min(info: TemplateInfo, act_min: list[float]) -> float:
    """The fewest bytes one block of a template keeps: its units' smallest saved bytes (`act_min`, per unit), or
    its smallest kept input where checkpointing it keeps less."""
    saved = sum(act_min[u] for u in info.units)
    return min(saved, min(info.input_bytes)) if info.input_bytes else saved


def memory_floor(ft: FloorTerms) -> float:
    """A lower bound of the ILP's memory row over every plan of the role assignment (NOTE [a memory floor before
    the costs])."""
    in_template = {u for info in ft.templates.values() for u in info.units}
    total = ft.fixed + sum(unit.count * ft.static_min[u] for u, unit in enumerate(ft.units))
    total += sum(unit.count * ft.act_min[u] for u, unit in enumerate(ft.units) if u not in in_template)
    return total + sum(info.count * ft.block_min(t) for t, info in ft.templates.items())
