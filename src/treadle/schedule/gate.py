"""The gate every name in a schedule or plan file passes: what a file may name, found without import or call.

NOTE [files are data]: reading a schedule, plan or run-config file runs no code the program did not allow.
A name a file holds (a `Ref` target, a ``replace``/``replace_all`` factory, a ``set_attr`` value, a class)
is one exact ``package.module:QualName`` string, and it resolves only to

1. a name in `FILE_EXPORTS` below: the few factories and loss classes treadle's own recipes, planner and
   graph primitives write into schedules (the module named there is imported, by that fixed name);
2. an object the program registered with `treadle.register_ref` (the registered object itself: nothing
   is imported, and the name is compared as a whole string);
3. for a class only (``replace_all``'s ``module_type``, ``trace``'s ``leaves``): an ``nn.Module`` subclass
   that a module *already imported* defines under exactly that name, found in the module's and the
   enclosing classes' own ``__dict__`` (no ``getattr``, so no module ``__getattr__`` or descriptor runs).
   A file can only compare modules against such a class: it is refused where it would be called;
4. names the caller passes as `trusted` (`trusted_load_args`: a program's own schedule sent to its ranks;
   the names came from its code, and they resolve as that code would).

Nothing else: no other ``treadle.*`` name, no attribute walk (``mod:os.system``, ``mod:f.__globals__``), no
dunder, no module attribute of a module; nothing is imported or called before the name has passed. A
pickled module loads only with ``allow_pickle=True`` (`treadle.schedule.log.decode`). A refusal is a
ScheduleError naming the file, the record and the name (its `where`), and saying how to opt in.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import types
from collections.abc import Collection
from typing import Any

from torch import nn

from ..errors import ScheduleError, TreadleError
from ..lazy import load_registrations

# The exported names: exact targets a file may always name, with what writes them. A refactor that moves one
# of these must move the name here too (tests/test_files_are_data.py resolves every entry).
FILE_EXPORTS: dict[str, str] = {
    "treadle.runtime.losses:VocabParallelLoss":
        "vocab-parallel loss: set_attr('loss_function', ...) of the megatron recipes and the planner",
    "treadle.models.kernels:sdpa_gpt2_attention": "replace factory of models.kernel_schedule (GPT-2 attention)",
    "treadle.models.kernels:sdpa_llama_attention": "replace factory of models.kernel_schedule (LLaMA attention)",
}

_REGISTERED: dict[str, Any] = {}  # exact target -> the object `register_ref` was given
MAX_NAME_CHARS = 200
MAX_JSON_DEPTH = 64  # nesting of a schedule / plan file; treadle writes at most ~8
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_NAME = re.compile(rf"({_IDENT}(?:\.{_IDENT})*):({_IDENT}(?:\.{_IDENT})*)")
_HOW = ("a file may name only treadle's exported factories and losses (treadle.schedule.gate.FILE_EXPORTS) "
        "and what your code registered; if you trust it, call treadle.register_ref(<that object>) before "
        "loading (NOTE [files are data])")


def register(target: str, obj: Any) -> None:
    """Let files name `obj` by `target` (``module:QualName``, see `treadle.register_ref`)."""
    _REGISTERED[target] = obj


def unregister(target: str) -> None:
    """Forget a registered name (tests; a name never registered is ignored)."""
    _REGISTERED.pop(target, None)


def registered(target: str) -> Any | None:
    """The object registered under exactly `target`, or None."""
    return _REGISTERED.get(target) if isinstance(target, str) else None


def _split(target: Any, what: str, where: str) -> tuple[str, str]:
    """(module, qualname) of a well-formed name; ScheduleError for anything else (the name is not shown in
    full when it is long)."""
    text = repr(target)
    shown = text if len(text) <= MAX_NAME_CHARS else f"{text[:60]}... ({len(text)} chars)"
    if not isinstance(target, str) or len(target) > MAX_NAME_CHARS:
        raise ScheduleError(f"{where}: {what} must be a 'package.module:QualName' string of at most "
                            f"{MAX_NAME_CHARS} characters, got {shown}")
    m = _NAME.fullmatch(target)
    if m is None:
        raise ScheduleError(f"{where}: {what} {shown} is not a 'package.module:QualName' name")
    return m.group(1), m.group(2)


def _has_dunder(mod_name: str, qual: str) -> bool:
    """A ``__x__`` part anywhere but a script's own module name ``__main__``."""
    parts = ([] if mod_name == "__main__" else mod_name.split(".")) + qual.split(".")
    return any(p.startswith("__") and p.endswith("__") for p in parts)


def _own_dict(obj: Any) -> Any:
    """The ``__dict__`` of a module or class read through the base descriptors, so no property that a module
    subclass or a metaclass defines can run."""
    if isinstance(obj, type):
        return type.__dict__["__dict__"].__get__(obj)
    if isinstance(obj, types.ModuleType):
        return types.ModuleType.__dict__["__dict__"].__get__(obj)
    return {}


def _exported(target: str) -> Any:
    mod_name, _, qual = target.partition(":")
    obj = vars(importlib.import_module(mod_name)).get(qual)  # a fixed treadle module, by its fixed name
    if obj is None or getattr(obj, "__qualname__", None) != qual:
        raise ScheduleError(f"treadle exports {target!r} for files but it no longer exists there; "
                            f"update treadle.schedule.gate.FILE_EXPORTS")  # a treadle bug, not the file's
    return obj


def import_by_name(target: str, where: str = "") -> Any:
    """A name the program's own code recorded (a trusted name, or a Ref made in code): import its module and walk
    its qualname. Never for a name read from a file that is not trusted. Raises ScheduleError naming `where`."""
    mod_name, _, qual = target.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ScheduleError(f"{where + ': ' if where else ''}cannot import {target!r}: {exc}") from exc
    return obj


def resolve_callable(target: Any, *, where: str, trusted: Collection[str] = ()) -> Any:
    """The object a file's callable name (a Ref target, a factory) stands for (NOTE [files are data]).
    Raises ScheduleError naming `where` and the name when it is not exported, registered or trusted."""
    mod_name, qual = _split(target, "callable", where)
    if target in _REGISTERED:
        return _REGISTERED[target]
    if target in FILE_EXPORTS:
        return _exported(target)
    if target in trusted:
        return import_by_name(target, where)
    why = "a dunder name is never resolved; " if _has_dunder(mod_name, qual) else ""
    raise ScheduleError(f"{where}: names the callable {target!r}, which is not allowed: {why}{_HOW}")


def resolve_class(target: Any, *, where: str, trusted: Collection[str] = ()) -> type:
    """The class a file names (``replace_all``'s module_type, ``trace``'s leaves): exported, registered or
    trusted, else an ``nn.Module`` subclass defined under exactly that ``module:QualName`` by a module already
    imported; never imported, looked up in ``__dict__``s only. Raises ScheduleError naming `where` and the
    name otherwise."""
    mod_name, qual = _split(target, "type", where)
    load_registrations()  # treadle's own modules imported, as `import treadle` once imported them all
    if target in _REGISTERED or target in FILE_EXPORTS or target in trusted:
        obj = resolve_callable(target, where=where, trusted=trusted)
    else:
        obj = None if _has_dunder(mod_name, qual) else sys.modules.get(mod_name)
        for i, part in enumerate(qual.split(".")):
            if obj is None or (i and not isinstance(obj, type)):  # only classes nest classes
                obj = None
                break
            obj = _own_dict(obj).get(part)
        if not (isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == mod_name
                and obj.__qualname__ == qual):
            raise ScheduleError(
                f"{where}: names the type (not a class of an imported module) {target!r}, which is not allowed: "
                f"a file may name a class only as 'module:QualName' of an nn.Module subclass that an already "
                f"imported module defines (import it first), or one your code registered with "
                f"treadle.register_ref (NOTE [files are data])")
    if not isinstance(obj, type):
        raise ScheduleError(f"{where}: {target!r} is not a class")
    return obj


def check_call(obj: Any, args: tuple = (), kwargs: dict | None = None, *, name: str, where: str,
               partial: bool = False) -> None:
    """Raise ScheduleError unless ``obj(*args, **kwargs)`` binds to `obj`'s signature (checked, not called);
    `partial`: other arguments may follow (`inspect.Signature.bind_partial`)."""
    if not callable(obj):
        raise ScheduleError(f"{where}: {name} is not callable")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing to check here
    try:
        (sig.bind_partial if partial else sig.bind)(*args, **(kwargs or {}))
    except TypeError as exc:
        raise ScheduleError(f"{where}: {name} cannot be called with {len(args)} positional argument(s) and "
                            f"keywords {sorted(kwargs or {})}: {exc}; its signature is {name}{sig}") from None


def parse_json(text: Any, *, source: str, error: type[TreadleError] = ScheduleError, unparsable: str = "") -> Any:
    """`json.loads` of a file's text, as data: an `error` (ScheduleError by default) naming `source` for text
    that does not parse (``<source> does not parse: ...``, or ``<source><unparsable> (...)``), an integer
    too long to convert, or nesting deeper than `MAX_JSON_DEPTH`."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise error(f"{source}: expected JSON text, got {type(text).__name__}")
    try:
        doc = json.loads(text)
    except RecursionError:
        raise error(f"{source}: JSON nested too deeply (more than {MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:  # JSONDecodeError, and an integer of more digits than Python converts
        raise error(f"{source}{unparsable} ({exc})" if unparsable else f"{source} does not parse: {exc}") from None
    depth = json_depth(doc)
    if depth > MAX_JSON_DEPTH:
        raise error(f"{source}: JSON nested {depth} levels deep; a treadle file has at most {MAX_JSON_DEPTH}")
    return doc


def json_depth(doc: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), without recursion; stops counting past MAX_JSON_DEPTH."""
    deepest, stack = 0, [(doc, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            d += 1
            deepest = max(deepest, d)
            if d > MAX_JSON_DEPTH:
                return d
            stack.extend((x, d) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


__all__ = ["FILE_EXPORTS", "resolve_callable", "resolve_class", "check_call", "parse_json", "register", "registered"]
