"""Tensor parallelism inside each expert: which split of an experts module's weights over a tensor axis makes its
own forward, on each rank's slices, sum to the whole (read by `Schedule.expert_parallel(tensor=)` to derive the
split and by build to check any split a schedule states).

NOTE [experts split by tensor]: with experts split over a data-parallel axis ``ep`` and each expert's weights
split over a tensor axis ``tp`` of t ranks (Megatron-Core's expert tensor parallelism), every rank of a ``tp``
group routes the same tokens to the same experts' ranks; each computes, with its slices, one part of each
routed pair's result, and the parts sum to the model's result when the split cuts each expert's inner width:
the up projections split on their outputs (a fused gate|up in its two blocks), the down projection on its
contraction, any bias of the inner width split with it. So the local forward takes the rows and their
routing weights as a replicated input to sharded compute (identity forward, their gradients summed over
``tp`` in backward: each rank's part of them is partial) and sums the combined result over ``tp`` (one
all-reduce of T x H per experts module; backward identity). The expert weights' gradients need no ``tp``
reduction: each rank's slice sees every routed row.

Which split does that is not read off names or shapes alone (a fused gate|up may be two blocks or interleaved,
a bias of the hidden width cannot be split and would be added t times): `find_split` tries the candidates on
random weights of one expert, in float32, on the CPU, and keeps the first whose t parts sum to the whole
(within float32 rounding); `check_split` runs the same test on a split stated by hand. The test depends on the
forward's code and the weights' shapes only, never their values; one probe per module type, shapes, plain
attributes and child types (`_PROBED`, keyed on all of them: a cache of a pure function of its key).
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch
from torch import nn

from ..errors import ScheduleError
from .state import ParamShard, chunk_dim

_PROBED: dict[tuple, bool] = {}  # (module type, shapes, split, t) -> the parts sum to the whole


def _count_attrs(mod: nn.Module, experts: int) -> dict[str, int]:
    return {n: v for n, v in vars(mod).items() if "expert" in n.lower() and type(v) is int and v == experts}


def _hidden_sizes(shapes: dict[str, tuple[int, ...]]) -> list[int]:
    """Candidate widths of the routed rows: sizes that every matrix stack (E, a, b) has, most common first."""
    mats = [s[1:] for s in shapes.values() if len(s) == 3]
    common = set(mats[0]).intersection(*map(set, mats[1:])) if mats else set()
    return sorted(common, key=lambda h: (-sum(s.count(h) for s in mats), h))


@contextlib.contextmanager
def _weights(mod: nn.Module, params: dict[str, torch.Tensor], counts: dict[str, int], experts: int):
    """`mod` with `params` as its weights and its expert-counting attributes (`counts`) set to `experts`, restored
    after."""
    saved = {n: mod._parameters[n] for n in params}
    saved_counts = {a: getattr(mod, a) for a in counts}
    try:
        mod._parameters.update(params)
        for a in counts:
            setattr(mod, a, experts)
        yield mod
    finally:
        mod._parameters.update(saved)
        for a, v in saved_counts.items():
            setattr(mod, a, v)


def _run(mod: nn.Module, params: dict[str, torch.Tensor], rows: torch.Tensor, counts: dict[str, int]):
    """The module's own forward on `rows` routed to its expert 0 (of one), with `params` as its weights."""
    with _weights(mod, params, counts, 1):
        index = torch.zeros((rows.shape[0], 1), dtype=torch.long)
        weights = torch.linspace(0.5, 1.5, rows.shape[0], dtype=rows.dtype).unsqueeze(1)
        return mod.forward(rows, index, weights)


def _sums_to_whole(mod: nn.Module, split: dict[str, ParamShard], size: int) -> tuple[bool, str]:
    """(whether the parts of `size` ranks sum to the whole, what went wrong) on random float32 weights of one
    expert (NOTE [experts split by tensor])."""
    own = {n: p for n, p in mod.named_parameters(recurse=False)}
    shapes = {n: (1, *p.shape[1:]) for n, p in own.items()}
    plain = tuple(sorted((k, v) for k, v in vars(mod).items() if type(v) in (int, float, str, bool)))
    children = tuple((n, type(c)) for n, c in mod.named_children())
    key = (type(mod), plain, children, tuple(sorted(shapes.items())), tuple(sorted(split.items())), size)
    if key in _PROBED:
        return _PROBED[key], "the parts do not sum to the whole"
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    counts = _count_attrs(mod, next(iter(own.values())).shape[0])
    gen = torch.Generator().manual_seed(0)
    ok, why = False, "its forward did not run on any width of rows its weights share"
    with unset_fake_temporarily(), torch.no_grad():
        whole = {n: torch.randn(s, generator=gen) / math.sqrt(max(s[-1], 1)) for n, s in shapes.items()}
        for h in _hidden_sizes(shapes):
            rows = torch.randn((3, h), generator=gen)
            try:
                full = _run(mod, whole, rows, counts)
            except Exception:  # noqa: BLE001 - a wrong guess of the rows' width
                continue
            parts = []
            try:
                for r in range(size):
                    local = {n: chunk_dim(t, split[n].dim, size, r, split[n].blocks) if n in split else t
                             for n, t in whole.items()}
                    parts.append(_run(mod, local, rows, counts))
            except Exception as exc:  # noqa: BLE001 - reported: this split cannot run the module's code
                ok, why = False, f"its forward fails on the slices ({type(exc).__name__}: {exc})"
                break
            total = torch.stack(parts).sum(0)
            ok = bool(total.shape == full.shape and torch.allclose(total, full, rtol=1e-4,
                                                                   atol=1e-5 * float(full.abs().max())))
            why = "the parts do not sum to the whole"
            break
    _PROBED[key] = ok
    return ok, why


def _candidates(mod: nn.Module, size: int) -> list[dict[str, ParamShard]]:
    """Splits to try, most plausible first: each weight split on one dim that is not the rows' width (contiguous,
    then in two blocks), or left whole."""
    own = {n: tuple(p.shape) for n, p in mod.named_parameters(recurse=False)}
    hidden = _hidden_sizes({n: (1, *s[1:]) for n, s in own.items()})
    h = hidden[0] if hidden else None
    per: list[list[ParamShard | None]] = []
    for s in own.values():
        opts: list[ParamShard | None] = []
        dims = [d for d in range(1, len(s)) if s[d] != h] or (list(range(1, len(s))) if len(s) == 3 else [])
        for blocks in (1, 2):
            opts += [ParamShard(d, "t", blocks) for d in dims if s[d] % (blocks * size) == 0]
        per.append(opts + [None] if len(s) == 2 else opts or [None])
    names = list(own)
    out = []
    for combo in itertools.islice(itertools.product(*per), 64):
        split = {n: sh for n, sh in zip(names, combo) if sh is not None}
        if split:
            out.append(split)
    return out


def find_split(mod: nn.Module, size: int, *, where: str) -> dict[str, ParamShard]:
    """The split (parameter name -> ParamShard over the placeholder axis "t") of experts module `mod`'s weights
    over a tensor axis of `size` ranks whose parts sum to the whole (NOTE [experts split by tensor]). Raises
    ScheduleError naming the module's weights when none does."""
    if size == 1:
        return {}
    for split in _candidates(mod, size):
        if _sums_to_whole(mod, split, size)[0]:
            return split
    shapes = {n: tuple(p.shape) for n, p in mod.named_parameters(recurse=False)}
    raise ScheduleError(f"{where}: no split of the experts' weights {shapes} over {size} ranks lets each rank compute "
                        f"a part of every expert that sums to the whole (NOTE [experts split by tensor]: the inner "
                        f"width split, a bias of the rows' width left out); split the experts over the expert axis "
                        f"only, or state the split with shard(...) if it is one the search does not try")


def check_split(mod: nn.Module, shards: dict[str, list[ParamShard]], axis: str, size: int, *, where: str) -> None:
    """Raise ScheduleError unless the stated split of `mod`'s weights over tensor axis `axis` (`shards`: name -> its
    ParamShards on `axis`) makes the parts sum to the whole (NOTE [experts split by tensor])."""
    split = {n: ParamShard(s[0].dim, "t", s[0].blocks) for n, s in shards.items()}
    bad = [n for n, s in split.items() if s.dim == 0]
    if bad:
        raise ScheduleError(f"{where}: parameter {bad[0]!r} is split on dim 0, the experts' dim, over {axis!r}; "
                            f"the expert axis splits the experts, a tensor axis each expert's weights")
    ok, why = _sums_to_whole(mod, split, size)
    if not ok:
        stated = {n: (s.dim, s.blocks) for n, s in split.items()}
        raise ScheduleError(f"{where}: the experts' weights split over {axis!r} as (dim, blocks) {stated}: {why} "
                            f"(NOTE [experts split by tensor]); expert_parallel(tensor={axis!r}) finds a split "
                            f"that does")


def as_axis(split: dict[str, ParamShard], axis: str) -> dict[str, ParamShard]:
    """`split` (over the placeholder axis) on mesh axis `axis`."""
    return {n: ParamShard(s.dim, axis, s.blocks) for n, s in split.items()}




# NOTE [dense experts]: some MoE layers hand their experts module every token once per expert, already weighted by
# its routing score (zero where not routed), as one tensor of E groups of T rows, expert-major, and the module runs
# expert e on group e (``forward(hidden_states (E*T, H)) -> (E*T, H)``: Llama 4). Such a module is found by data flow,
# not by name: on random weights of two experts and two groups of rows, changing the rows of group 0, or the weights
# of expert 0, must change the output rows of group 0 and no others. Expert parallelism then sends each rank the
# groups of its experts (`treadle.forms.expert.dispatch.DenseExpertLeaf`).
_DENSE: dict[tuple, bool] = {}  # (module type, shapes, plain attributes, children) -> dense experts


def dense_experts(mod: nn.Module) -> bool:
    """Whether experts module `mod` runs expert e on the e-th of E equal groups of the rows it takes (NOTE [dense
    experts]); probed once per module type and shapes."""
    own = {n: p for n, p in mod.named_parameters(recurse=False)}
    if not own:
        return False
    shapes = {n: (2, *p.shape[1:]) for n, p in own.items()}
    plain = tuple(sorted((k, v) for k, v in vars(mod).items() if type(v) in (int, float, str, bool)))
    key = (type(mod), plain, tuple((n, type(c)) for n, c in mod.named_children()), tuple(sorted(shapes.items())))
    if key not in _DENSE:
        _DENSE[key] = _probe_dense(mod, shapes, next(iter(own.values())).shape[0])
    return _DENSE[key]


def _probe_dense(mod: nn.Module, shapes: dict[str, tuple[int, ...]], experts: int) -> bool:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    counts = _count_attrs(mod, experts)
    gen = torch.Generator().manual_seed(0)

    def run(params: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        with _weights(mod, params, counts, 2):
            return mod.forward(rows)

    with unset_fake_temporarily(), torch.no_grad():
        weights = {n: torch.randn(s, generator=gen) / math.sqrt(max(s[-1], 1)) for n, s in shapes.items()}
        for h in _hidden_sizes(shapes):
            rows = torch.randn((6, h), generator=gen)  # two groups of three rows
            try:
                out = run(weights, rows)
            except Exception:  # noqa: BLE001 - a wrong guess of the rows' width, or not this layout
                continue
            if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != 6:
                return False
            moved = rows.clone()
            moved[:3] += 1.0
            other = {n: t.clone() for n, t in weights.items()}
            for t in other.values():
                t[0] += 1.0
            for y in (run(weights, moved), run(other, rows)):
                if torch.allclose(y[:3], out[:3]) or not torch.equal(y[3:], out[3:]):
                    return False
            return True
    return False


__all__ = ["find_split", "check_split", "as_axis", "dense_experts"]
