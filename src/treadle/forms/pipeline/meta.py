"""A pipeline built from a model made on the meta device: its capture runs on fake parameters, and each rank
materialises only the modules its own stages run (NOTE [pipeline on meta])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .conflicts import stage_rank

# NOTE [pipeline on meta]: a model made with its parameters on the meta device (`treadle.run --init meta`) is
# materialised by build with a seeded init per module (NOTE [what stays on meta] in treadle.runtime.materialize). A
# pipeline's rank runs only its own stages, so it materialises only their modules. The capture's eager run (the
# leaves' output shapes, the arguments they are handed as None, NOTE [eager None arguments] and [metadata-only
# inputs]) runs on the real micro-batch with zeros standing for each leaf's parameters while it runs (one leaf's worth
# of memory at a time); fake tensors would not do: Hugging Face's mask code takes a fake tensor for a trace and builds
# the explicit mask the eager run does not. The captured graph is split before materialisation to find which modules
# this rank's stages and the loss call. The others stay on meta: their parameters hold no memory, and are never read
# (the stage runner holds the local stages only). A module on the path from the root to the cut container (its forward
# is the captured glue) is always materialised, as is every module a materialised parameter depends on (a tied head's
# embedding). The materialised values are those of a whole materialisation: each module's init reads its own seed.


@contextlib.contextmanager
def standin_parameters(model: nn.Module, leaves: list[str], device: torch.device) -> Iterator[bool]:
    """Inside: `model` runs eagerly though its parameters are on meta (NOTE [pipeline on meta]): each leaf's meta
    parameters are zeros on `device` while the leaf runs (a forward pre-hook puts them in, a forward hook puts the
    meta ones back), and those of the modules outside every leaf for the whole run. Yields whether any parameter
    is on meta (when none, nothing is changed). Restored on exit."""
    if not any(p.is_meta for p in model.parameters()):
        yield False
        return

    def held(mod: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
        return [(m, n, p) for m in mod.modules() for n, p in m._parameters.items() if p is not None and p.is_meta]

    def put(items) -> None:
        for m, n, p in items:
            m._parameters[n] = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device),
                                            requires_grad=p.requires_grad)

    def back(items) -> None:
        for m, n, p in items:
            m._parameters[n] = p

    every = held(model)
    inside = {id(m) for path in leaves for m in model.get_submodule(path).modules()}
    glue = [x for x in every if id(x[0]) not in inside]
    handles = []
    for path in leaves:
        leaf = model.get_submodule(path)
        items = held(leaf)
        if items:
            handles.append(leaf.register_forward_pre_hook(lambda mod, args, items=items: put(items)))
            handles.append(leaf.register_forward_hook(lambda mod, args, out, items=items: back(items)))
    put(glue)
    try:
        yield True
    finally:
        for h in handles:
            h.remove()
        back(every)  # a leaf that raised left its zeros in


def modules_not_run(model: nn.Module, split: tuple, *, cuts: list[str], schedule: str, pp: int,
                    rank_pp: int) -> set[str]:
    """Paths of the modules with parameters that neither this rank's stages (pp coordinate `rank_pp`) nor the loss
    call, and that are not on the captured path from the root to the cut container (NOTE [pipeline on meta]).
    `split`: what `stages.split_stages` returns for the captured graph cut at `cuts`."""
    parts = cuts[0].rpartition(".")[0].split(".")
    chain = {".".join(parts[:i]) for i in range(len(parts))}
    stages, loss_gm, _ = split
    graphs = [st.module for st in stages if stage_rank(schedule, st.index, pp) == rank_pp]
    if loss_gm is not None and stage_rank(schedule, len(stages) - 1, pp) == rank_pp:
        graphs.append(loss_gm)
    called = {n.target for g in graphs for n in g.graph.nodes if n.op in ("call_module", "get_attr")}
    keep = set()
    for path, m in model.named_modules():
        if not any(p is not None for p in m._parameters.values()) or path in chain:
            continue
        if not any(path == t or path.startswith(t + ".") or t.startswith(path + ".") for t in called):
            keep.add(path)
    return keep


# NOTE [mesh-bound attributes under a pipeline]: `set_attr` may give a module an object bound to the mesh at build
# (one with ``bind(mesh)``: the vocab-parallel loss, which reduces over the tensor axis). Called inside a block or
# another leaf it runs eagerly, as written. Called by the code the pipeline captures (the forwards from the root
# down to the cut container: the glue between stages and the loss), it is traced into the stage graphs and the
# loss as plain ops on this rank's pieces of the tensors, which is not what it computes (the vocab-parallel loss
# read the head's vocabulary shard as whole logits). The capture's eager run therefore refuses such a call.
@contextlib.contextmanager
def bound_attrs_refused(builder, leaves: list[str]) -> Iterator[None]:
    """Inside (the capture's eager run): a call of a mesh-bound attribute that `set_attr` installed, made outside
    every leaf, raises BuildError naming it (NOTE [mesh-bound attributes under a pipeline])."""
    from ...errors import BuildError

    depth = [0]
    saved = []
    for path, name, _ in builder.v.attrs:  # installed (bound) before this step
        mod = builder.module(path)
        value = getattr(mod, name, None)
        if not callable(value) or not hasattr(value, "bind"):
            continue
        where = ".".join(x for x in (path, name) if x)

        def refuse(*a, value=value, where=where, **k):
            if depth[0] == 0:
                raise BuildError(f"pipeline: {where} is set by set_attr to a {type(value).__name__} bound to the mesh, "
                                 f"and the model's forward calls it outside the blocks: a pipeline traces that code "
                                 f"into its stages and loss, where it would run as plain ops on this rank's pieces "
                                 f"of the tensors (the vocab-parallel loss would read the head's vocabulary shard as "
                                 f"whole logits); keep the model's own {name!r} under a pipeline (for the loss: "
                                 f"gather the head's output, sync('fwd_post', to=Replicate()) on it), or do not "
                                 f"pipeline")
            return value(*a, **k)

        saved.append((mod, name, value))
        setattr(mod, name, refuse)
    handles = []
    for path in leaves if saved else ():
        leaf = builder.model.get_submodule(path)
        handles.append(leaf.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1)))
        handles.append(leaf.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1), always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for mod, name, value in saved:
            setattr(mod, name, value)
