"""Every role assignment of a mesh's axes the planner searches: what each parallel form may do with the live axes
(`treadle.form.Form.role_options`), the rest tensor-parallel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..form import forms
from ..mesh import Mesh
from .cost_graph import Roles


def enumerate_roles(mesh: Mesh, *, batch: int | None,
                    dp_axis: str | tuple[str, ...] | None | Literal["auto"] = "auto", zero: bool | None = None,
                    forbid_axes: tuple[str, ...] = (), reshard_after_forward: bool | None = True,
                    replicate: tuple[str, ...] | None = None) -> list[Roles]:
    """Every role assignment of the mesh's axes: each parallel form proposes what it may do with the live axes
    (`treadle.form.Form.role_options`; data parallelism on any subset of them whose sizes' product divides the
    batch — `dp_axis` "auto"; None: on none; an axis or a tuple: on exactly those — as DDP, ZeRO-3 or HSDP,
    `replicate` fixing HSDP's replicate axes or None searching, `zero` None (both) / False (DDP) / True (ZeRO-3
    / HSDP), `reshard_after_forward` the FSDP2 flag or None (both)); the live axes no form takes are
    tensor-parallel; forbidden and size-1 axes are off. Raises PlanError for a data-parallel axis that is not
    live."""
    for a in forbid_axes:
        mesh.axis_index(a)
    live = tuple(a for a in mesh.names if mesh.size(a) > 1 and a not in forbid_axes)
    off = tuple(a for a in mesh.names if a not in live)
    request = _RoleRequest(dp_axis, zero, reshard_after_forward, replicate)
    options: list[dict] = [{}]
    for f in forms():
        mine = f.role_options(mesh, live, batch=batch, request=request)
        if mine is not None:
            options = [{**o, **m} for o in options for m in mine]
    out = []
    for opt in options:
        taken = set(opt.get("dp", ()))
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
