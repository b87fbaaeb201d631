"""Which collective runs where: explicit syncs checked against the layouts sharded leaves produce, and
derived collectives only where no explicit sync states the same step.

NOTE [explicit replaces derived]: a sync written by the user (Slapo style, ``op="all_reduce"``, or typed,
``to=Replicate(), from_=Partial()``) is a statement of the collective at that point. Build installs it
*instead of* the collective it would derive there, never in addition:

* the input-gradient reduction of a column-parallel leaf on axis `a` is replaced by a reducing ``bwd_post``
  (all-reduce, or typed Partial -> Replicate) on axis `a` recorded on that leaf or on any module above it
  (Slapo's ``sch["attn"].sync("bwd_post", op="all_reduce")`` for q, k and v at once);
* a ``bwd_post`` reduce-scatter is the backward of a ``fwd_pre`` all-gather on the same module and axis (the
  sequence-parallel form): the gather then reduce-scatters in backward, and nothing else reduces;
* the pending sum of a row-parallel (or vocab-parallel) leaf is reduced by a ``fwd_post`` sync on the leaf, on
  a module above it, or by any other module's sync that states it reduces a Partial on that axis; with no such
  statement anywhere, build derives an all-reduce right after the leaf (never a silently partial output).

Every explicit op is checked against the layout build knows there (a leaf's output, the previous ``fwd_post``
of the same module, the input gradient of a column-parallel leaf): reducing a sharded output, gathering a
replicated one, or reducing a complete gradient is a ScheduleError naming path, axis and both layouts.
Typed ``fwd_post`` syncs on one module chain: each starts from the layout the previous one left.

Pure: reads the schedule's SyncSpecs and the leaves' planned layouts, builds no process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..errors import BuildError, ScheduleError
from ..schedule.state import SyncSpec


@dataclass
class SyncPlan:
    """What `install_syncs` installs. Indices are positions in the schedule's list of syncs."""

    src: dict[int, dict[str, Placement]] = field(default_factory=dict)  # sync -> layout it starts from (per axis)
    final: dict[str, dict[str, Placement]] = field(default_factory=dict)  # leaf -> output layout after build's hooks
    derived_reduce: dict[str, list[str]] = field(default_factory=dict)  # leaf -> axes all-reduced at its output
    grad_replaced: set[tuple[str, str]] = field(default_factory=set)  # (column leaf, axis): explicit bwd_post reduces
    fused: dict[str, set[str]] = field(default_factory=dict)  # module -> axes whose fwd_pre gather reduce-scatters back
    merged: set[int] = field(default_factory=set)  # bwd_post reduce-scatters carried out by a fwd_pre gather


def _under(path: str, ancestor: str) -> bool:
    """`path` is `ancestor` or inside it."""
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def _name(p: Placement) -> str:
    return "Partial()" if isinstance(p, Partial) else repr(p)


def _compatible(have: Placement, need: Placement) -> bool:
    """Same placement; Shard dims compare only when both count from the same end (the rank is known later)."""
    if type(have) is not type(need):
        return False
    if isinstance(have, Shard):
        return have.dim == need.dim or (have.dim < 0) != (need.dim < 0)
    return True


def op_source(spec: SyncSpec) -> Placement:
    """The placement an explicit op consumes on its axis."""
    kw = spec.kw()
    if spec.op in ("all_reduce", "reduce_scatter"):
        return Partial()
    if spec.op == "all_gather":
        return Shard(kw["dim"])
    if spec.op == "split":
        return Replicate()
    return Shard(kw["concat_dim"])  # all_to_all


def op_result(spec: SyncSpec) -> Placement:
    """The placement an explicit op leaves on its axis."""
    kw = spec.kw()
    if spec.op in ("all_reduce", "all_gather"):
        return Replicate()
    if spec.op in ("reduce_scatter", "split"):
        return Shard(kw["dim"])
    return Shard(kw["split_dim"])  # all_to_all


def after(spec: SyncSpec) -> dict[str, Placement]:
    """The layout a fwd_post sync leaves on the axes it names."""
    if spec.to is not None:
        return dict(spec.to)
    return {spec.axis: op_result(spec)}


def _describe(spec: SyncSpec) -> str:
    if spec.op is not None:
        kw = "".join(f", {k}={v!r}" for k, v in spec.kwargs)
        return f"{spec.mode} op={spec.op!r}{kw}"
    return f"{spec.mode} to={[p for _, p in spec.to]}"


class _Planner:
    def __init__(self, syncs: list[SyncSpec], leaves: dict, module_type: dict[str, str]):
        self.syncs = syncs
        self.leaves = leaves  # path -> LeafPlan (out, grad_partial_axes)
        self.module_type = module_type  # path -> class name, for messages
        self.plan = SyncPlan()
        self.grad_owner: dict[tuple[str, str], SyncSpec] = {}

    def where(self, spec: SyncSpec) -> str:
        return f"sync at sch[{spec.path!r}]"

    def of(self, path: str, mode: str) -> list[tuple[int, SyncSpec]]:
        return [(i, s) for i, s in enumerate(self.syncs) if s.path == path and s.mode == mode]

    def sharded_under(self, path: str, axis: str) -> list[str]:
        return [p for p, lp in self.leaves.items() if _under(p, path)
                and (axis in lp.out or axis in lp.grad_partial_axes)]

    def columns_under(self, path: str, axis: str) -> list[str]:
        return [p for p, lp in self.leaves.items() if _under(p, path) and axis in lp.grad_partial_axes]

    # ---------------------------------------------------------------- forward: chain and check
    def input_layout(self, path: str) -> dict[str, Placement]:
        """The layout the module's first input has after its own fwd_pre syncs, on the axes they name."""
        lay: dict[str, Placement] = {}
        for _, s in self.of(path, "fwd_pre"):
            if s.arg not in (0, None):
                continue
            lay.update(after(s))
        return lay

    def leaf_out(self, path: str, lp) -> dict[str, Placement]:
        """A sharded leaf's output layout: its rule's, plus what its input's fwd_pre syncs carry through on the
        axes the rule leaves Replicate. An input split on a dim other than the last (a batch or sequence dim)
        comes out split on the same dim (Linear / Conv1D act on the last dim; an Embedding maps every id); a
        dim counted from the end (or a pending sum) is left to the sync's ``from_`` (`self.unknown`)."""
        out = dict(lp.out)
        self.unknown = set()
        for ax, p in self.input_layout(path).items():
            if ax in out or isinstance(p, Replicate):
                continue
            if isinstance(p, Shard) and p.dim >= 0:  # a feature-dim split here would not even run (shapes)
                out[ax] = p
            else:
                self.unknown.add(ax)
        return out

    def chain_fwd_post(self, path: str) -> dict[str, Placement] | None:
        lp = self.leaves.get(path)
        self.unknown = set()
        known: dict[str, Placement] | None = self.leaf_out(path, lp) if lp is not None else None
        what = f"the output of {self.module_type.get(path, 'the module')} {path!r}"
        for i, s in self.of(path, "fwd_post"):
            if s.op is not None:
                need = op_source(s)
                if known is not None and s.axis not in self.unknown:
                    have = known.get(s.axis, Replicate())
                    if not _compatible(have, need):
                        raise ScheduleError(
                            f"{self.where(s)}: {_describe(s)} over axis {s.axis!r} expects a {_name(need)} tensor, "
                            f"but {what} is {_name(have)} on {s.axis!r}{self._why(path, s.axis, have)}; "
                            f"{self._fix(have, s.axis)}")
                self.plan.src[i] = {s.axis: need}
                known = {**(known or {}), s.axis: op_result(s)}
                continue
            if s.from_ is not None:
                given = dict(s.from_)
                if known is not None:
                    for ax, p in given.items():
                        if ax in self.unknown:
                            continue
                        have = known.get(ax, Replicate())
                        if not _compatible(have, p):
                            raise ScheduleError(
                                f"{self.where(s)}: from_={_name(p)} on axis {ax!r} contradicts the known layout: "
                                f"{what} is {_name(have)} on {ax!r}{self._why(path, ax, have)}; leave from_ out to "
                                f"start from the known layout")
                base = {**(known or {}), **given}
            elif known is not None:
                blind = sorted(ax for ax, _ in s.to if ax in self.unknown)
                if blind:
                    raise BuildError(f"{self.where(s)}: cannot derive the layout of the output of {path!r} on "
                                     f"axes {blind} (its input is split there by a fwd_pre sync on a dim counted "
                                     f"from the end); give from_=")
                base = dict(known)
            else:
                raise BuildError(f"{self.where(s)}: cannot derive the layout "
                                 f"{self.module_type.get(path, 'this module')} produces (only sharded "
                                 f"Linear/Conv1D/Embedding leaves have rules, or an earlier fwd_post sync of the "
                                 f"same module); give from_=")
            self.plan.src[i] = base
            known = {**base, **dict(s.to)}
        return known

    def _why(self, path: str, axis: str, have: Placement) -> str:
        lp = self.leaves.get(path)
        if lp is None or axis not in lp.out:
            return ""
        kind = {Shard: "column-parallel", Partial: "row-parallel"}.get(type(lp.out[axis]), "sharded")
        if any(s.path == path and s.mode == "fwd_post" for s in self.syncs) and lp.out[axis] != have:
            return " after the earlier fwd_post syncs of this module"
        return f" ({kind} leaf)"

    @staticmethod
    def _fix(have: Placement, axis: str) -> str:
        if isinstance(have, Shard):
            return f"gather it with op='all_gather', dim={have.dim}, axis={axis!r} (or to=Replicate())"
        if isinstance(have, Partial):
            return f"reduce it with op='all_reduce', axis={axis!r} (or to=Replicate())"
        return "it is already complete on every rank; drop this sync or split it with op='split'"

    def check_fwd_pre(self, path: str) -> None:
        """A row-parallel leaf reads its input sharded on the last dim: gathering or reducing it first is
        a contradiction."""
        lp = self.leaves.get(path)
        if lp is None:
            return
        for i, s in self.of(path, "fwd_pre"):
            if s.op is None:
                continue
            if s.axis in lp.row_axes and s.op in ("all_gather", "all_reduce"):
                raise ScheduleError(
                    f"{self.where(s)}: {_describe(s)} over axis {s.axis!r} makes the input Replicate, but row-parallel "
                    f"{path!r} reads its input as Shard(dim=-1) on {s.axis!r} (its weight is split on the input "
                    f"dim); keep the input sharded, or split it with op='split', dim=-1")

    def is_reduce_statement(self, i: int, s: SyncSpec, axis: str) -> bool:
        if s.op is not None:
            return s.axis == axis and s.op in ("all_reduce", "reduce_scatter")
        src = self.plan.src.get(i, dict(s.from_ or ()))
        return isinstance(src.get(axis), Partial) and axis in dict(s.to)

    # ---------------------------------------------------------------- the pending sums of row-parallel leaves
    def resolve_partials(self, before: dict[str, dict[str, Placement]]) -> None:
        for path, lay in before.items():
            final = dict(lay)
            for ax, p in lay.items():
                if not isinstance(p, Partial):
                    continue
                if self.covered(path, ax):
                    continue
                final[ax] = Replicate()
                self.plan.derived_reduce.setdefault(path, []).append(ax)
            self.plan.final[path] = final
        # a reducing fwd_post on a parent needs a pending sum under it
        for i, s in enumerate(self.syncs):
            if s.mode != "fwd_post" or s.path in self.leaves:
                continue
            for ax in ([s.axis] if s.op is not None else [a for a, _ in s.to]):
                if not self.is_reduce_statement(i, s, ax):
                    continue
                under = self.sharded_under(s.path, ax)
                if under and not any(isinstance(before.get(p, {}).get(ax), Partial) for p in under):
                    lays = {p: _name(self.plan.final.get(p, {}).get(ax, Replicate())) for p in under}
                    raise ScheduleError(
                        f"{self.where(s)}: {_describe(s)} reduces a pending sum over axis {ax!r}, but no sharded leaf "
                        f"under it leaves one (their outputs on {ax!r}: {lays}); reducing a Shard sums different "
                        f"shards and reducing a Replicate counts it {ax!r}-size times; drop this sync")

    def covered(self, path: str, axis: str) -> bool:
        for i, s in enumerate(self.syncs):
            if s.path == path:
                continue  # its own fwd_post syncs are already in the layout
            if s.mode == "bwd_post" or not self.is_reduce_statement(i, s, axis):
                continue
            if s.mode == "fwd_post" and s.path in self.leaves and not _under(path, s.path):
                continue  # another leaf's statement about its own output
            return True
        return False

    # ---------------------------------------------------------------- backward: input-gradient reductions
    def plan_bwd(self) -> None:
        for i, s in enumerate(self.syncs):
            if s.mode != "bwd_post":
                continue
            if s.op is not None:
                if s.op == "all_reduce":
                    self.reduce_grad(i, s, s.axis)
                elif s.op == "reduce_scatter":
                    self.merge_into_gather(i, s, s.axis, s.kw()["dim"])
                continue
            given = dict(s.from_ or ())
            src = {}
            for ax, d in s.to:
                p = given.get(ax)
                if p is None and self.columns_under(s.path, ax):
                    p = Partial()  # the input gradient of column-parallel compute is a pending sum
                src[ax] = p if p is not None else Replicate()
                if isinstance(src[ax], Partial) and isinstance(d, Replicate):
                    self.reduce_grad(i, s, ax)
                elif isinstance(src[ax], Partial) and isinstance(d, Shard):
                    self.merge_into_gather(i, s, ax, d.dim)
            self.plan.src[i] = src

    def reduce_grad(self, i: int, s: SyncSpec, axis: str) -> None:
        cols = self.columns_under(s.path, axis)
        sharded = self.sharded_under(s.path, axis)
        if not cols and sharded:
            lays = {p: _name(self.leaves[p].out.get(axis, Replicate())) for p in sharded}
            raise ScheduleError(
                f"{self.where(s)}: {_describe(s)} sums the input gradient over axis {axis!r}, but no column-parallel "
                f"leaf at or under it makes that gradient a pending sum (sharded leaves and their outputs on "
                f"{axis!r}: {lays}); the gradient there is already complete (Replicate or Shard), so the sum would "
                f"count it {axis!r}-size times or add different shards; drop this sync")
        self.claim(s, cols, axis)

    def claim(self, s: SyncSpec, cols: list[str], axis: str) -> None:
        """Record that `s` reduces the input gradient of column leaves `cols` on `axis`; a second explicit
        reduction of the same gradient would count it twice."""
        for c in cols:
            other = self.grad_owner.get((c, axis))
            if other is not None and other is not s:
                raise ScheduleError(
                    f"{self.where(s)}: {_describe(s)} reduces the input gradient of column-parallel {c!r} over axis "
                    f"{axis!r}, which sync at sch[{other.path!r}] ({_describe(other)}) already reduces; the sum would "
                    f"be counted twice; keep one of them")
            self.grad_owner[(c, axis)] = s
            self.plan.grad_replaced.add((c, axis))

    def merge_into_gather(self, i: int, s: SyncSpec, axis: str, dim: int) -> None:
        for j, g in self.of(s.path, "fwd_pre"):
            gathers = (g.op == "all_gather" and g.axis == axis and g.kw()["dim"] == dim) or (
                g.op is None and isinstance(dict(g.to).get(axis), Replicate)
                and isinstance(dict(g.from_ or ()).get(axis), Shard) and dict(g.from_)[axis].dim == dim)
            if gathers:
                self.plan.merged.add(i)
                self.plan.fused.setdefault(s.path, set()).add(axis)
                self.claim(s, self.columns_under(s.path, axis), axis)
                return
        raise ScheduleError(
            f"{self.where(s)}: {_describe(s)} over axis {axis!r} would change the input gradient's shape; a "
            f"reduce-scatter of the gradient is the backward of an all-gather of the input, so it needs "
            f"sch[{s.path!r}].sync('fwd_pre', op='all_gather', dim={dim}, axis={axis!r}) (whose backward it then is)")

    def derived_fused(self) -> None:
        """A fwd_pre gather on a column-parallel leaf reduce-scatters its gradient (NOTE [grad layouts]) unless an
        explicit bwd_post already reduces that gradient."""
        for path, lp in self.leaves.items():
            for _, s in self.of(path, "fwd_pre"):
                gathers = ({s.axis} if s.op == "all_gather" else
                           {ax for ax, d in (s.to or ()) if isinstance(d, Replicate)
                            and isinstance(dict(s.from_ or ()).get(ax), Shard)})
                for ax in gathers & set(lp.grad_partial_axes):
                    if (path, ax) not in self.plan.grad_replaced:
                        self.plan.fused.setdefault(path, set()).add(ax)

    def run(self) -> SyncPlan:
        paths = list(dict.fromkeys([s.path for s in self.syncs] + list(self.leaves)))
        before: dict[str, dict[str, Placement]] = {}
        for path in paths:
            known = self.chain_fwd_post(path)
            self.check_fwd_pre(path)
            if path in self.leaves:
                before[path] = known or {}
        self.resolve_partials(before)
        self.plan_bwd()
        self.derived_fused()
        return self.plan


def plan_syncs(syncs: list[SyncSpec], leaves: dict, module_type: dict[str, str]) -> SyncPlan:
    """Resolve explicit against derived collectives (NOTE [explicit replaces derived]).

    `syncs`: the schedule's SyncSpecs in order; `leaves`: path -> LeafPlan of every sharded leaf;
    `module_type`: path -> class name (for messages). Raises ScheduleError for an explicit op that contradicts
    a known layout (naming path, axis and both layouts), BuildError for a typed sync whose source cannot be
    derived."""
    return _Planner(syncs, leaves, module_type).run()
