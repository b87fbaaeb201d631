"""Surgery on the module tree: install a module at a path, carrying the old one's hooks (what `replace` and a
traced module's installation share)."""

from __future__ import annotations

from torch import nn


def within(path: str, prefix: str) -> bool:
    """`path` is the module `prefix` or inside it ("" holds everything)."""
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def swap_module(model: nn.Module, path: str, old: nn.Module, new: nn.Module) -> None:
    """Install `new` at `path` (not the root), carrying over the hooks registered on `old`."""
    copy_hooks(old, new)
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, new)


def copy_hooks(old: nn.Module, new: nn.Module) -> None:
    """Carry the hooks registered on `old` (and its training flag) over to `new`."""
    for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
                 "_backward_pre_hooks"):
        src = getattr(old, attr, None)
        dst = getattr(new, attr, None)
        if src and dst is not None:
            for k, v in src.items():
                dst[k] = v
    if getattr(old, "_is_full_backward_hook", None) is not None:  # full vs legacy backward hooks
        new._is_full_backward_hook = old._is_full_backward_hook
    new.train(old.training)
