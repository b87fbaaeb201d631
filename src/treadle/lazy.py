"""Loading on first use: every layer's registrations load once, before any registry is first read; a package's
public names import when first used; a registry may name a class without importing its library.

NOTE [registrations on first use]: the layers extend each other by registries (the parallel forms in
`treadle.form`, build steps in `treadle.runtime.steps`, leaf and dimension rules in `treadle.sharding_rules`, the
graph layer in `treadle.schedule.graph_primitives`, module forms and decompositions in `treadle.graph`). The
modules that register sit above the registries, so no registry can import them; the package ``treadle`` (its
``__init__``, the facade, which every import of a treadle module runs first) hands this module the function that
imports them all (`set_loader`), and every function that reads a registry calls `load_registrations()` first.
Importing a treadle module therefore costs only what that module imports (``treadle --help`` and the CLI's
argument checks start in about the time of ``import torch``), and the first read of a registry in a process sees
every registration, in one fixed order, whichever module was imported first.

A registry may key a class by its qualified name (`qualified_name`: ``"transformers.pytorch_utils.Conv1D"``),
so that registering a rule for a class of an optional library does not import that library: a module of that
class exists only once its library is imported.
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

_loader: Callable[[], None] | None = None
_phase = "unset"  # "unset" -> "pending" (a loader is set) -> "loading" -> "done"
_lock = threading.RLock()


def set_loader(fn: Callable[[], None]) -> None:
    """Called once, by the facade (`treadle/__init__.py`): `fn` imports every module that registers."""
    global _loader, _phase
    with _lock:
        _loader, _phase = fn, "pending"


def load_registrations() -> None:
    """Run the loader once per process (cheap afterwards). A read of a registry from inside the loading (a
    module it imports reading one at import time) returns at once and sees what is registered so far, as an
    eager import in the same order would; another thread waits for the loading to end."""
    global _phase
    if _phase == "done" or _phase == "unset":
        return
    with _lock:
        if _phase != "pending":  # "loading": this thread, re-entered from inside the loader
            return
        _phase = "loading"
        try:
            if _loader is not None:
                _loader()
        except BaseException:
            _phase = "pending"  # a failed import is raised here and met again by the next reader
            raise
        _phase = "done"


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class: the key a registry may hold instead of the class itself."""
    return f"{cls.__module__}.{cls.__qualname__}"


def export_lazily(package: str, names: dict[str, str], *, before: Callable[[], None] | None = None) -> None:
    """Give package `package` the attributes `names`, each imported when first used (after ``before()``): a value
    ``"pkg.mod:attr"`` is that module's attribute, ``"pkg.mod"`` the module itself. A name that is also a
    sub-module of the package but exports an attribute (``treadle.verify``: the function) stays the attribute
    when the sub-module is imported (the import system binds a sub-module on its package; an eager
    ``from .verify import verify`` rebound the name right after)."""

    class LazyPackage(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            spec = names.get(name)
            if spec is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            if before is not None:
                before()
            module, _, attr = spec.partition(":")
            value = importlib.import_module(module)
            value = getattr(value, attr) if attr else value
            types.ModuleType.__setattr__(self, name, value)
            return value

        def __setattr__(self, name: str, value: Any) -> None:
            if ":" in names.get(name, "") and isinstance(value, types.ModuleType) \
                    and value.__name__ == f"{package}.{name}":
                return  # the sub-module stays sys.modules[f"{package}.{name}"]; the package's name is the attribute
            types.ModuleType.__setattr__(self, name, value)

        def __dir__(self) -> list[str]:
            return sorted(set(vars(self)) | set(names))

    sys.modules[package].__class__ = LazyPackage
