"""Materialising a model built on the meta device: per module, seeded by its path, so every mesh (and the
single-process reference) gets the same global tensors."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

from ..errors import BuildError


def stable_seed(text: str) -> int:
    """A seed from a string that is the same in every process (unlike `hash`)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def materialize(model: nn.Module, init_fn: Callable[[nn.Module], None] | None, device: torch.device | str,
                *, on_new: Callable[[nn.Parameter, nn.Parameter], None] | None = None) -> None:
    """Give the meta parameters of `model` real values, in place: per module (in `named_modules` order),
    full-size and seeded by the module's path, initialised by `init_fn`, else the model's ``_init_weights``,
    else the module's ``reset_parameters``. The same global tensors come out for every mesh (build slices
    them afterwards) and in a single process (verify's reference). Tied parameters stay one object;
    `on_new(old, new)` is told of every replaced parameter. Raises BuildError for meta buffers or a module
    with no way to initialise."""
    init = init_fn
    if init is None:
        hf = getattr(model, "_init_weights", None)
        init = hf if callable(hf) else None
    done: set[int] = set()
    owners = _owners(model)
    for path, m in model.named_modules():
        metas = {n: p for n, p in m._parameters.items() if p is not None and p.is_meta and id(p) not in done}
        meta_bufs = [n for n, b in m._buffers.items() if b is not None and b.is_meta]
        if meta_bufs:
            raise BuildError(f"build: buffers {meta_bufs} of {path!r} are on the meta device; treadle can only "
                             f"materialise parameters (create buffers on a real device)")
        if not metas:
            continue
        for n, p in metas.items():
            m._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                            requires_grad=p.requires_grad)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stable_seed(path))
            if init is not None:
                init(m)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
            else:
                raise BuildError(f"build: {path!r} ({type(m).__name__}) has meta parameters but no "
                                 f"reset_parameters(); pass build(sch, init_fn=...)")
        for n, p in metas.items():
            new = m._parameters[n]
            for mm, nn_, _ in owners.get(id(p), []):  # re-point every alias (tied parameters)
                mm._parameters[nn_] = new
            if on_new is not None:
                on_new(p, new)
            done.add(id(new))
        owners = _owners(model)


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    out: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        for name, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((m, name, path))
    return out
