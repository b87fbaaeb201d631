"""The vocab-parallel loss in the planner: which cross-entropy may keep its logits split over the vocab, what that
costs (three all-reduces of per-token scalars), and the ``set_attr("loss_function", ...)`` decision that states it.

NOTE [vocab-parallel loss]: the logits (N, V) may stay sharded over the vocab on one tensor axis only when the
model's loss is its ``loss_function`` applied to its output embedding (NOTE [loss head] in
`treadle.planner.capture`): the schedule then sets ``loss_function`` to `VocabParallelLoss`, which needs three all-reduces of (N,) fp32
per-row scalars (max, sum of exp, target logit) in forward and none in backward (the gradient is local).
The cross-entropy node is offered that option (`dims.DimSpec.vocab_letters`) only when its logits come from the
head through ops outside every module (the loss function's own ops: cast, view) and its value is the
graph's output; on the other tensor axes it stays replicated (the loss reads whole rows and global labels).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...cost.collective_cost import all_reduce_time_s
from ...placement import R
from ...planner.capture import Node
from ...planner.dims import dim_spec
from ...planner.to_schedule import DECISION_RANKS, Decision

VOCAB_LOSS = "treadle.runtime.losses:VocabParallelLoss"  # the loss class, as schedule files name it
DECISION_RANK = DECISION_RANKS["loss"]


@dataclass(frozen=True, slots=True)
class VocabCE:
    """A cross-entropy node the runtime can run vocab-parallel (NOTE [vocab-parallel loss]): the loss function
    `loss` (causal: labels shifted) of the model's output embedding `head`, replaced by
    `treadle.runtime.losses.VocabParallelLoss` when the node's class letter `letter` is sharded."""

    node: int
    letter: int
    head: str
    causal: bool
    chain: tuple[int, ...] = ()  # the loss function's ops between the head and the cross-entropy (cast, view)


def terms(cg) -> dict[int, VocabCE]:
    """The cross-entropy nodes of a cost graph that may run vocab-parallel (by node)."""
    return cg.form_terms.get("vocab", {})


def find_vocab_ce(b) -> dict[int, VocabCE]:
    """NOTE [vocab-parallel loss]: the cross-entropy nodes whose class dim may stay sharded."""
    head = b.g.loss_head
    if head is None or not b.tp_axes:
        return {}
    out: dict[int, VocabCE] = {}
    for n in b.nodes:
        if n.kind != "op" or n.op_name != "cross_entropy_loss" or n.index not in b.g.outputs:
            continue
        if (_ce_arg(n, 2, "weight", None) is not None or _ce_arg(n, 3, "reduction", 1) != 1
                or _ce_arg(n, 4, "ignore_index", -100) != -100 or _ce_arg(n, 5, "label_smoothing", 0.0) != 0.0):
            continue  # class weights, a sum, another ignore index or smoothing: not what VocabParallelLoss does
        j, chain = n.inputs[0], []
        while b.nodes[j].kind == "op" and b.nodes[j].module == "" and len(b.nodes[j].inputs) == 1:
            chain.append(j)
            j = b.nodes[j].inputs[0]
        if b.nodes[j].kind != "op" or b.nodes[j].module != head.head:
            continue
        spec = dim_spec(n, b.nodes)
        if spec is not None and spec.vocab_letters:
            out[n.index] = VocabCE(n.index, min(spec.vocab_letters), head.head, head.causal, tuple(chain))
    return out


def prepare(b) -> None:
    """Find the candidates (`b.vocab_ce`); the loss function's own ops between the head and the cross-entropy are
    replaced at build with the loss, so their layout needs are not the schedule's (`b.replaced`). None under a
    pipeline: its loss runs as the model's own ops traced on the last stage, so ``loss_function`` would not be
    the loss that runs (build refuses it there, `forms.pipeline.stages.capture_root`)."""
    b.vocab_ce = find_vocab_ce(b) if b.roles.pp is None else {}
    b.replaced |= {j for v in b.vocab_ce.values() for j in v.chain}


def keep_strategy(b, n: Node, spec, combo: tuple) -> bool:
    """A class letter of a cross-entropy is sharded only on a candidate, and then no other letter on any axis."""
    vocab = spec.vocab_letters if spec is not None else set()
    if vocab and any(o.letter in vocab for o in combo) and (n.index not in b.vocab_ce or any(
            o.letter not in vocab and any(p != R for p in o.ins + o.outs) for o in combo)):
        return False
    return True


def node_cost(b, n: Node, combo: tuple, pub: tuple, c, rec: str) -> None:
    """Three all-reduces of (N,) fp32 per-row scalars in forward, none in backward."""
    vce = b.vocab_ce.get(n.index)
    if vce is None:
        return
    rows = b.local_dp_shape(n.inputs[0], b.nodes[n.inputs[0]].out.shape)[0]
    for k, o in enumerate(combo):
        if o.letter == vce.letter:
            t = 3 * all_reduce_time_s(rows * 4, b.tp_sizes[k], b.cluster.link(b.tp_axes[k]))
            c.comm_s += t
            c.fwd_s += t
            if rec == "all":
                c.rec_s += t


def graph_terms(b, cg) -> None:
    if b.vocab_ce:
        cg.form_terms["vocab"] = dict(b.vocab_ce)


def decisions(cg, choice: list[int], ckpt, ctx) -> list:
    """``set_attr("loss_function", Ref(VOCAB_LOSS, axis=..., causal=...))`` where the chosen strategy shards a
    candidate's class letter."""
    found = terms(cg)
    out = []
    for u, unit in enumerate(cg.units):
        for i, (combo, _) in unit.strategies[choice[u]].items():
            vce = found.get(i)
            if vce is None:
                continue
            n = cg.graph.nodes[i]
            for a, o in zip(cg.roles.tp, combo):
                if o.letter == vce.letter:
                    out.append((DECISION_RANK, "", Decision(
                        "set_attr", "", {"name": "loss_function", "ref": VOCAB_LOSS,
                                         "kwargs": {"axis": a, "causal": vce.causal}},
                        f"vocab-parallel cross-entropy {n.name} of {vce.head}")))
    return out


def _ce_arg(n: Node, pos: int, name: str, default):
    return n.args[pos] if len(n.args) > pos else n.kwargs.get(name, default)
