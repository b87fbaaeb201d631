"""Materialising a model built on the meta device: per module, seeded by its path, so every mesh (and the
single-process reference) gets the same global tensors."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection

import torch
from torch import nn

from ..errors import BuildError


def stable_seed(text: str) -> int:
    """A seed from a string that is the same in every process (unlike `hash`)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def materialize(model: nn.Module, init_fn: Callable[[nn.Module], None] | None, device: torch.device | str,
                *, on_new: Callable[[nn.Parameter, nn.Parameter], None] | None = None,
                keep_meta: Collection[str] = (),
                local: Callable[[nn.Parameter, torch.Tensor], torch.Tensor] | None = None) -> set[str]:
    """Give the meta parameters of `model` real values, in place: per module (in `named_modules` order),
    full-size and seeded by the module's path, initialised by `init_fn`, else the model's ``_init_weights``,
    else the module's ``reset_parameters``. The same global tensors come out for every mesh (build slices
    them) and in a single process (verify's reference). Tied parameters stay one object; `on_new(old, new)` is
    told of every replaced parameter. Raises BuildError for meta buffers or a module with no way to initialise.

    `keep_meta`: paths of modules whose parameters this process does not compute with now (a pipeline's other
    stages; the modules outside an FSDP2 unit about to be sharded): they stay on the meta device, unless a
    parameter that is materialised depends on them (NOTE [what stays on meta]). Returns the paths kept.
    `local(meta, full)`: the tensor a parameter keeps of its whole value (a meta parameter already sliced to its
    shard's shape, with its ``global_shape``, keeps that shard); applied to each parameter as soon as the last module
    whose init writes it has run, so only one module's whole tensors are held at a time. The new parameter keeps
    the meta one's public attributes (``global_shape``, annotations)."""
    init = init_fn
    if init is None:
        hf = getattr(model, "_init_weights", None)
        init = hf if callable(hf) else None
    done: set[int] = set()
    owners = _owners(model)
    kept, writers = _kept(model, set(keep_meta))
    last = {pid: [w for w in ws if w not in kept][-1] for pid, ws in writers.items() if any(w not in kept for w in ws)}
    whole: dict[int, nn.Parameter] = {}  # id(whole-size parameter) -> the meta one it replaces, until sliced
    for path, m in model.named_modules():
        metas = {n: p for n, p in m._parameters.items() if p is not None and p.is_meta and id(p) not in done}
        meta_bufs = [n for n, b in m._buffers.items() if b is not None and b.is_meta]
        if meta_bufs and path not in kept:
            raise BuildError(f"build: buffers {meta_bufs} of {path!r} are on the meta device; treadle can only "
                             f"materialise parameters (create buffers on a real device)")
        if not metas or path in kept:
            continue
        for n, p in metas.items():
            shape = tuple(getattr(p, "global_shape", p.shape))
            m._parameters[n] = nn.Parameter(torch.empty(shape, dtype=p.dtype, device=device),
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
            full = m._parameters[n]
            owners[id(full)] = _repoint(owners.pop(id(p), []), full)  # every alias (tied parameters)
            whole[id(full)] = p
            done.add(id(full))
        for q in list(m._parameters.values()):  # the parameters whose last writer this module was
            meta = whole.get(id(q)) if q is not None else None
            if meta is None or last.get(id(meta)) != path:
                continue
            new = q
            if local is not None and tuple(meta.shape) != tuple(q.shape):
                new = nn.Parameter(local(meta, q.detach()).clone().contiguous(), requires_grad=q.requires_grad)
            new.__dict__.update({k: v for k, v in meta.__dict__.items() if not k.startswith("_")})
            owners[id(new)] = _repoint(owners.pop(id(q), []), new)
            del whole[id(q)]
            done.add(id(new))
            if on_new is not None:
                on_new(meta, new)
    return kept


def _repoint(holders: list[tuple[nn.Module, str, str]], new: nn.Parameter) -> list[tuple[nn.Module, str, str]]:
    """Make every holder of a parameter hold `new` instead; returns the holders (now `new`'s)."""
    for mm, name, _ in holders:
        mm._parameters[name] = new
    return holders


# NOTE [late materialisation]: a model made on the meta device (`treadle.run --init meta`) gets its values as late as
# each part allows, so a rank never holds more of the whole model than one module (under FSDP2 one unit) beyond its
# own shards. The build runs on meta up to the wrappers: the pipeline's capture names the modules of other ranks'
# stages, which stay on meta (NOTE [pipeline on meta]); `slice_params` cuts each meta parameter to its shard's shape.
# Then each module gets its seeded whole value and keeps its shard of it at once (`materialize`'s `local`, NOTE [what
# stays on meta]): FSDP2 materialises each unit just before `fully_shard` takes it (so a unit's whole tensors live
# only until they are sharded), DDP and a pipeline's unsharded stages before they are wrapped, the rest after the
# wrappers. A step that reads values before slicing (float8's conversion) materialises first. The values are those of
# a whole materialisation, sliced: the same for every mesh and for verify's reference.

# NOTE [what stays on meta]: a module's init (`init_fn`, ``_init_weights``, ``reset_parameters``) runs once, on the
# first module (in `named_modules` order) that holds a meta parameter not yet initialised, seeded by that module's
# path, and it may write every parameter the module holds, a tied one initialised earlier included. A parameter's
# value is therefore the work of every module that holds it and runs an init (its writers), in order. Leaving some
# modules on meta keeps every materialised value exact only when each writer of a materialised parameter runs: the
# kept set is shrunk until no module that runs holds a parameter whose writer is kept (a head tied to a kept
# embedding brings the embedding back). Each module's init reads its own seed, so the modules that run give the
# same tensors as when all run, whichever part of the model runs first; a parameter is cut to its shard only after
# its last writer (so a later init never writes a shard). Assumed, as by any per-module init: a module's init
# writes only the parameters it holds itself.
def _kept(model: nn.Module, keep: set[str]) -> tuple[set[str], dict[int, list[str]]]:
    """The modules of `keep` that can stay on meta (NOTE [what stays on meta]), and the writers (module paths,
    in order) of each meta parameter, by id."""
    mods = list(model.named_modules())
    first: dict[int, str] = {}  # id(param) -> the module that initialises it
    for path, m in mods:
        for p in m._parameters.values():
            if p is not None and p.is_meta:
                first.setdefault(id(p), path)
    initialises = set(first.values())
    writers: dict[int, list[str]] = {}
    for path, m in mods:
        if path in initialises:
            for p in m._parameters.values():
                if p is not None and p.is_meta:
                    writers.setdefault(id(p), []).append(path)
    kept = {path for path, _ in mods if path in keep}
    changed = bool(kept)
    while changed:
        changed = False
        for path, m in mods:
            if path in kept or not m._parameters:
                continue
            for p in m._parameters.values():
                back = [w for w in writers.get(id(p), []) if w in kept] if p is not None else []
                if back:
                    kept.difference_update(back)
                    changed = True
    return kept, writers


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    out: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        for name, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((m, name, path))
    return out
