"""What `replace(new, match)` carries from the leaves it removes onto what replaces them.

A matched leaf call that the rewrite erases takes its recorded primitives and hooks with it unless they are
moved. Each is moved only where its meaning is kept, else the rewrite is a ScheduleError naming the leaf, the
primitive and why (nothing is changed):

* the replacement module owns the leaf module itself: everything recorded on the leaf (and under it) moves
  to the leaf's path in the model afterwards (its old one when the graph still reads its parameters); its
  hooks are on the object and travel with it;
* a sharded parameter of the leaf: kept when the replacement owns that very parameter, moved to the
  replacement's parameter of the same name (the leaf's name in the traced module, e.g. ``fc1.weight``) when
  it has the same shape; that parameter then takes the leaf's over (graph reads of it go to the new one);
* ``fwd_pre`` / ``bwd_post`` syncs and forward pre-hooks: moved to the replacement's input when the leaf's
  input is a match input that no other matched op reads;
* ``fwd_post`` / ``bwd_pre`` syncs and forward hooks: moved to the replacement's output when the leaf's
  output is a match output that no other matched op reads (a forward hook also needs the leaf's input);
* checkpoint, fork_rng, reduce_grads, backward hooks, hooks with keyword arguments: only with the module.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.fx as fx
from torch import nn

from ..errors import ScheduleError

if TYPE_CHECKING:
    from .core import Schedule


@dataclass
class Carry:
    """The moves `plan_carry` found; `apply` performs them once the replacement is installed."""

    moved_paths: dict[str, nn.Module] = field(default_factory=dict)  # leaf full path -> the leaf, now owned
    syncs: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)  # (SyncSpec, changes, path set by apply)
    shards: list[tuple[int, nn.Parameter]] = field(default_factory=list)  # (id of old param, new param)
    takeover: set[str] = field(default_factory=set)  # leaf parameters (graph targets) the replacement takes over
    pre_hooks: dict[str, tuple[nn.Module, list]] = field(default_factory=dict)  # match input -> (leaf, hooks)
    post_hooks: dict[int, tuple[nn.Module, list, str]] = field(default_factory=dict)  # out -> (leaf, hooks, input)

    def apply(self, sch: "Schedule", new_path: str) -> None:
        st = sch._state
        for s, changes in self.syncs:
            i = next(j for j, t in enumerate(st.syncs) if t is s)
            st.syncs[i] = dataclasses.replace(s, path=new_path, **changes)
        for old, leaf in self.moved_paths.items():
            # the leaf's path in the model now: the first one (build's), which may still be the old path when
            # the graph reads its parameters too
            dst = next(p for p, mod in st.model.named_modules() if mod is leaf)

            def mv(p: str) -> str:
                return dst + p[len(old):] if p == old or p.startswith(old + ".") else p

            st.syncs = [dataclasses.replace(s, path=mv(s.path)) for s in st.syncs]
            st.checkpoints = [mv(p) for p in st.checkpoints]
            st.fork_rngs = [(mv(p), ax) for p, ax in st.fork_rngs]
            st.reduce_grads = [(mv(p), ax, names) for p, ax, names in st.reduce_grads]
        live = {id(p) for p in st.model.parameters()}
        for old_id, new_p in self.shards:
            st.param_shards[id(new_p)] = list(st.param_shards[old_id])
            if old_id not in live:
                st.param_shards.pop(old_id)


def _leaf_output_of(o: fx.Node, n: fx.Node) -> bool:
    """`o` is the (first tensor) output of leaf call `n`: the call itself, or item 0 of its tensor leaves."""
    if o is n:
        return True
    if o.op == "call_function" and o.target is operator.getitem and o.args[1] == 0:
        tl = o.args[0]
        return (isinstance(tl, fx.Node) and tl.op == "call_function" and getattr(tl.target, "__name__", "") ==
                "_tensor_leaves" and tl.args[0] is n)
    return False


def _erased(m: Any) -> set[fx.Node]:
    """Matched ops the rewrite erases: all but the shared ones and what they read."""
    keep: set[fx.Node] = set()
    stack = list(m.shared)
    inside = set(m.nodes)
    while stack:
        n = stack.pop()
        if n in keep:
            continue
        keep.add(n)
        stack.extend(i for i in n.all_input_nodes if i in inside)
    return inside - keep


def plan_carry(sch: "Schedule", gm: fx.GraphModule, m: Any, path: str, new: Any) -> Carry:
    """Find where every primitive and hook of each erased leaf goes (see the module docstring). Raises
    ScheduleError naming the leaf path, the primitive and the reason when one cannot be carried."""
    st = sch._state
    carry = Carry()
    inside = set(m.nodes)
    erased = _erased(m)
    is_module = isinstance(new, nn.Module)
    input_of = {v: k for k, v in m.inputs.items() if isinstance(v, fx.Node)}
    for n in m.nodes:
        if n.op != "call_module" or n not in erased:
            continue
        leaf = gm.get_submodule(n.target)
        full = f"{path}.{n.target}" if path else n.target

        def refuse(what: str, why: str) -> None:
            raise ScheduleError(f"replace_match at {sch._where()}: leaf {full!r} has {what}, which the replacement "
                                f"cannot carry: {why}; record it on the replacement instead, or match a region "
                                f"without that leaf")

        owned = [q for q, sub in new.named_modules() if sub is leaf] if is_module else []
        if owned:
            carry.moved_paths[full] = leaf
            continue
        # the leaf's input: a match input that only this leaf reads
        x = n.args[0] if len(n.args) == 1 and not n.kwargs and isinstance(n.args[0], fx.Node) else None
        in_name = input_of.get(x) if x is not None else None
        only_reader = in_name is not None and [u for u in x.users if u in inside] == [n]
        outs = [i for i, o in enumerate(m.outputs) if _leaf_output_of(o, n)]
        out_i = outs[0] if outs else None
        out_node = m.outputs[out_i] if out_i is not None else None
        out_alone = out_node is not None and not [u for u in out_node.users if u in inside]
        if out_node is not None and out_node is not n:  # read through _tensor_leaves: only item 0 may be read
            out_alone = out_alone and all(u is out_node for u in out_node.args[0].users)
        first_arg = next(iter(inspect.signature(leaf.forward).parameters), None)
        for s in st.syncs:
            if not (s.path == full or s.path.startswith(full + ".")):
                continue
            what = f"sync {s.mode}" + (f" op={s.op!r}" if s.op else "")
            if s.path != full:
                refuse(what + f" on {s.path!r}", "the replacement does not own the leaf module")
            if not is_module:
                refuse(what, "a function replacement has no module boundary to hold a sync")
            if s.mode in ("fwd_pre", "bwd_post"):
                if s.arg not in (0, first_arg):
                    refuse(what + f" on input {s.arg!r}", "only the leaf's first input maps onto a match input")
                if not only_reader:
                    refuse(what, "the leaf's input is not a match input read by this leaf alone")
                carry.syncs.append((s, {"arg": in_name}))
            else:
                if s.out != 0 or not out_alone:
                    refuse(what, "the leaf's output is not a match output read by nothing else in the match")
                carry.syncs.append((s, {"out": out_i if len(m.outputs) > 1 else 0}))
        for p, _, _ in st.reduce_grads:
            if p == full or p.startswith(full + "."):
                refuse("reduce_grads", "the replacement does not own the leaf module")
        for p in st.checkpoints:
            if p == full or p.startswith(full + "."):
                refuse("checkpoint", "the replacement does not own the leaf module")
        for p, _ in st.fork_rngs:
            if p == full or p.startswith(full + "."):
                refuse("fork_rng", "the replacement does not own the leaf module")
        for pn, prm in leaf.named_parameters():
            if id(prm) not in st.param_shards:
                continue
            if is_module and any(q is prm for q in new.parameters()):
                continue  # the replacement owns the very parameter: its shard travels with it
            target = f"{n.target}.{pn}"
            try:
                new_p = new.get_parameter(target) if is_module else None
            except AttributeError:
                new_p = None
            if new_p is None or new_p.shape != prm.shape:
                refuse(f"shard {pn}", f"the replacement owns neither that parameter nor one named {target!r} of "
                       f"shape {tuple(prm.shape)}" + (f" (it has {tuple(new_p.shape)})" if new_p is not None else ""))
            if id(new_p) in st.param_shards:
                refuse(f"shard {pn}", f"the replacement's {target!r} is sharded already")
            carry.shards.append((id(prm), new_p))
            carry.takeover.add(target)
        for attr in ("_backward_hooks", "_backward_pre_hooks"):
            if getattr(leaf, attr, None):
                refuse("backward hooks", "the leaf's gradients are not the replacement's")
        for attr in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            if getattr(leaf, attr, None):
                refuse("hooks registered with_kwargs=True or always_call=True", "they read the leaf's own call")
        if leaf._forward_pre_hooks:
            if not only_reader:
                refuse("forward pre-hooks", "the leaf's input is not a match input read by this leaf alone")
            carry.pre_hooks[in_name] = (leaf, list(leaf._forward_pre_hooks.values()))
        if leaf._forward_hooks:
            if not out_alone or in_name is None:
                refuse("forward hooks", "the leaf's output is not a match output read by nothing else in the "
                       "match, or its input is not a match input")
            carry.post_hooks[out_i] = (leaf, list(leaf._forward_hooks.values()), in_name)
    return carry
