"""`Plan`: the planner's answer as plain data — decisions (schedule primitives with the node that justifies each),
the predicted step time split by term, the peak memory, per-module rows, the binding constraint and solver
statistics — and what can be done with it: its schedule, its price, JSON, a diff, a what-if.

`Plan.schedule` applies the decisions to the model given to `plan_model` (or `schedule_for(model)` after
`Plan.load`); the search that makes a plan is `treadle.planner.search`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from ..cost.cluster import ClusterSpec
from ..errors import PlanError
from ..pricing.result import Estimate
from ..units import GiB
from .capabilities import runtime_capabilities
from .rows import PlanRow
from .to_schedule import Decision, apply_decisions, decisions_python


@dataclass(slots=True)
class Plan:
    """The planner's answer. See the module doc; `schedule` needs the model (`schedule_for`)."""

    model: dict | None
    cluster: ClusterSpec
    roles: str
    mode: str
    budget_bytes: float | None
    decisions: list[Decision]
    estimated: Estimate
    rows: list[PlanRow]
    binding: str
    solver: dict
    unknown_ops: dict[str, int] = field(default_factory=dict)
    price: dict | None = None  # `treadle.pricing.Price.to_dict()` of the schedule, once `estimate()` ran
    execution: str = "eager"  # how the plan runs and is priced (NOTE [execution and float8 in the plan])
    _model: Any = None  # nn.Module given to plan_model (not serialised)
    _schedule: Any = None
    _context: Any = None  # plan_model's inputs and a re-planner for what_if (not serialised)

    # ------------------------------------------------------------------ schedule
    @property
    def schedule(self):
        """The Schedule of the planned model (built once). Raises PlanError after `load` (no model)."""
        if self._schedule is None:
            if self._model is None:
                raise PlanError("Plan.schedule: this plan was loaded from JSON and holds no model; "
                                "use plan.schedule_for(model)")
            self._schedule = self.schedule_for(self._model)
        return self._schedule

    def schedule_for(self, model: nn.Module):
        """A fresh Schedule of `model` with this plan's decisions applied."""
        from ..schedule.core import create_schedule

        sch = create_schedule(model, mesh=self.cluster.mesh)
        _, is_leaf_module = runtime_capabilities(model)
        return apply_decisions(sch, self.decisions, leaf_module=is_leaf_module)

    def what_if(self, **changes: Any) -> tuple["Plan", list[str]]:
        """Re-plan with some `plan_model` arguments changed — e.g. ``pins={"*.mlp.fc.weight": {"tp": 0}}``
        ("why not tensor parallelism on the MLP?") — and return the new plan and its `diff` from this one.
        Raises PlanError after `load` (no model) or when the changed problem has no plan."""
        if self._context is None:
            raise PlanError("Plan.what_if: this plan was loaded from JSON; re-plan with plan_model")
        other = self._context["replan"](**changes)
        return other, self.diff(other)

    def estimate(self) -> Estimate:
        """Predicted step time, peak memory and MFU per device: the price of `schedule`
        (`treadle.pricing.price`, one price for every schedule), computed on first call and kept in
        `price`. `estimated` stays the solver's own figure (its memory model is what the budget binds).
        A plan loaded from JSON without a stored price, or made from positional inputs, returns `estimated`.
        Raises PlanError when the schedule was built already (price an unbuilt schedule)."""
        if self.price is None and self._model is not None and self._context is not None \
                and isinstance(self._context["inputs"], dict):
            from ..pricing import price

            self.price = price(self.schedule, self._context["inputs"], self.cluster,
                               loss_fn=self._context["kwargs"].get("loss_fn"), execution=self.execution).to_dict()
        if self.price is None:
            return self.estimated
        p = self.price
        return Estimate(p["step_s"], p["peak_bytes"], p["mfu"], p["compute_s"], p["exposed_comm_s"],
                        p["recompute_s"], p["static_bytes"], p["activation_bytes"], p["transient_bytes"])

    def python_lines(self) -> list[str]:
        """The decisions as schedule calls, without the model (`treadle.planner.to_schedule.decisions_python`)."""
        return decisions_python(self.decisions)

    def explain(self) -> str:
        """A text table per module (layouts, compute / communication / recompute time, memory) and the
        binding constraint. `treadle.planner.explain.plan_table` gives the same as a rich Table."""
        from .explain import explain_text

        return explain_text(self)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        sch_json = None
        if self._model is not None or self._schedule is not None:
            sch_json = json.loads(self.schedule.to_json())
        return {
            "format": "treadle.plan/1",
            "model": self.model,
            "cluster": self.cluster.to_dict(),
            "roles": self.roles,
            "mode": self.mode,
            "budget_bytes": self.budget_bytes,
            "decisions": [d.to_dict() for d in self.decisions],
            "estimate": asdict(self.estimated),
            "rows": [asdict(r) for r in self.rows],
            "binding": self.binding,
            "solver": self.solver,
            "unknown_ops": self.unknown_ops,
            "price": self.price,
            "execution": self.execution,
            "schedule": sch_json,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "plan") -> "Plan":
        """A plan read from a file, as data: every decision is checked and a Ref it names passes the schedule
        gate (NOTE [files are data]). Raises PlanError naming `source` (and the decision) for another format,
        a missing or malformed field, or a name a file may not hold."""
        from ..errors import TreadleError

        if not isinstance(d, dict) or d.get("format") != "treadle.plan/1":
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise PlanError(f"{source}: not a treadle plan (format {got!r:.80}, expected 'treadle.plan/1')")
        try:
            decisions = [Decision.from_dict(x, where=f"{source}: decision {i}") for i, x in enumerate(d["decisions"])]
            return cls(d["model"], ClusterSpec.from_dict(d["cluster"]), d["roles"], d["mode"], d["budget_bytes"],
                       decisions, Estimate(**d["estimate"]), [PlanRow(**r) for r in d["rows"]], d["binding"],
                       d["solver"], d.get("unknown_ops", {}), d.get("price"), _execution(d, source))
        except PlanError:
            raise
        except TreadleError as exc:
            raise PlanError(f"{source}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
            raise PlanError(f"{source} is malformed: missing or wrong field ({type(exc).__name__}: "
                            f"{str(exc)[:200]})") from None

    @classmethod
    def from_json(cls, text: str, *, source: str = "plan JSON") -> "Plan":
        from ..schedule.gate import parse_json

        return cls.from_dict(parse_json(text, source=source, error=PlanError), source=source)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path) as f:
            return cls.from_json(f.read(), source=str(path))

    # ------------------------------------------------------------------ diff
    def diff(self, other: "Plan") -> list[str]:
        """Human-readable differences: roles, decisions only in one plan, estimate changes."""
        out = []
        if self.roles != other.roles:
            out.append(f"roles: {self.roles} -> {other.roles}")
        mine = {str(d) for d in self.decisions}
        theirs = {str(d) for d in other.decisions}
        out += [f"- {d}" for d in sorted(mine - theirs)]
        out += [f"+ {d}" for d in sorted(theirs - mine)]
        a, b = self.estimated, other.estimated
        if abs(a.step_s - b.step_s) > 1e-12 or abs(a.peak_bytes - b.peak_bytes) > 0.5:
            out.append(f"step {a.step_s * 1e3:.3f} ms -> {b.step_s * 1e3:.3f} ms "
                       f"({(b.step_s / a.step_s if a.step_s else math.inf):.3f}x); "
                       f"peak {a.peak_bytes / GiB:.3f} GiB -> {b.peak_bytes / GiB:.3f} GiB")
        return out


def _execution(d: dict, source: str) -> str:
    """A plan file's execution ("eager" when absent: plans written before it was stated)."""
    from ..pricing.compiled import EXECUTIONS

    ex = d.get("execution", "eager")
    if ex not in EXECUTIONS:
        raise PlanError(f"{source}: execution must be one of {list(EXECUTIONS)}, got {ex!r:.40}")
    return ex
