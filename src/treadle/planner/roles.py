"""What each mesh axis does in a plan (`Roles`), the training setup it is priced for (`TrainSpec`), and every role
assignment the planner searches: what each parallel form may do with the live axes
(`treadle.form.Form.role_options`), the rest tensor-parallel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..errors import PlanError
from ..form import forms
from ..mesh import Mesh


@dataclass(frozen=True, slots=True)
class Roles:
    """What each mesh axis does: `dp` (the data-parallel axes in mesh order, () for none; one axis name or
    None are accepted), `zero` (ZeRO-3 / FSDP2 over the dp axes not in `replicate`), the tensor axes in mesh
    order, and `off` (forbidden axes: every op is replicated on them). `replicate` (with `zero`): HSDP's
    replicate axes, a subset of `dp`; `reshard_after_forward` (with `zero`): False keeps gathered parameters
    from forward to backward (treadle.schedule.data_parallel); `ep`: the data-parallel axes every experts
    module's experts are split over, their flattened group (mesh order; one axis name or None are accepted; ():
    replicated), `ep_load` the busiest rank's routed rows over the mean
    charged under it (NOTE [expert load in a rehearsal]); `pp`: the pipeline axis (None: no pipeline), whose ranks
    each run a contiguous range of the repeated blocks as torch's `pp_schedule` orders them (None: the pipeline
    form's solve chooses it) over `pp_microbatches` micro-batches (`treadle.forms.pipeline.plan`); `float8`: the
    recipe the repeated blocks' linears train with (NOTE [execution and float8 in the plan]), None: none."""

    dp: tuple[str, ...]
    zero: bool
    tp: tuple[str, ...]
    off: tuple[str, ...] = ()
    replicate: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    ep: tuple[str, ...] = ()  # the data-parallel axes the experts are split over (`treadle.forms.expert`)
    pp: str | None = None  # the pipeline axis (`treadle.forms.pipeline`)
    pp_schedule: str | None = None
    pp_microbatches: int = 1
    pp_cuts: tuple[str, ...] = ()  # stage boundaries a partial schedule pins (blocks that end a stage)
    float8: str | None = None  # the recipe of the blocks' float8 linears (`treadle.forms.float8`), None: none
    ep_load: float = 1.0  # under `ep`: the busiest expert rank's routed rows over the mean, charged as stated
    ep_part: bool = True  # under `ep`: some blocks may keep their experts whole (False: the user stated the group)

    def __post_init__(self) -> None:
        dp = () if self.dp is None else (self.dp,) if isinstance(self.dp, str) else tuple(self.dp)
        object.__setattr__(self, "dp", dp)
        object.__setattr__(self, "replicate", tuple(self.replicate))
        if not set(self.replicate) <= set(dp) or (self.replicate and not self.zero):
            raise PlanError(f"Roles: replicate axes {self.replicate} must be data-parallel axes {dp} under zero")
        ep = () if self.ep is None else (self.ep,) if isinstance(self.ep, str) else tuple(self.ep)
        object.__setattr__(self, "ep", ep)
        if not set(ep) <= set(dp) or len(set(ep)) != len(ep):
            raise PlanError(f"Roles: the expert axes {ep} must be distinct data-parallel axes {dp}")
        if self.ep_load != 1.0 and not ep:
            raise PlanError(f"Roles: an expert load imbalance ({self.ep_load}) without an expert axis")
        if self.pp is not None and (self.pp in dp or self.pp in self.tp):
            raise PlanError(f"Roles: the pipeline axis {self.pp!r} is also data-parallel {dp} or tensor {self.tp}")

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """The axes ZeRO-3 shards parameters over (() without `zero`)."""
        return tuple(a for a in self.dp if a not in self.replicate) if self.zero else ()

    def __str__(self) -> str:
        parts = [label for f in forms() if (label := f.role_label(self))]  # the axes the forms take
        if self.tp:
            parts.append(f"tensor {','.join(self.tp)}")
        if self.off:
            parts.append(f"off {','.join(self.off)}")
        return "; ".join(parts) or "replicated"


@dataclass(frozen=True, slots=True)
class TrainSpec:
    """Training setup priced by the planner: optimizer state bytes per parameter element (AdamW: two fp32
    moments = 8), whether a fp32 master copy is kept for lower-precision parameters, and the selective checkpoint
    policies the plan may use besides full checkpointing (e.g. ("alternate-matmuls",); NOTE [checkpoint policies
    in the plan])."""

    optimizer_bytes_per_elem: int = 8
    master_copy: bool = True
    # selective checkpoint policies the planner may put blocks under, besides full checkpointing (NOTE [checkpoint
    # policies in the plan] in `treadle.planner.policies`)
    checkpoint_policies: tuple[str, ...] = ()

    def __post_init__(self) -> None:  # the names checked once, as a tuple (PlanError names the known ones)
        from .policy_facts import check_policies

        object.__setattr__(self, "checkpoint_policies", check_policies(self.checkpoint_policies))


def enumerate_roles(mesh: Mesh, *, batch: int | None,
                    dp_axis: str | tuple[str, ...] | None | Literal["auto"] = "auto", zero: bool | None = None,
                    forbid_axes: tuple[str, ...] = (), reshard_after_forward: bool | None = True,
                    replicate: tuple[str, ...] | None = None, facts: dict | None = None,
                    pp_axis: str | None | Literal["auto"] = "auto", pp_cuts: tuple[str, ...] = (),
                    pp_schedule: str | None = None, pp_microbatches: int | None = None,
                    float8: tuple[str, bool] | None = None, expert_load: float = 1.0,
                    ep_axis: Any = "auto") -> list[Roles]:
    """Every role assignment of the mesh's axes: each parallel form proposes what it may do with the live axes
    (`treadle.form.Form.role_options`; data parallelism on any subset of them whose sizes' product divides the
    batch — `dp_axis` "auto"; None: on none; an axis or a tuple: on exactly those — as DDP, ZeRO-3 or HSDP,
    `replicate` fixing HSDP's replicate axes or None searching, `zero` None (both) / False (DDP) / True (ZeRO-3
    / HSDP), `reshard_after_forward` the FSDP2 flag or None (both); a pipeline over one live axis — `pp_axis`
    "auto": any, None: none, an axis: that one — with its schedule and micro-batch count); the live axes no form
    takes are tensor-parallel; forbidden and size-1 axes are off. `pp_cuts`, `pp_schedule`, `pp_microbatches`: a
    pipeline's stage boundaries, schedule and micro-batch count pinned (a partial schedule's records). `float8`:
    (recipe, forced) — each assignment with and without float8 linears, or only with. `expert_load`: the busiest
    expert rank's routed rows over the mean, charged under an expert axis (NOTE [expert load in a rehearsal]);
    `ep_axis` the experts' split: "auto" (any group of axes that divides them), None (none), an axis or a tuple.
    `facts`: the capture's facts of the model (`CapturedGraph.facts`), which a form may read (a training-mode
    batch norm rules data parallelism out: NOTE [batch statistics] in `treadle.forms.data.facts`). Raises
    PlanError for a data-parallel axis that is not live."""
    for a in forbid_axes:
        mesh.axis_index(a)
    live = tuple(a for a in mesh.names if mesh.size(a) > 1 and a not in forbid_axes)
    off = tuple(a for a in mesh.names if a not in live)
    request = _RoleRequest(dp_axis, zero, reshard_after_forward, replicate, facts or {}, pp_axis, tuple(pp_cuts),
                           pp_schedule, pp_microbatches, float8, expert_load, ep_axis)
    options: list[dict] = [{}]
    for f in forms():
        mine = f.role_options(mesh, live, batch=batch, request=request)
        if mine is not None:
            options = [{**o, **m} for o in options for m in mine]
    out = []
    for opt in options:
        if not all(f.keep_roles(opt) for f in forms()):  # one form's choice the others' do not allow
            continue
        taken = set(opt.get("dp", ())) | ({opt["pp"]} if opt.get("pp") else set())
        out.append(Roles(tp=tuple(a for a in live if a not in taken), off=off,
                         **{"dp": (), "zero": False, **opt}))
    return out


@dataclass(frozen=True, slots=True)
class _RoleRequest:
    """What `enumerate_roles` was asked (each form reads its own part)."""

    dp_axis: Any
    zero: bool | None
    reshard_after_forward: bool | None
    replicate: tuple[str, ...] | None
    facts: Any = None  # every form's capture facts ({form name: facts}, `Form.capture_facts`), or None
    pp_axis: Any = "auto"  # the pipeline axis: "auto" (any live axis), None (no pipeline) or an axis name
    pp_cuts: tuple[str, ...] = ()  # stage boundaries pinned (blocks that end a stage)
    pp_schedule: str | None = None  # the pipeline's schedule and micro-batch count, pinned (None: searched)
    pp_microbatches: int | None = None
    float8: tuple[str, bool] | None = None  # (recipe, forced): NOTE [execution and float8 in the plan]
    expert_load: float = 1.0  # the busiest expert rank's rows over the mean (NOTE [expert load in a rehearsal])
    ep_axis: Any = "auto"  # the experts' split: "auto" (weighed), None (never), an axis or a tuple (that group)


def why_replicated(mesh: Mesh, roles: Roles, *, batch: int | None, tensor_shardable: dict[str, bool],
                   **role_request: Any) -> str:
    """Why a plan that shards nothing and runs no data parallelism replicates every axis of `mesh`, in words:
    for data parallelism, whether the batch does not split over the live axes (the role options with the batch
    have no data-parallel axis, those without it do: the forms' own rule, `enumerate_roles`), was not allowed,
    or was slower; for each tensor axis of `roles`, whether no op of the cost graph can shard on it
    (`tensor_shardable[axis]` False) or replicating was the solver's fastest choice; forbidden axes. The
    `role_request` keywords are `enumerate_roles`'s (dp_axis, zero, forbid_axes, ...)."""
    live = [a for a in mesh.names if mesh.size(a) > 1 and a not in roles.off]
    forbidden = [f"axis {a}={mesh.size(a)} forbidden" for a in roles.off if mesh.size(a) > 1]
    if not live:
        return "; ".join(forbidden or ["the mesh has no axis of size > 1"]) + "; every axis replicated"
    sizes = (f"{mesh.size(live[0])} ranks (axis {live[0]})" if len(live) == 1 else
             " or ".join(f"{a}={mesh.size(a)}" for a in live) + " (or their products)")
    reasons = []
    if role_request.get("dp_axis", "auto") is None:
        reasons.append("data parallelism was not allowed (dp_axis=None)")
    elif norms := ((role_request.get("facts") or {}).get("data") or {}).get("batch_statistics"):
        reasons.append(f"data parallelism would change the batch statistics of {norms[0]!r}"
                       + (f" and {len(norms) - 1} more batch norms" if len(norms) > 1 else "")
                       + " (training mode; NOTE [batch statistics])")
    elif any(r.dp for r in enumerate_roles(mesh, batch=batch, **role_request)):
        reasons.append("data parallelism was slower (the solver's estimate)")
    elif batch is not None and any(r.dp for r in enumerate_roles(mesh, batch=None, **role_request)):
        reasons.append(f"the batch {batch} does not split over {sizes}")
    for a in roles.tp:
        n = mesh.size(a)
        reasons.append(f"replicating on {a}={n} was fastest (the solver's estimate)" if tensor_shardable.get(a) else
                       f"no op can shard over {a}={n} (no dimension the sharding rules split divides by {n})")
    reasons += forbidden
    return "; ".join(reasons) + "; every axis replicated: each device computes the whole batch"


# NOTE [role assignments that solve alike]: the cost graph of a role assignment reads a mesh axis only through its
# role (tensor, data-parallel with its replicate / expert flags, unused), its size and its link, in the mesh's order
# of the axes it shards over; a pipeline axis shards nothing (its stages run on the other axes), so where it sits in
# the mesh is read nowhere. Two candidates with the same sequence of (size, link, role) over their non-pipeline
# axes, the same pipeline axis size and link and the same flags build the same cost graph up to axis names and
# solve alike: on 3-axis meshes of nodes x devices, (8, 8, 8) with the pipeline over either outer axis, or
# (2, 32, 8) with it over 32 and (32, 2, 8) with it over 32 (405B on 512 GPUs: 1447 candidates, 1015 distinct). The
# search solves the first of each. A cluster with measured links per group of axes (`group_links`, keyed by names)
# is never merged. tests/test_pipeline_plan.py solves every candidate of a 3-axis search and checks each group alike.
def alike_key(cluster, roles: Roles) -> tuple:
    """What a candidate's cost graph reads of its mesh and roles (NOTE [role assignments that solve alike])."""
    mesh = cluster.mesh
    if cluster.group_links:
        return (id(cluster), roles)

    names = [a for a in mesh.names if a != roles.pp]

    def role(a: str) -> tuple:
        kind = "dp" if a in roles.dp else "tp" if a in roles.tp else "off"
        return kind, a in roles.replicate, a in roles.ep

    axes = tuple((mesh.size(a), cluster.link(a), role(a)) for a in names)
    order = (tuple(names.index(a) for a in roles.dp), tuple(names.index(a) for a in roles.tp))
    pp = (mesh.size(roles.pp), cluster.link(roles.pp)) if roles.pp is not None else None
    return (axes, order, pp, roles.zero, roles.reshard_after_forward, roles.pp_schedule, roles.pp_microbatches,
            roles.pp_cuts, roles.float8, roles.ep_load, roles.ep_part, str(cluster.device), cluster.copy_bytes_per_s,
            cluster.threads_per_rank, cluster.ranks_per_host, cluster.cores_per_host)
