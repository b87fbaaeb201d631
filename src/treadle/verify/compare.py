"""Compare rank-local tensors with a global reference: infer the layout, assemble, measure the error.

`assemble_best` tries every layout per mesh axis — Replicate (every rank's copy; the one farthest from the
first counts), Partial (sum the ranks),
Shard(d) (concatenate in coordinate order) — that fits the shapes, and returns the assembly closest to
the reference. That finds pending sums and shards without being told, so a verifier can compare any
module's output; a wrong schedule shows as no layout fitting.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ..mesh import Mesh


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


def tolerance(dtype: torch.dtype) -> Tolerance:
    """Tolerance for comparing a distributed result with the single-process one (different summation
    order): fp32/fp64 tight, half precision loose."""
    if dtype in (torch.float64,):
        return Tolerance(1e-7, 1e-9)
    if dtype in (torch.float16, torch.bfloat16):
        return Tolerance(2e-2, 2e-2)
    return Tolerance(1e-4, 2e-5)


@dataclass(frozen=True)
class Diff:
    """Error of one comparison: max abs error, max error relative to the reference's scale, and the layout
    that was inferred (e.g. ``"dp=S(0) tp=R"``)."""

    max_abs: float
    max_rel: float
    ok: bool
    layout: str = ""
    note: str = ""


def diff(got: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> Diff:
    if got.shape != ref.shape:
        return Diff(math.inf, math.inf, False, note=f"shape {tuple(got.shape)} vs reference {tuple(ref.shape)}")
    g, r = got.detach().double(), ref.detach().double()
    if g.numel() == 0:
        return Diff(0.0, 0.0, True)
    err = (g - r).abs()
    max_abs = float(err.max())
    scale = float(r.abs().max())
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    # relative to the tensor's scale: element-wise relative error is meaningless for entries near zero
    ok = max_abs <= tol.atol + tol.rtol * scale
    return Diff(max_abs, max_rel, ok)


def _combine(by_coord: dict[tuple[int, ...], torch.Tensor], mesh: Mesh, choice: tuple,
             blocks: int = 1) -> torch.Tensor:
    from ..runtime.params import unchunk_dim

    current = dict(by_coord)
    for ax in reversed(range(mesh.ndim)):
        kind = choice[ax]
        groups: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}
        for coord, t in current.items():
            groups.setdefault(coord[:ax] + (0,) + coord[ax + 1 :], []).append((coord[ax], t))
        merged = {}
        for key, items in groups.items():
            items.sort(key=lambda x: x[0])
            ts = [t for _, t in items]
            if kind == "R":  # every rank must hold it: per entry, the rank farthest from the first one
                merged[key] = worst_copy(ts)
            elif kind == "P":
                merged[key] = torch.stack([t.double() for t in ts]).sum(0).to(ts[0].dtype)
            else:
                last = kind[1] == ts[0].dim() - 1
                merged[key] = unchunk_dim(ts, kind[1], blocks if last else 1)
        current = merged
    return next(iter(current.values()))


def worst_copy(ts: list[torch.Tensor]) -> torch.Tensor:
    """Entry-wise, the value among `ts` farthest from ts[0] (NaN counts as farthest), so a Replicate assembly
    compares every rank's copy with the reference, not only the first rank's."""
    if len(ts) == 1 or all(torch.equal(t, ts[0]) for t in ts[1:]):
        return ts[0]
    stack = torch.stack(ts)
    dev = (stack.double() - ts[0].double()).abs().nan_to_num(nan=math.inf)
    return stack.gather(0, dev.argmax(0, keepdim=True)).squeeze(0)


def _label(mesh: Mesh, choice: tuple) -> str:
    return " ".join(f"{n}={c if isinstance(c, str) else f'S({c[1]})'}" for n, c in zip(mesh.names, choice))


def assemble_best(local_by_rank: list[torch.Tensor], ref: torch.Tensor, mesh: Mesh, tol: Tolerance,
                  *, allow_partial: bool = True, blocks: int = 1) -> Diff:
    """Best `Diff` over every layout of the rank-local tensors that yields the reference's shape.
    `blocks` > 1: a shard of the last dim is interleaved in that many parts (a fused q|k|v output)."""
    by_coord = {tuple(mesh.coordinate(r).values()): t for r, t in enumerate(local_by_rank)}
    local_shape = local_by_rank[0].shape
    if any(t.shape != local_shape for t in local_by_rank):
        return Diff(math.inf, math.inf, False, note="ranks hold different shapes")
    if len(local_shape) != ref.dim():
        return Diff(math.inf, math.inf, False, note=f"rank shape {tuple(local_shape)} vs reference {tuple(ref.shape)}")
    per_axis = []
    for size in mesh.shape:
        opts: list = ["R"] + ([("S", d) for d in range(ref.dim()) if local_shape[d] * size <= ref.shape[d]])
        if allow_partial and size > 1:
            opts.append("P")
        per_axis.append(opts)
    best: Diff | None = None
    for choice in itertools.product(*per_axis):
        factor = [1] * ref.dim()
        for size, c in zip(mesh.shape, choice):
            if isinstance(c, tuple):
                factor[c[1]] *= size
        if any(local_shape[d] * factor[d] != ref.shape[d] for d in range(ref.dim())):
            continue
        d = diff(_combine(by_coord, mesh, choice, blocks), ref, tol)
        d = Diff(d.max_abs, d.max_rel, d.ok, _label(mesh, choice), d.note)
        if d.ok:
            return d
        if best is None or d.max_abs < best.max_abs:
            best = d
    if best is None:
        return Diff(math.inf, math.inf, False, note=f"no layout of rank shape {tuple(local_shape)} on {mesh} "
                                                    f"gives the reference shape {tuple(ref.shape)}")
    return best
