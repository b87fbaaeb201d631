"""The vocab-parallel embedding and loss as one parallel form: the input embedding split over the vocab (a masked
lookup, then a reduction), the output head split over the vocab, and a cross-entropy over the split logits whose
three all-reduces carry per-token scalars (Megatron-LM, Shoeybi et al. 2019, section 3).

- `steps.py`   the recipe step that states it (`vocab_parallel`);
- `plan.py`    the planner's candidates, cost and decision (NOTE [vocab-parallel loss]);
- `embedding.py` the Embedding rule (vocab- or feature-sharded) and its masked lookup;
- and `VocabParallelLoss` (`treadle.runtime.losses`, the name schedule files give it).
"""

from __future__ import annotations

from ...form import Form
from . import embedding  # noqa: F401  (registers the Embedding rule)
from . import plan as _plan
from .steps import vocab_parallel


class VocabParallelForm(Form):
    """The faces of the vocab-parallel loss (each delegates to the module that holds it)."""

    name = "vocab"

    def prepare(self, b):
        _plan.prepare(b)

    def keep_strategy(self, b, n, spec, combo):
        return _plan.keep_strategy(b, n, spec, combo)

    def node_cost(self, b, n, combo, pub, cost, rec):
        _plan.node_cost(b, n, combo, pub, cost, rec)

    def graph_terms(self, b, cg):
        _plan.graph_terms(b, cg)

    def decisions(self, cg, choice, ckpt, ctx):
        return _plan.decisions(cg, choice, ckpt, ctx)


FORM = VocabParallelForm()
BUILD_STEPS: dict = {}

__all__ = ["FORM", "vocab_parallel"]
