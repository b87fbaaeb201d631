"""Cheapest sequence of collectives that turns one layout of a tensor into another: shortest path, memoised.

The graph's nodes are layouts (placements plus shard order) of one global shape on one mesh; its edges are
the moves the runtime can execute, priced in seconds by `collective_cost` on the local bytes at that node:

===================  ==============================  ==============================  ========================
edge                 placement change on axes        forward cost                    backward (adjoint) cost
===================  ==============================  ==============================  ========================
all_reduce           P -> R (one axis or several)    all-reduce of the local bytes   0 (identity)
reduce_scatter(d)    P -> S(d) (one or several)      reduce-scatter of local bytes   all-gather
all_gather           S(d) -> R, innermost axes of d  all-gather, n x local out       0 (split)
all_to_all(c -> d)   S(c) -> S(d), innermost of c    all-to-all of local bytes       all-to-all
split(d)             R -> S(d)                       0 (local chunk)                 all-gather
to_partial           R -> P                          0 (rank 0 of the axis keeps)    0 (identity)
===================  ==============================  ==============================  ========================

A new shard becomes the innermost of its dim (NOTE [shard order] in layout.py). Over several axes at once
(a flattened process group) the planner considers all-reduce of any set of Partial axes, reduce-scatter of
such a set into one dim (ascending axis order), and all-gather of the innermost k >= 2 axes of one dim: on
a link with a per-call launch cost one collective over the flattened group beats one per axis, and the
shortest path takes whichever is cheaper.

NOTE [copies]: the runtime packs buffers around collectives (`treadle.runtime.collectives`, whose gathers match
DTensor's: NOTE [contiguous gathers]), and `runtime_ops` states the local ops it dispatches around each step, forward
and backward (the backward per NOTE [grad layouts]), each by the bytes it copies (0: an allocation or a view). With L
the step's local input bytes and n its group, on a dim d != 0: reduce_scatter splits and concatenates its input (L)
and allocates its output, its backward allocates, gathers and concatenates (L); all_gather allocates, splits and
concatenates its output (n L), its backward splits the complete gradient and clones its chunk (L); split splits and
clones its chunk (L / n), its backward gathers (L); on dim 0 each only allocates or splits. all_reduce clones L and
its backward passes the gradient on; all_to_all splits, stacks (L), allocates, unbinds and concatenates (L), both
ways; to_partial writes L; a flattened gather whose axes are not in ascending order splits and concatenates its
output again (n L). `tests/test_cost_convert.py` counts them against the runtime's dispatch. With
`ClusterSpec.copy_bytes_per_s` set, each move also pays its copied bytes at that rate, which steers the path;
without it (None) the path ignores them, and the planner prices the same ops as `treadle.price` prices the ones
it records (`treadle.planner.node_costs`).

Prices come from the cluster's links, so a calibrated cluster steers the path (on gloo, whose reduce-scatter
is slow, all-reduce + split can win). Backward costs follow NOTE [grad layouts] in
`treadle.runtime.collectives` (gradients arrive complete). `objective="total"` minimises forward plus
backward; the default minimises forward time and reports the backward of that path.

Memoised twice: one single-source Dijkstra tree per (source layout, shape signature, cluster) answers every
target (the shape enters only through each dim's gcd with the world size and the total bytes), and every
finished plan is cached. About 50 us for a new pair on a 2-D mesh, 2 us for a repeated one.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Sequence

from ..errors import LayoutError
from ..mesh import Mesh
from . import collective_cost as cc
from .cluster import ClusterSpec
from ..placement import P, R
from .layout import Layout
from .links import LinkSpec

logger = logging.getLogger(__name__)

Op = Literal["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "split", "to_partial"]
COMM_OPS = frozenset({"all_reduce", "reduce_scatter", "all_gather", "all_to_all"})


@dataclass(frozen=True, slots=True)
class ConversionStep:
    """One move of a conversion. `axes` are mesh axis names (several: one flattened group, outer to inner);
    `dim` is the tensor dim gathered, scattered or split (for all_to_all the new shard dim, `src_dim` the old);
    `nbytes` is the per-rank buffer in `collective_cost`'s convention (all_gather: gathered output; others:
    local input); `local_ops` and `backward_local_ops` the ops the runtime dispatches around it, forward and
    backward, each by the bytes it copies (NOTE [copies]); `group_size` the ranks in one group; `time_s` forward,
    `backward_time_s` its adjoint, both with their copies at the cluster's copy rate (none without one)."""

    op: Op
    axes: tuple[str, ...]
    axis_indices: tuple[int, ...]
    dim: int | None
    src_dim: int | None
    nbytes: int
    local_ops: tuple[int, ...]
    backward_local_ops: tuple[int, ...]
    group_size: int
    time_s: float
    backward_time_s: float
    before: Layout
    after: Layout

    @property
    def copy_bytes(self) -> int:
        """Bytes the forward copies locally (NOTE [copies])."""
        return sum(self.local_ops)

    @property
    def is_comm(self) -> bool:
        return self.op in COMM_OPS and self.group_size > 1

    @property
    def sent_bytes(self) -> float:
        """Bytes one rank puts on the wire (ring / pairwise volumes; all-reduce counted as ring)."""
        n = self.group_size
        if not self.is_comm:
            return 0.0
        factor = 2 * (n - 1) / n if self.op == "all_reduce" else (n - 1) / n
        return factor * self.nbytes

    def __str__(self) -> str:
        axes = "+".join(self.axes)
        dims = (f"dim {self.src_dim}->{self.dim}" if self.op == "all_to_all"
                else f"dim {self.dim}" if self.dim is not None else "")
        return (f"{self.op}({axes}{', ' + dims if dims else ''}) {self.before} -> {self.after}: "
                f"{self.nbytes} B, {self.time_s * 1e6:.1f} us fwd, {self.backward_time_s * 1e6:.1f} us bwd")


@dataclass(frozen=True, slots=True)
class ConversionPlan:
    """The cheapest path from `src` to `dst`: its steps, forward `time_s` and `backward_time_s` in seconds."""

    src: Layout
    dst: Layout
    global_shape: tuple[int, ...]
    itemsize: int
    steps: tuple[ConversionStep, ...]
    time_s: float
    backward_time_s: float

    @property
    def total_time_s(self) -> float:
        return self.time_s + self.backward_time_s

    @property
    def local_ops(self) -> tuple[int, ...]:
        """The forward's local ops around its collectives, step by step, each by the bytes it copies (NOTE
        [copies])."""
        return tuple(c for s in self.steps for c in s.local_ops)

    @property
    def backward_local_ops(self) -> tuple[int, ...]:
        """The backward's local ops, each by the bytes it copies (NOTE [copies])."""
        return tuple(c for s in reversed(self.steps) for c in s.backward_local_ops)

    @property
    def num_collectives(self) -> int:
        return sum(s.is_comm for s in self.steps)

    @property
    def sent_bytes(self) -> float:
        return sum(s.sent_bytes for s in self.steps)

    def __str__(self) -> str:
        head = (f"{self.src} -> {self.dst} of {self.global_shape} x {self.itemsize} B: "
                f"{self.time_s * 1e6:.1f} us fwd, {self.backward_time_s * 1e6:.1f} us bwd")
        return "\n  ".join([head, *(str(s) for s in self.steps)]) if self.steps else head + " (no-op)"


def plan_conversion(src: Layout | Sequence | str, dst: Layout | Sequence | str, *, global_shape: Sequence[int],
                    itemsize: int, cluster: ClusterSpec,
                    objective: Literal["forward", "total"] = "forward") -> ConversionPlan:
    """Cheapest sequence of collectives from layout `src` to `dst` of a tensor of `global_shape` with
    elements of `itemsize` bytes on `cluster` (Dijkstra over the layout graph; memoised, so repeated
    queries cost a dict lookup).

    Raises LayoutError when either layout does not fit the mesh or does not divide the shape (naming the
    dim, size and axes), or `objective` is unknown."""
    if objective not in ("forward", "total"):
        raise LayoutError(f"plan_conversion: objective must be 'forward' or 'total'; got {objective!r}")
    if itemsize <= 0:
        raise LayoutError(f"plan_conversion: itemsize must be a positive byte count; got {itemsize}")
    src, dst = _as_layout(src), _as_layout(dst)
    return _plan(src, dst, tuple(int(s) for s in global_shape), int(itemsize), cluster.mesh.shape,
                 cluster.mesh.names, cluster.links, objective, cluster.copy_bytes_per_s)


def _as_layout(x) -> Layout:
    if isinstance(x, Layout):
        return x
    if isinstance(x, str):
        return Layout.parse(x)
    return Layout(list(x))


def conversion_time_s(src: Layout, dst: Layout, *, global_shape: Sequence[int], itemsize: int,
                      cluster: ClusterSpec) -> float:
    """Forward seconds of the cheapest conversion (see `plan_conversion`)."""
    return plan_conversion(src, dst, global_shape=global_shape, itemsize=itemsize, cluster=cluster).time_s


def clear_cache() -> None:
    """Forget memoised plans (they never change for equal arguments; this only frees memory)."""
    _plan.cache_clear()
    _tree.cache_clear()


# ------------------------------------------------------------------------------------------ search
_State = tuple[tuple[int, ...], tuple[tuple[int, tuple[int, ...]], ...]]


@lru_cache(maxsize=65536)
def _plan(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int, mesh_shape: tuple[int, ...],
          names: tuple[str, ...], links: tuple[LinkSpec, ...], objective: str,
          copy_bytes_per_s: float | None) -> ConversionPlan:
    mesh = _mesh(mesh_shape, names)
    for what, lay in (("source layout", src), ("target layout", dst)):
        lay.check(mesh, shape, what=f"plan_conversion: {what}")
    start: _State = (src.codes, src.order)
    goal: _State = (dst.codes, dst.order)
    if start == goal:
        return ConversionPlan(src, dst, shape, itemsize, (), 0.0, 0.0)
    # Divisibility only needs each dim modulo the world size; bytes only need the total (see _edges).
    world = math.prod(mesh_shape)
    best, prev = _tree(start, tuple(math.gcd(s, world) for s in shape), math.prod(shape) * itemsize,
                       mesh_shape, links, objective, 1.0 / copy_bytes_per_s if copy_bytes_per_s else 0.0)
    if goal not in best:  # unreachable only through a bug: every layout goes via all-replicated
        raise LayoutError(f"plan_conversion: no path from {src} to {dst} for shape {shape} on mesh {mesh_shape}")
    edges = []
    state = goal
    while state != start:
        before, edge = prev[state]
        edges.append((before, state, edge))
        state = before
    steps = []
    for before, after, (op, axes, dim, src_dim, nbytes, fwd_s, bwd_s, cf, cb) in reversed(edges):
        steps.append(ConversionStep(op=op, axes=tuple(names[a] for a in axes), axis_indices=axes, dim=dim,
                                    src_dim=src_dim, nbytes=int(nbytes), local_ops=tuple(int(x) for x in cf),
                                    backward_local_ops=tuple(int(x) for x in cb),
                                    group_size=math.prod(mesh_shape[a] for a in axes),
                                    time_s=fwd_s, backward_time_s=bwd_s,
                                    before=Layout._from_codes(*before), after=Layout._from_codes(*after)))
    plan = ConversionPlan(src, dst, shape, itemsize, tuple(steps), sum(s.time_s for s in steps),
                          sum(s.backward_time_s for s in steps))
    logger.debug("plan_conversion: %s", plan)
    return plan


@lru_cache(maxsize=256)
def _mesh(mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(mesh_shape, names)  # building a Mesh costs ~0.4 ms; layouts only need it for checks


@lru_cache(maxsize=8192)
def _tree(start: _State, div_shape: tuple[int, ...], total_bytes: int, mesh_shape: tuple[int, ...],
          links: tuple[LinkSpec, ...], objective: str, copy_s_per_byte: float) -> tuple[dict, dict]:
    """Single-source Dijkstra from `start` over every reachable layout: (cost, predecessor) maps. One tree
    answers the queries from `start` to every target; it depends on the shape only through `div_shape`
    (each dim's gcd with the world size, which decides every divisibility) and `total_bytes`."""
    best: dict[_State, float] = {start: 0.0}
    prev: dict[_State, tuple[_State, tuple]] = {}
    tie = itertools.count()
    heap = [(0.0, next(tie), start)]
    weight_bwd = objective == "total"
    while heap:
        cost, _, state = heapq.heappop(heap)
        if cost > best.get(state, math.inf):
            continue
        for nxt, edge in _edges(state, div_shape, total_bytes, mesh_shape, links, copy_s_per_byte):
            c = cost + edge[5] + (edge[6] if weight_bwd else 0.0)
            if c < best.get(nxt, math.inf) - 1e-18:
                best[nxt] = c
                prev[nxt] = (state, edge)
                heapq.heappush(heap, (c, next(tie), nxt))
    return best, prev


def _local(shape: tuple[int, ...], order, mesh_shape: tuple[int, ...]) -> list[int]:
    local = list(shape)
    for d, axes in order:
        for a in axes:
            local[d] //= mesh_shape[a]
    return local


def _set_order(order, dim: int, axes: tuple[int, ...] | None) -> tuple:
    """Order with `dim`'s axes replaced by `axes` (None or empty removes the dim), kept sorted by dim."""
    out = [(d, a) for d, a in order if d != dim]
    if axes:
        out.append((dim, axes))
    return tuple(sorted(out))


def runtime_ops(op: str, dim: int | None, local_bytes: float, n: int, *,
                permute: bool = False) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The local ops the runtime dispatches around one step of `op` on `dim` over a group of `n`, forward and
    backward, each by the bytes it copies (0: an allocation or a view; NOTE [copies]). `local_bytes` is the step's
    local input; `permute` a flattened gather whose axes are not in ascending order."""
    lb, off = local_bytes, dim not in (None, 0)
    if op == "all_reduce":
        return (lb,), ()  # clone; the backward passes the gradient on
    if op == "to_partial":
        return (lb,), ()  # clone (or zeros)
    if op == "reduce_scatter":  # split + cat of the input, the output allocated; backward: a gather
        return ((0.0, lb, 0.0), (0.0, 0.0, lb)) if off else ((0.0,), (0.0,))
    if op == "all_gather":  # the output allocated, split + cat; backward: a split of the complete gradient
        fwd = (0.0, 0.0, lb * n) if off else (0.0,)
        return fwd + ((0.0, lb * n) if permute else ()), ((0.0, lb) if off else (0.0,))
    if op == "split":  # split + clone of the chunk; backward: a gather
        return ((0.0, lb / n), (0.0, 0.0, lb)) if off else ((0.0,), (0.0,))
    if op == "all_to_all":  # split, stack, allocate, unbind, cat; the backward the same
        ops = (0.0, lb, 0.0, 0.0, lb)
        return ops, ops
    raise LayoutError(f"runtime_ops: unknown step {op!r}")


def grad_sum_ops(nbytes: float, n_params: int = 0) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The local ops around Megatron's "f" (`treadle.runtime.collectives.grad_all_reduce`: identity forward,
    the gradient all-reduced in backward), forward and backward, each by the bytes it copies (NOTE [copies]):
    a view, then a clone of the `nbytes` gradient. With `n_params` > 0, `grad_all_reduce_many` over that many
    parameters' gradients (`nbytes` in all): a view each, then a view each, one concatenation, its clone, a split
    and a view each."""
    if n_params <= 0:
        return (0.0,), (nbytes,)
    k = (0.0,) * n_params
    return k, k + (nbytes, nbytes, 0.0) + k


def _edges(state: _State, shape, total_bytes: int, mesh_shape, links, copy_s_per_byte: float = 0.0):
    """Yield (next_state, (op, axes, dim, src_dim, nbytes, fwd_s, bwd_s, local ops, backward local ops)) for every
    move out of `state`. `shape` decides divisibility only (a global shape, or its gcd with the world size).
    Times include the local packing copies (NOTE [copies]) at `copy_s_per_byte`."""
    codes, order = state
    local = _local(shape, order, mesh_shape)
    lb = total_bytes // math.prod(mesh_shape[a] for _, axes in order for a in axes)
    axes_of = dict(order)
    ndim = len(shape)
    partial = [i for i, c in enumerate(codes) if c == P]
    cps = copy_s_per_byte

    def move(op, axes, dim, src_dim, nbytes, comm_f, comm_b, n, permute=False):
        cf, cb = runtime_ops(op, dim, lb, n, permute=permute)
        return (op, axes, dim, src_dim, nbytes, comm_f + sum(cf) * cps, comm_b + sum(cb) * cps, cf, cb)

    for i, c in enumerate(codes):
        n, link = mesh_shape[i], links[i]
        if c == P:
            nc = codes[:i] + (R,) + codes[i + 1:]
            yield (nc, order), move("all_reduce", (i,), None, None, lb, cc.all_reduce_time_s(lb, n, link), 0.0, n)
            for d in range(ndim):
                if local[d] % n == 0:
                    nc = codes[:i] + (d,) + codes[i + 1:]
                    yield ((nc, _set_order(order, d, axes_of.get(d, ()) + (i,))),
                           move("reduce_scatter", (i,), d, None, lb, cc.reduce_scatter_time_s(lb, n, link),
                                cc.all_gather_time_s(lb, n, link), n))
        elif c == R:
            for d in range(ndim):
                if local[d] % n == 0:
                    nc = codes[:i] + (d,) + codes[i + 1:]
                    yield ((nc, _set_order(order, d, axes_of.get(d, ()) + (i,))),
                           move("split", (i,), d, None, lb, 0.0, cc.all_gather_time_s(lb, n, link), n))
            nc = codes[:i] + (P,) + codes[i + 1:]
            yield (nc, order), move("to_partial", (i,), None, None, lb, 0.0, 0.0, n)
        else:
            d_axes = axes_of[c]
            if d_axes[-1] != i:
                continue  # only the innermost axis of a dim moves on its own (NOTE [shard order])
            rest = d_axes[:-1]
            nc = codes[:i] + (R,) + codes[i + 1:]
            yield ((nc, _set_order(order, c, rest)),
                   move("all_gather", (i,), c, None, lb * n, cc.all_gather_time_s(lb * n, n, link), 0.0, n))
            t = cc.all_to_all_time_s(lb, n, link)
            for d in range(ndim):
                if d != c and local[d] % n == 0:
                    nc = codes[:i] + (d,) + codes[i + 1:]
                    new_order = _set_order(_set_order(order, c, rest), d, axes_of.get(d, ()) + (i,))
                    yield (nc, new_order), move("all_to_all", (i,), d, c, lb, t, t, n)
    # ---- flattened groups over several axes
    if len(partial) >= 2:
        for k in range(2, len(partial) + 1):
            for group in itertools.combinations(partial, k):
                n = math.prod(mesh_shape[a] for a in group)
                link = cc.flat_link([links[a] for a in group])
                nc = tuple(R if a in group else x for a, x in enumerate(codes))
                yield (nc, order), move("all_reduce", group, None, None, lb, cc.all_reduce_time_s(lb, n, link),
                                        0.0, n)
                for d in range(ndim):
                    if local[d] % n == 0:
                        nc = tuple(d if a in group else x for a, x in enumerate(codes))
                        yield ((nc, _set_order(order, d, axes_of.get(d, ()) + group)),
                               move("reduce_scatter", group, d, None, lb, cc.reduce_scatter_time_s(lb, n, link),
                                    cc.all_gather_time_s(lb, n, link), n))
    for d, d_axes in order:
        for k in range(2, len(d_axes) + 1):
            group = d_axes[-k:]
            n = math.prod(mesh_shape[a] for a in group)
            link = cc.flat_link([links[a] for a in group])
            nc = tuple(R if a in group else x for a, x in enumerate(codes))
            yield ((nc, _set_order(order, d, d_axes[:-k])),
                   move("all_gather", group, d, None, lb * n, cc.all_gather_time_s(lb * n, n, link), 0.0, n,
                        permute=list(group) != sorted(group)))
