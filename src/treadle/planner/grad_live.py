"""What a node's backward holds beside the saved activations, and which of its tensors each saved or held byte is
shaped like: measured in the capture's run (`saved.measure_by_node`), divided per strategy by the cost graph.

NOTE [a backward's working set]: while a node's backward runs, the device holds every saved activation not yet
freed plus the gradients in flight: the gradient of its output, those it makes of its inputs, and the
intermediates of its backward formula. For most nodes that is a few hidden-sized tensors. For the loss on a large
vocabulary it is not: a cross entropy over fp32 logits holds the gradient of its log-softmax and that of the
logits at once, two fp32 logits-sized tensors (Llama-3-8B, 8192 tokens a rank: 7.8 GiB), at the start of the
backward, when every activation is still saved. The price's rehearsal sees it (its transient); the planner's
MILP charged it nothing, so a pipeline's last stage came out 7.9 GiB under its price (llama-3-8b, 2 x 8 H100:
13.6 GiB against 21.5).

Measured on the capture's fake run: every storage the backward makes is logged with the node whose autograd
functions made it (`saved._Run.bwd_current`) and logged again when it dies (a weak reference); views of the
forward's, the parameters' and the inputs' storages are no allocation. The gradients of parameters are static memory
(the cost graph counts them there) and leave the log: a tensor hook marks the gradient before accumulation, a
post-accumulate hook what `.grad` holds, and drops it. Replayed after the backward, each node's working set is the
most the live storages exceeded the saved activations freed so far while it ran (`BackwardLive.peaks`), split by
which of the node's tensors each storage is shaped like (`slot`: its output, else an input of the same element
count, else its output), so that the cost graph divides each part by that tensor's shards under a strategy
(`node_costs.split_bytes`). The saved bytes are split the same way: a composite node's saved intermediate (the
log-softmax a cross entropy keeps) is shaped like its input, and a vocabulary-parallel loss keeps 1/tp of it, where
dividing by the (scalar) output's shards kept all of it.

The MILP adds the largest working set of a rank's units to its transient (beside the recomputed block's: they
come at different moments of the backward, so the larger of them, `ilp.memory_expression` and the pipeline's
`milp._solve_cut`); `step_eval.evaluate` and the pipeline's `evaluate` take the same maximum.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

OUT = None  # the slot of a part shaped like the node's output


def shapes_of(n: torch.fx.Node, env: dict, out: Any) -> tuple[tuple[int, ...], tuple[tuple[str, int], ...]]:
    """(element counts of node `n`'s tensor outputs, (input node name, element count) of its tensor inputs)."""
    outs = tuple(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    ins = tuple((a.name, env[a].numel()) for a in n.all_input_nodes if isinstance(env.get(a), torch.Tensor))
    return outs, ins


def slot(shapes: tuple | None, numel: int) -> str | None:
    """The tensor of a node a storage of `numel` elements is shaped like: OUT, or an input's node name."""
    if shapes is None or numel in shapes[0]:
        return OUT
    return next((name for name, k in shapes[1] if k == numel), OUT)


class BackwardLive:
    """The log of NOTE [a backward's working set]: storages the backward makes, by the node running, and their
    deaths."""

    def __init__(self) -> None:
        self.log: list[tuple] = []  # ("a", key, nbytes, numel, node) | ("f", key)
        self.refs: dict[int, weakref.ref] = {}
        self.grad_events: set[int] = set()  # allocations (log positions) of parameters' gradients
        self.last: dict[int, int] = {}  # storage id -> the log position of its latest allocation

    def made(self, out: Any, node: str | None, *seen: Any) -> None:
        """Log the storages `out` holds that are new (not in any of `seen`: the forward's, the parameters' and
        inputs'; a view of a weight is no allocation)."""
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = id(st)
            if key in self.refs or any(key in x for x in seen) or not st.nbytes():
                continue
            self.refs[key] = weakref.ref(st, lambda _r, k=key: self._free(k))
            self.last[key] = len(self.log)
            self.log.append(("a", key, st.nbytes(), st.nbytes() // max(1, t.element_size()), node))

    def _free(self, key: int) -> None:
        if self.refs.pop(key, None) is not None:
            self.log.append(("f", key))

    def incoming(self, grad: torch.Tensor) -> None:
        """A parameter's tensor hook: the gradient about to be accumulated is static memory, not working set."""
        self._not_working(grad)

    def hook(self, p: torch.Tensor) -> None:
        """A post-accumulate-grad hook: what `.grad` holds (the incoming gradient, or a copy accumulation made) is
        static memory; dropped, so it dies."""
        if p.grad is not None:
            self._not_working(p.grad)
            p.grad = None

    def _not_working(self, t: torch.Tensor) -> None:
        i = self.last.get(id(t.untyped_storage()))  # its allocation: the latest logged with that id
        if i is not None:
            self.grad_events.add(i)

    def peaks(self, shapes: dict[str, tuple], order: dict[str, int], packed: list[tuple]
              ) -> dict[str, dict[str | None, int]]:
        """Per node, the most the live storages exceeded the saved activations freed so far while its backward
        ran, by slot. A saved storage counts as freed once the backward has reached a node before the first node
        that saved it (`packed`: (producer, bytes, elements, first packer's place in `order`)): the backward runs
        the forward's nodes about in reverse, and a saved tensor dies with the earliest function holding it."""
        live: dict[int, tuple[int, int]] = {}
        total = freed = 0
        best: dict[str, float] = {}
        out: dict[str, dict[str | None, int]] = {}
        frees = sorted(((p[3], p[1]) for p in packed), reverse=True)  # by first packer, latest first
        i, lo = 0, len(order)
        for pos, ev in enumerate(self.log):
            if ev[0] == "f":
                if ev[1] in live:
                    total -= live.pop(ev[1])[0]
                continue
            _, key, nbytes, numel, node = ev
            if node is None or pos in self.grad_events:  # a parameter's gradient
                continue
            live[key] = (nbytes, numel)
            total += nbytes
            lo = min(lo, order.get(node, lo))
            while i < len(frees) and frees[i][0] > lo:
                freed += frees[i][1]
                i += 1
            if total - freed > best.get(node, 0):
                best[node] = total - freed
                parts: dict[str | None, float] = {}
                for b, k in live.values():  # scaled to the excess, each part in proportion
                    s = slot(shapes.get(node), k)
                    parts[s] = parts.get(s, 0) + b * (total - freed) / total
                out[node] = {s: int(b) for s, b in parts.items()}
        return out


def by_index(parts: dict[str, dict[str | None, int]] | None, index_of: dict[str, int]
             ) -> dict[int, dict[int, int]] | None:
    """`parts` keyed by captured node index, each part by its input's node index (-1: the output)."""
    if parts is None:
        return None
    got: dict[int, dict[int, int]] = {}
    for name, d in parts.items():
        if name in index_of:
            mine = got.setdefault(index_of[name], {})
            for s, b in d.items():
                j = index_of.get(s, -1) if s is not None else -1
                mine[j] = mine.get(j, 0) + b
    return got


def working_terms(cg) -> list[tuple[int, list[float]]]:
    """(unit, per-strategy working-set bytes) of the units of `cg` whose backward holds anything beside the saved
    activations (NOTE [a backward's working set]); the MILP states its transient >= each."""
    got = [(u, [c.work_bytes for c in unit.costs]) for u, unit in enumerate(cg.units)]
    return [(u, w) for u, w in got if any(w)]


def working_of(cg, choice: list[int], units=None) -> float:
    """The largest working set of the chosen strategies (of `units`, default all): `working_terms`, evaluated."""
    us = range(len(cg.units)) if units is None else units
    return max((cg.units[u].costs[choice[u]].work_bytes for u in us), default=0.0)
