"""What a parallel form is to the core layers: the faces a form may have, and the one registry of forms.

A parallel form (tensor parallelism, sequence parallelism, the vocab-parallel loss, data parallelism; pipeline
and expert parallelism next) is one package under `treadle/forms/` that owns everything about itself: the
recipe steps that state it, what `build` installs for it, the planner's options and cost terms, the price's
hooks and its labels. It subclasses `Form`, overriding only the faces it has, and `treadle/forms/__init__.py`
registers every form here, in a fixed order (`register_form`).

The core layers (schedule, runtime, pricing, planner) never import a form: at each extension point they ask
`forms()` and call that face of every form, in registration order. A face's default does nothing, so a form
that has no say at a point costs nothing there. The extension points, grouped by the layer that calls them
(each docstring below names its caller):

- capture (`treadle.planner.capture`): `capture_facts` — facts of the model a form's costs need later;
- parameters (`treadle.forms.data`, at build and in the price): `own_params` — the parameters whose gradients a
  form reduces itself, which data parallelism leaves alone (the local experts); `shard_units` — modules FSDP2
  shards on other axes than the data-parallel ones (the local experts over the axes the expert axis leaves);
  `gather_itemsize` — the bytes per element FSDP2 gathers a parameter in (float8 weights: 1);
- what build can shard (`treadle.planner.capabilities`): `param_placements` — placements of parameters no leaf rule
  shards but the form computes on (each expert's weights over a tensor axis);
- roles (`treadle.planner.roles`): `role_options` — what the form may do with the mesh's axes; `keep_roles`;
  `role_label`;
- cost graph (`treadle.planner.cost_graph`): `prepare`, `keep_strategy`, `extra_publishes`, `conversion`,
  `node_cost`, `param_cost`, `graph_terms` — per node, per parameter and per role assignment;
- ILP (`treadle.planner.ilp`): `ilp_rows`, `evaluate`, `memory_rows`, `peak_bytes` — the form's constraint
  families, and the same terms computed directly for a choice; `solve` — the whole MILP, for a form that owns the
  step's formula (the pipeline); `price_variants` — that role assignment pinned each way its `solve` chose among,
  for the final choice by price (`treadle.planner.search`);
- decisions (`treadle.planner.to_schedule`): `decide_node`, `decisions` — the primitives that state the chosen
  form; explanation (`treadle.planner.rows`): `adjust_rows`;
- the training loops (`treadle.runtime.optimizer.after_optimizer_step`): `after_optimizer_step`;
- price (`treadle.pricing`): `price_step` — the form's collectives, host costs and memory in a rehearsed step;
  `price_schedule` — the whole price, for a form that owns the step's timeline (the pipeline).

What the runtime installs for a form is registered with `treadle.runtime.steps.register_build_extension`
by the form's package, beside its `register_form`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .errors import TreadleError
from .lazy import load_registrations

# A face's arguments are the calling layer's own objects (its builder, model, cost graph or rehearsal): typed
# `Any` here so that this module, at the bottom of the tree, imports none of them.


@dataclass(slots=True)
class PriceTerms:
    """What a form adds to one priced step (`Form.price_step`): collectives (`treadle.cost.overlap.Collective`)
    on the step's timeline; `gathered_bytes` held at the peak (FSDP2's gathered units); `grad_copies`: copies of
    the local gradients held for the whole step (DDP's flat buckets: 1); `param_divisor`: the ranks one
    parameter, its gradient and its optimizer state are split over (ZeRO-3), and `divisors` the same per
    parameter name where it differs (a unit on axes of its own: the experts, NOTE [experts under FSDP2]);
    `subclass_params`: the parameters are tensor subclasses (DTensor) in the optimizer step; `label`: how the
    step names the form ("ddp over dp", ...); `foreign`: names of parameters another form reduces itself."""

    collectives: list = field(default_factory=list)
    gathered_bytes: float = 0.0
    grad_copies: int = 0
    param_divisor: int = 1
    subclass_params: bool = False
    label: str | None = None
    foreign: frozenset = frozenset()
    divisors: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ShardUnit:
    """A module FSDP2 shards on its own axes (`Form.shard_units`): `path` in the unbuilt model, sharded over the
    flattened `shard_axes` and, when `replicate_axes` are given, replicated over them (HSDP's 2-D mesh)."""

    path: str
    shard_axes: tuple[str, ...]
    replicate_axes: tuple[str, ...] = ()


class Form:
    """One parallel form's faces; every face's default does nothing (see the module doc for the callers)."""

    name: str = ""

    # ------------------------------------------------------------------ capture and roles
    def capture_facts(self, model: Any) -> Any:
        """Facts of the model the form's costs need (`CapturedGraph.facts[name]`); None: none."""
        return None

    def own_params(self, model: Any, view: Any) -> set[str]:
        """Names of the parameters of `model` (every alias) whose gradients this form reduces itself, so data
        parallelism leaves them alone (`view`: the schedule's `ScheduleView`)."""
        return set()

    def shard_units(self, model: Any, view: Any) -> list["ShardUnit"]:
        """Modules of `model` whose parameters FSDP2 shards as units of their own, on other mesh axes than the
        data-parallel ones (under a data parallelism with ZeRO-3; `treadle.forms.data` wraps them first and
        prices them per unit); none by default."""
        return []

    def gather_itemsize(self, view: Any, name: str) -> int | None:
        """Bytes per element FSDP2 all-gathers parameter `name` (a path in `view.model`) in, when this form
        changes it (float8 weights gathered as float8: 1); None: the parameter's own dtype."""
        return None

    def param_placements(self, facts: Any, param: str, module: str, n_tp: int) -> set[tuple[int, ...]]:
        """Placements over `n_tp` tensor axes (placement codes, one per axis) that build can give parameter `param`
        where `module` reads it, besides those of the runtime's leaf rules: a form that computes on shards its own
        way (each expert's weights split over a tensor axis). `facts`: the capture's facts of the model."""
        return set()

    def role_options(self, mesh: Any, live: tuple[str, ...], *, batch: int | None, request: Any) -> list[dict] | None:
        """Role assignments this form can make of the `live` axes, as keyword arguments of
        `treadle.planner.roles.Roles` (the axes it takes; the tensor axes are the rest); None: no say."""
        return None

    def keep_roles(self, options: dict) -> bool:
        """Whether a merged role assignment (every form's `role_options` combined: keyword arguments of `Roles`)
        is one this form can run (the expert axis must be a data-parallel one)."""
        return True

    def role_label(self, roles: Any) -> str | None:
        """This form's part of a role assignment's description ("data-parallel dp (ZeRO-3)"); None: absent."""
        return None

    # ------------------------------------------------------------------ cost graph
    def prepare(self, b: Any) -> None:
        """Before strategies are enumerated: find what the form's options need in the graph (`b`: the cost
        graph builder)."""

    def keep_strategy(self, b: Any, n: Any, spec: Any, combo: tuple) -> bool:
        """Whether node `n` (its dimension spec `spec`, or None) may run `combo` (one option per tensor axis) as
        far as this form is concerned."""
        return True

    def extra_publishes(self, b: Any, n: Any, raw: tuple, exitable: bool) -> list[tuple]:
        """Layouts `n` may publish besides its raw layout and Replicate (placement codes per tensor axis)."""
        return []

    def conversion(self, b: Any, i: int, raw: tuple, pub: tuple) -> tuple[float, float] | None:
        """(forward, backward) seconds of node `i`'s change of layout from `raw` to `pub` when this form changes it
        its own way; None: the core's cheapest conversion. The first form that answers is used."""
        return None

    def node_cost(self, b: Any, n: Any, combo: tuple, pub: tuple, cost: Any, rec: str) -> None:
        """Add this form's communication of node `n` under (`combo`, `pub`) to `cost` (a StrategyCost); `rec`
        says how much of the node a checkpointed block's recompute runs again ("all", "compute", "none")."""

    def param_cost(self, b: Any, meta: Any, pl: tuple, cost: Any) -> None:
        """Add this form's terms for one parameter (`meta`, placement codes `pl` on the tensor axes), owned by
        the node being priced, to `cost`."""

    def graph_terms(self, b: Any, cg: Any) -> None:
        """Terms that are constant for a role assignment, set on the finished cost graph `cg`."""

    # ------------------------------------------------------------------ ILP and evaluation
    def ilp_rows(self, m: Any, cg: Any, s: Any, shared: dict) -> None:
        """Add this form's variables and constraint families to the MILP `m` (`s[u, k]`: strategy variables);
        `shared` carries what one form's rows hand to another's (documented where it is set)."""

    def evaluate(self, cg: Any, choice: list[int], acc: dict) -> None:
        """Add this form's terms of a choice to `acc` (compute_s, comm_s, window_s, ...), as `ilp_rows` states
        them (`treadle.planner.ilp.evaluate`)."""

    def solve(self, cg: Any, *, budget_bytes: float | None, checkpoint: bool, time_limit_s: float, rel_gap: float,
              min_ckpt: dict, minimise: str, cutoff_s: float | None = None) -> Any:
        """The best plan of a role assignment (a `treadle.planner.ilp.Solution`) when this form owns the step's
        formula (a pipeline: its stages, micro-batches and bubble), else None (`treadle.planner.ilp.solve` asks
        every form first; the arguments are its own; `cutoff_s`: NOTE [a cutoff from the best plan found])."""
        return None

    def memory_floor(self, ft: Any) -> float | None:
        """A lower bound of every plan's peak bytes per device when this form owns the step's formula (as `solve`),
        from `ft` (`treadle.planner.floors.FloorTerms`: each unit's smallest static and saved bytes); None
        otherwise (NOTE [a memory floor before the costs])."""
        return None

    def price_variants(self, cg: Any, sol: Any) -> list[tuple[Any, bool]]:
        """When this form owns the step's formula (as `solve`): the role assignment of `cg` pinned to each way of
        running it that its solve chose among by its linear model alone (a pipeline: each schedule kind), as
        (cost graph, whether `sol` runs that way); the final choice by price re-solves and prices each on its own
        (NOTE [each schedule priced on its own] in `treadle.planner.candidates`). [] for none."""
        return []

    def memory_rows(self, m: Any, cg: Any, v: Any) -> list[tuple[dict, float]]:
        """Further points of the step whose memory must fit the budget, as (terms, constant) rows."""
        return []

    def peak_bytes(self, cg: Any, choice: list[int], ckpt: dict, counts: dict) -> float:
        """The largest of `memory_rows` for a choice (`counts`: blocks per variant, NOTE [block variants] in
        `treadle.planner.variants`), in bytes (0: none)."""
        return 0.0

    # ------------------------------------------------------------------ schedule
    def decide_node(self, ctx: Any, i: int, n: Any, combo: tuple, raw: tuple, pub: tuple) -> set[str]:
        """State node `i`'s chosen strategy in the decision buckets of `ctx` (`treadle.planner.to_schedule`);
        returns the tensor axes whose change of layout from `raw` to `pub` this form stated (the core then
        states none for them)."""
        return set()

    def decisions(self, cg: Any, choice: list[int], ckpt: dict, ctx: Any) -> list[tuple[int, Any, Any]]:
        """The primitives stating this form in a solution, as (rank, sort key, Decision): decisions are emitted
        by rank (`treadle.planner.to_schedule.DECISION_RANKS`), then key."""
        return []

    # ------------------------------------------------------------------ runtime
    def after_optimizer_step(self, model: Any) -> None:
        """What the form's runtime does after each optimizer step of a built `model` (float8: the weights' scales
        for FSDP2's next gathers, in one all-reduce); called by `treadle.runtime.optimizer.after_optimizer_step`."""

    # ------------------------------------------------------------------ price
    def adjust_rows(self, cg: Any, choice: list[int], rows: dict, shared: dict) -> None:
        """Add this form's terms to the per-module rows of a plan's explanation (`treadle.planner.rows`; `rows`: path
        -> PlanRow); `shared` carries what one form's rows hand to another's."""

    def price_step(self, ctx: Any) -> PriceTerms | None:
        """The form's part of a rehearsed step (`treadle.pricing`); None: nothing."""
        return None

    def price_schedule(self, sch: Any, example_inputs: dict, cluster: Any, options: dict) -> Any:
        """The whole price of `sch` when this form owns the step's timeline (a pipeline: stages, micro-batches,
        the bubble), else None (`treadle.pricing.price` asks every form first; `options`: its keyword
        arguments). The form prices through the pricing layer's own parts (`treadle.pricing.step`)."""
        return None


_FORMS: dict[str, Form] = {}


def register_form(form: Form) -> Form:
    """Register a parallel form (called once per form, by `treadle/forms/__init__.py`). The registration order
    is the order the core layers call the forms in. Raises TreadleError for a second form of one name."""
    if not form.name:
        raise TreadleError(f"register_form: {type(form).__name__} has no name")
    if form.name in _FORMS:
        raise TreadleError(f"register_form: a form named {form.name!r} is already registered "
                           f"({type(_FORMS[form.name]).__name__})")
    _FORMS[form.name] = form
    return form


def forms() -> Iterator[Form]:
    """Every registered form, in registration order."""
    load_registrations()
    return iter(tuple(_FORMS.values()))


def get_form(name: str) -> Form:
    """The form registered as `name`. Raises TreadleError listing the registered forms."""
    load_registrations()
    try:
        return _FORMS[name]
    except KeyError:
        raise TreadleError(f"no parallel form {name!r}; registered: {list(_FORMS)}") from None
