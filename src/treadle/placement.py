"""The placement algebra every layer shares: one axis's placement as a code, and its one printer.

A placement on one mesh axis is PyTorch's `Shard(dim)`, `Replicate()` or `Partial()` (a pending sum; only
"sum"). Code that enumerates layouts (the planner's dimension algebra, layout conversion) keeps it as an
int: ``R`` (-1) Replicate, ``P`` (-2) Partial, ``d >= 0`` Shard(d). `code_of` / `placement_of` convert, and
`placement_str` prints either form: ``R``, ``P``, ``S(0)`` for display, ``S0`` as the token stored in plan
files (`token=True`); `code_of` reads both.
"""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .errors import LayoutError

R = -1  # Replicate()
P = -2  # Partial() (sum)
# not a placement: a planner pin's wildcard, "sharded on this axis, on whichever dim the solver picks" (pin value "S")
ANY_SHARD = -3


def pin_holds(pl: tuple[int, ...], pin: tuple[int, ...]) -> bool:
    """Whether placement codes `pl` (one per tensor axis) meet a pin's codes (ANY_SHARD: any Shard on that axis)."""
    return all(q == c or (c == ANY_SHARD and q >= 0) for q, c in zip(pl, pin, strict=True))


def code_of(p: Placement | str, axis: int | str = 0) -> int:
    """The code of a placement or a token (``R``, ``P``, ``S0``, ``S(0)``, ``Replicate``, ``Partial``; any case).
    Raises LayoutError naming `axis` for a Shard subclass, a negative dim, a non-sum Partial, text that is
    none of these, or anything else (an int is a code already, not a placement)."""
    if isinstance(p, str):
        t = p.strip().upper().replace("(", "").replace(")", "")
        if t in ("R", "REPLICATE"):
            return R
        if t in ("P", "PARTIAL", "PSUM", "PARTIALSUM"):
            return P
        if t.startswith("S") and t[1:].isdigit():
            return int(t[1:])
        raise LayoutError(f"placement on axis {axis}: cannot parse {p!r}; use R, P or S<dim> (e.g. 'S0')")
    if isinstance(p, Shard):
        if type(p) is not Shard:
            raise LayoutError(f"placement on axis {axis}: {p!r} is not supported (plain Shard(dim) only)")
        if p.dim < 0:
            raise LayoutError(f"placement on axis {axis}: Shard dim must be >= 0 (layouts do not know the rank); "
                              f"got {p!r}")
        return p.dim
    if isinstance(p, Replicate):
        return R
    if isinstance(p, Partial):
        if p.reduce_op != "sum":
            raise LayoutError(f"placement on axis {axis}: only Partial('sum') is supported; got {p!r}")
        return P
    raise LayoutError(f"placement on axis {axis}: expected Shard(dim), Replicate() or Partial(); got {p!r}")


def _as_code(p: int | str | Placement) -> int:
    if isinstance(p, int) and not isinstance(p, bool):
        if p < P:
            raise LayoutError(f"placement code {p} is none of R (-1), P (-2) or a dim >= 0")
        return p
    return code_of(p)


def placement_of(p: int | str | Placement) -> Placement:
    """PyTorch's placement for a code or a token (a placement is returned as it is)."""
    if isinstance(p, (Shard, Replicate, Partial)):
        return p
    code = _as_code(p)
    return Replicate() if code == R else Partial() if code == P else Shard(code)


def placement_str(p: int | str | Placement, *, token: bool = False) -> str:
    """``R``, ``P`` or ``S(d)`` of a code, a token or a placement; with `token`, ``S<d>`` (the form plan
    decisions store)."""
    code = _as_code(p)
    if code == R:
        return "R"
    if code == P:
        return "P"
    return f"S{code}" if token else f"S({code})"
