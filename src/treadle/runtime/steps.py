"""The steps `build` runs that other layers and the parallel forms contribute, by phase, and the one way a step
wraps a module's forward."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from ..errors import BuildError
from ..lazy import load_registrations

# Build steps contributed by other layers and by the parallel forms (graph rewrites, pipelines, data
# parallelism). Each is called with the builder at its phase: "pre_materialize" (before meta parameters get values:
# steps that read the model's structure and shapes only — graph rewrites, a pipeline's capture — and may name the
# modules this rank never runs, `builder.keep_meta`, which then stay on meta: NOTE [what stays on meta]),
# "pre_shard" (before parameters are sliced), "post_hooks" (after syncs, checkpoints and RNG wrappers are
# installed), "wrap" (the last step: may return the model to hand back — a pipeline stage runner, the DDP / FSDP2 wrapper of `treadle.forms.data` —
# or None to fall through; the first that returns one wins).
_EXTENSIONS: dict[str, list[Callable[[Any], Any]]] = {"pre_materialize": [], "pre_shard": [], "post_hooks": [],
                                                       "wrap": []}


def register_build_extension(phase: str, fn: Callable[[Any], Any]) -> None:
    """Add a build step for `phase` ("pre_materialize", "pre_shard", "post_hooks" or "wrap")."""
    if phase not in _EXTENSIONS:
        raise BuildError(f"unknown build phase {phase!r}; phases: {list(_EXTENSIONS)}")
    if fn not in _EXTENSIONS[phase]:
        _EXTENSIONS[phase].append(fn)


def build_steps(phase: str) -> list[Callable[[Any], Any]]:
    """The registered steps of `phase`, in registration order."""
    load_registrations()
    return list(_EXTENSIONS[phase])


def wrap_forward(mod: nn.Module, make: Callable[[Callable], Callable]) -> None:
    """Replace `mod.forward` by ``make(orig)`` (keeping the original's name and signature for introspection)."""
    orig = mod.forward
    new = make(orig)
    functools.update_wrapper(new, orig)
    mod.forward = new
