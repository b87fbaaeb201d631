"""Sequence parallelism (Megatron-LM's, Korthikanti et al. 2022) as one parallel form: inside the repeated blocks,
the activations between the tensor-parallel regions are split over the sequence (or batch) on a tensor axis —
norms, dropout and residual adds work on the shard — with a reduce-scatter where a row-parallel output leaves its
module and a gather (whose backward reduce-scatters) where a column-parallel module reads.

- `steps.py`    the recipe steps that state it (`split_input`, `gather_input`, `sharded_norms`, ...);
- `layouts.py`  the planner's extra layouts and their conversion (NOTE [sequence parallel]);
- `gather.py`   gathers with a reduce-scatter backward: candidates, MILP rows, credit (NOTE [gather with a
                reduce-scatter backward]);
- `decide.py`   the syncs that state the chosen layouts.
The runtime needs nothing of its own: the syncs and `reduce_grads` it records are the language's.
"""

from __future__ import annotations

from ...form import Form
from . import decide as _decide
from . import gather as _gather
from . import layouts as _layouts


class SequenceParallelForm(Form):
    """The faces of sequence parallelism (each delegates to the module that holds it)."""

    name = "sequence"

    def keep_strategy(self, b, n, spec, combo):
        return not _layouts.fixed_row_view(b, n, combo)

    def extra_publishes(self, b, n, raw, exitable):
        return _layouts.extra_publishes(b, n, raw, exitable)

    def conversion(self, b, i, raw, pub):
        return _layouts.conversion(b, i, raw, pub)

    def graph_terms(self, b, cg):
        found = _gather.find_sp_gathers(b, cg)
        if found:
            cg.form_terms["sequence"] = found

    def ilp_rows(self, m, cg, s, shared):
        _gather.ilp_rows(m, cg, s, shared)

    def evaluate(self, cg, choice, acc):
        _gather.evaluate(cg, choice, acc)

    def decide_node(self, ctx, i, n, combo, raw, pub):
        return _decide.decide_node(ctx, i, n, combo, raw, pub)

    def adjust_rows(self, cg, choice, rows, shared):
        _gather.adjust_rows(cg, choice, rows, shared)


FORM = SequenceParallelForm()
BUILD_STEPS: dict = {}
