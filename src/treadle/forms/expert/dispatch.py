"""Token dispatch and combine of one expert-parallel experts module (the local forward `build` installs).

NOTE [expert dispatch]: rank r of the expert axis (n ranks, E experts, El = E/n) holds experts r*El .. (r+1)*El-1.
In forward, each rank

1. lists the (token, slot) pairs it routes to a real expert (an index outside 0..E-1 is the model's own "no
   expert" and is not sent), ordered by expert; pair p goes to rank ``index[p] // El``;
2. exchanges its pair counts per expert (one all-to-all of E integers: each rank learns how many rows each
   source sends each of its experts, hence every received row's local expert), then the pairs' rows and their
   routing weights (two uneven all-to-alls);
3. runs the module's own forward on the rows it received, each with its one local expert and its routing
   weight, so the experts compute and weight a pair as the model does (its loop, or its grouped product);
4. sends the results back (the inverse all-to-all) and sums the pairs of each token in ascending expert order,
   one addition at a time, as the model's own loop adds them.

Dropless: every routed pair is computed, whatever the load; the counts may differ per rank. A routing weight's
gradient comes back with its row's (the inverse exchange), so the router's gradient is the local one. The
expert weights' gradient sums the tokens of every rank of the axis; `ExpertLeaf` averages it with the other
data-parallel axes (NOTE [expert gradients]). Besides the model's own expert compute the dispatch moves each
routed row through memory a fixed number of times (`dispatch_traffic`, which the planner adds to the experts'
cost): forward the gather of the rows to send and the gather of the results by token, and the k slot
additions; backward those gathers' adjoints and one stack of the slots' gradients. Autograd keeps only the
positions of the gathers, no row.

NOTE [expert load in a rehearsal]: the price rehearses a step on fake tensors (`treadle.pricing.rehearsal`),
where no routing decision exists. There the dispatch sends every routed pair, 1/n of them to each rank (the T*k
rows a rank routes), and the rehearsed rank is the busiest one: it receives f*T*k rows, f the experts module's
stated `load_imbalance` (the busiest rank's routed rows over the mean; 1.0 by default, the balanced load a
load-balanced router aims at). Its experts compute those rows, it sends their results back, and every
all-to-all is charged at the larger of the buffers the rank sends and receives (`pricing.rehearsal`): the
exchange ends when its busiest rank has received. Every rank of the expert axis waits for it at the combine,
so the step is the busiest rank's. The router decides the real load, whatever is stated: the HF models route
dropless (no capacity), so no bound on f comes from the model; `treadle.run` logs the measured value per
experts module (`runtime.expert_loads`: `ExpertLoad.rank_imbalance` of the run's expert axis), which is what
to state. The planner charges the same (NOTE [experts in the plan]).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ...errors import BuildError
from ...runtime import collectives as C


def _combine(back: torch.Tensor, order: torch.Tensor, index: torch.Tensor, shape: torch.Size,
             dtype: torch.dtype) -> torch.Tensor:
    """Each token's output: the sum of its pairs' weighted rows `back` (pair ``order[i]`` is row i; a pair not
    sent, the model's "no expert", adds nothing) in ascending expert order, one addition at a time in `dtype`
    (the hidden states'), as the model's own loop adds them. Gathers by index (autograd keeps only the
    positions) and adds the slots unbound, so backward is one gather's adjoint and one stack (NOTE [expert
    dispatch])."""
    t, k = index.shape
    sent = order.numel()
    if sent < t * k:  # a zero row for the pairs not sent
        back = torch.cat([back, back.new_zeros((1, back.shape[-1]))])
    pos = torch.full((t * k,), sent, dtype=torch.long, device=back.device)
    pos[order] = torch.arange(sent, device=back.device)
    pos = pos.view(t, k).gather(1, torch.argsort(index, dim=1, stable=True))  # a token's pairs by expert
    out = torch.zeros(shape, dtype=dtype, device=back.device)  # a new tensor, not a view (FSDP2's backward
    for contrib in back[pos].to(dtype).unbind(1):                # hook on a unit's output needs one)
        out = out + contrib.reshape(shape)
    return out


def dispatch_traffic(pairs: float, row_bytes: float) -> tuple[float, float]:
    """(forward, backward) bytes the dispatch moves through memory for `pairs` routed rows of `row_bytes` each,
    besides the exchanges and the model's own expert compute (NOTE [expert dispatch]): forward the gather of the
    rows to send and the gather of the results by token (each a read and a write of every row) and the k slot
    additions (two reads and a write of every row); backward the two gathers' adjoints and the stack of the
    slots' gradients (a read and a write each)."""
    rows = pairs * row_bytes
    return 7.0 * rows, 6.0 * rows


def dense_traffic(nbytes: float) -> tuple[float, float]:
    """(forward, backward) bytes `DenseExpertLeaf` moves through memory for `nbytes` of its rows besides the
    exchanges and the experts' own compute: forward the gather of the received groups into expert-major order and
    the gather of the results back (each a read and a write of every row); backward their two adjoints."""
    return 4.0 * nbytes, 4.0 * nbytes


class _ExpertGrads(torch.autograd.Function):
    """Identity forward on the local expert weights; backward sums their gradients over `group` (the
    data-parallel ranks outside the expert axis; None: none) and scales them by `scale` (NOTE [expert
    gradients])."""

    @staticmethod
    def forward(ctx, group, scale, *ps):
        ctx.group, ctx.scale, ctx.shapes = group, scale, [p.shape for p in ps]
        return tuple(p.view_as(p) for p in ps)

    @staticmethod
    def backward(ctx, *grads):
        ref = next(g for g in grads if g is not None)
        flat = torch.cat([(g if g is not None else ref.new_zeros(s)).reshape(-1) for g, s in zip(grads, ctx.shapes)])
        if ctx.group is not None:
            dist.all_reduce(flat, group=ctx.group)
        flat = flat * ctx.scale
        return (None, None, *(part.view(s) for part, s in zip(flat.split([s.numel() for s in ctx.shapes]),
                                                                ctx.shapes)))


def _spread(total: int, slots: int) -> list[int]:
    """`total` rows spread as evenly as integers allow over `slots` (the first ``total % slots`` get one more)."""
    q, r = divmod(total, slots)
    return [q + 1] * r + [q] * (slots - r)


class _Touch(torch.autograd.Function):
    """``y`` unchanged; in backward, zero gradients for `ps` as well: every local expert weight gets a gradient
    on every rank, even one that received no row, so the collectives of `_ExpertGrads` run everywhere."""

    @staticmethod
    def forward(ctx, y, *ps):
        ctx.specs = [(p.shape, p.dtype, p.device) for p in ps]
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return (g, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.specs))


@dataclass
class ExpertLeaf:
    """What one expert-parallel experts module computes with (NOTE [expert dispatch]).

    `orig`: the module's own forward, taken before build wrapped it; `experts`: E; `group`, `rank`, `size`: the
    expert axis's process group, this rank's coordinate and the axis size; `grad_group`: the data-parallel
    ranks outside the expert axis (None: none); `grad_scale`: 1 / (data-parallel replicas); `count_attrs`:
    the module's integer attributes that count its experts (set to E/n while it runs its local experts);
    `param_dtype`: the dtype the weights are cast to for the compute (FSDP2's mixed-precision policy)."""

    path: str
    orig: Callable[..., Any]
    experts: int
    group: Any
    rank: int
    size: int
    grad_group: Any
    grad_scale: float
    count_attrs: tuple[str, ...]
    param_dtype: torch.dtype | None = None  # FSDP2's mixed-precision compute dtype, which it does not cast these to
    tensor_group: Any = None  # the tensor axis splitting each expert's weights (NOTE [experts split by tensor])
    tensor_axis: str | None = None
    rows_checked: bool = False  # the rows were found the same on every rank of the tensor axis (once, real runs)
    load: list[int] | None = None  # rows each local expert received since `take_load` (real runs only)
    load_imbalance: float = 1.0  # the busiest rank's rows over the mean, rehearsed (NOTE [expert load in a rehearsal])

    def take_load(self) -> list[int]:
        """The rows each local expert received since the last call (every forward the experts ran, a
        checkpointed block's recompute included), and reset."""
        out, self.load = self.load or [0] * (self.experts // self.size), None
        return out

    def forward(self, m: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden, index, weights = self._bind(args, kwargs)
        if self.tensor_group is not None:  # NOTE [experts split by tensor]: a replicated input to split experts
            self._check_same_rows(hidden, index)
            hidden, weights = C.grad_all_reduce_many([hidden, weights], self.tensor_group)
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        t = x.shape[0]
        index = index.reshape(t, -1)
        k = index.shape[1]
        weights = weights.reshape(t, k)
        local_n = self.experts // self.size
        flat = index.reshape(-1)
        if is_fake(flat):  # NOTE [expert load in a rehearsal]
            order = torch.argsort(flat, stable=True)
            per_expert = _spread(flat.numel(), self.experts)
            C.exchange_counts(per_expert, self.group, device=x.device)
            got = _spread(round(self.load_imbalance * flat.numel()), self.experts)  # the busiest rank's
        else:
            pairs = ((flat >= 0) & (flat < self.experts)).nonzero().squeeze(1)
            order = pairs[torch.argsort(flat[pairs], stable=True)]
            per_expert = torch.bincount(flat[order], minlength=self.experts).tolist()
            got = C.exchange_counts(per_expert, self.group, device=x.device)  # per (source rank, local expert)
            mine = [sum(got[r * local_n + e] for r in range(self.size)) for e in range(local_n)]
            self.load = mine if self.load is None else [a + b for a, b in zip(self.load, mine)]
        send = [sum(per_expert[r * local_n:(r + 1) * local_n]) for r in range(self.size)]
        recv = [sum(got[r * local_n:(r + 1) * local_n]) for r in range(self.size)]
        rows = C.exchange_rows(x[torch.div(order, k, rounding_mode="floor")], send, recv, self.group)
        w = C.exchange_rows(weights.reshape(-1, 1)[order], send, recv, self.group)  # each row's routing weight
        # each source sent its rows ordered by expert: the local expert of each received row, from the counts
        ids = torch.repeat_interleave(torch.arange(local_n, device=x.device).repeat(self.size),
                                      torch.tensor(got, device=x.device), output_size=sum(recv)).unsqueeze(1)
        back = C.exchange_rows(self._local(m, rows, ids, w), recv, send, self.group)  # weighted by the model
        out = _combine(back, order, index, shape, x.dtype)
        return out if self.tensor_group is None else C.all_reduce(out, self.tensor_group)  # the parts' sum

    def _check_same_rows(self, hidden: torch.Tensor, index: torch.Tensor) -> None:
        """Raise BuildError when the ranks of the tensor axis do not hold the same rows (a sequence-parallel
        input): their parts would sum different tokens. Once per module, on real tensors (a layout, not data)."""
        if self.rows_checked or is_fake(hidden):
            return
        with torch.no_grad():
            mine = torch.stack([torch.tensor(float(hidden.numel()), device=hidden.device),
                                hidden.detach().double().sum(), index.double().sum()])
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.tensor_group))]
            dist.all_gather(every, mine, group=self.tensor_group)
        if any(not torch.equal(e, mine) for e in every):
            raise BuildError(f"expert_parallel at sch[{self.path!r}]: the ranks of tensor axis "
                             f"{self.tensor_axis!r} route different rows (sequence parallel?); each expert's "
                             f"weights split over an axis whose ranks hold the same rows")
        self.rows_checked = True

    def _local(self, m: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
        """The module's own forward on the rows it received (each with its local expert and routing weight, or in
        groups by local expert: `DenseExpertLeaf`)."""
        names = [n for n, p in m._parameters.items() if p is not None]
        saved = {n: m._parameters[n] for n in names}
        counts = {a: getattr(m, a) for a in self.count_attrs}
        track = torch.is_grad_enabled() and any(p.requires_grad for p in saved.values())
        try:
            if track:  # NOTE [expert gradients]
                for n, p in zip(names, _ExpertGrads.apply(self.grad_group, self.grad_scale, *saved.values())):
                    m._parameters[n] = p
            if self.param_dtype is not None:  # as FSDP2 casts the weights it gathers (gradients back in fp32)
                for n in names:
                    if m._parameters[n].is_floating_point() and m._parameters[n].dtype != self.param_dtype:
                        m._parameters[n] = m._parameters[n].to(self.param_dtype)
            for a in self.count_attrs:
                setattr(m, a, self.experts // self.size)
            y = self.orig(*inputs)
            if track:
                y = _Touch.apply(y, *(m._parameters[n] for n in names))
            return y
        finally:
            m._parameters.update(saved)
            for a, v in counts.items():
                setattr(m, a, v)

    def _bind(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        try:
            bound = inspect.signature(self.orig).bind(*args, **kwargs)
        except TypeError as exc:
            raise BuildError(f"expert_parallel at sch[{self.path!r}]: cannot bind the experts' arguments ({exc})") \
                from None
        values = list(bound.arguments.values())
        extra = [n for n, v in list(bound.arguments.items())[3:] if isinstance(v, torch.Tensor)]
        if len(values) < 3 or extra:
            raise BuildError(f"expert_parallel at sch[{self.path!r}]: the experts were called with "
                             f"{list(bound.arguments)}; expert parallelism sends (hidden_states, top_k_index, "
                             f"top_k_weights) to the experts' ranks and no other tensor")
        hidden, index, weights = values[:3]
        tokens = hidden.numel() // max(hidden.shape[-1], 1)
        if index.dtype.is_floating_point or index.dtype == torch.bool or index.numel() % max(tokens, 1) \
                or weights.shape != index.shape:
            raise BuildError(f"expert_parallel at sch[{self.path!r}]: expert indices of dtype {index.dtype} and "
                             f"shape {tuple(index.shape)}, weights of shape {tuple(weights.shape)}, for rows of "
                             f"shape {tuple(hidden.shape)}; expected integer indices and their weights, k per row")
        return hidden, index, weights


@dataclass
class DenseExpertLeaf(ExpertLeaf):
    """The local forward of an expert-parallel experts module that takes E groups of rows, one per expert (NOTE
    [dense experts] in `treadle.schedule.expert_split`): rank r sends each rank the groups of that rank's experts
    (contiguous: the rows are expert-major), runs its El local experts on the groups every rank sent, in expert-major
    order again, and sends the results back, where they land in the rows' own order. One exchange of each rank's
    group size, then one of the rows each way; the gradients as NOTE [expert gradients] says."""

    def forward(self, m: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        bound = inspect.signature(self.orig).bind(*args, **kwargs).arguments
        x = next(iter(bound.values()))
        if len(bound) != 1 or not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] % self.experts:
            raise BuildError(f"expert_parallel at sch[{self.path!r}]: the experts were called with "
                             f"{list(bound)}; dense experts take one (E x T, H) tensor of E groups of rows")
        n, local_n = self.size, self.experts // self.size
        t = x.shape[0] // self.experts
        if is_fake(x):  # every rank's groups as large as this one's
            C.exchange_counts([t] * self.experts, self.group, device=x.device)
            sizes = [t] * n
        else:
            got = C.exchange_counts([t] * self.experts, self.group, device=x.device)
            sizes = [got[r * local_n] for r in range(n)]  # rank r's group size
            self.load = [sum(sizes)] * local_n if self.load is None else [a + sum(sizes) for a in self.load]
        recv = [local_n * s for s in sizes]
        rows = C.exchange_rows(x, [local_n * t] * n, recv, self.group)  # by source rank, then local expert
        starts = [sum(recv[:r]) for r in range(n)]
        order = torch.cat([torch.arange(starts[r] + j * sizes[r], starts[r] + (j + 1) * sizes[r], device=x.device)
                           for j in range(local_n) for r in range(n)]) if sum(recv) else \
            torch.zeros(0, dtype=torch.long, device=x.device)
        y = self._local(m, rows[order])  # expert-major, every rank's group of each local expert
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        return C.exchange_rows(y[back], recv, [local_n * t] * n, self.group)
