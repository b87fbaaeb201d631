"""Tensor parallelism (Megatron-LM's column / row parallel linears, fused q|k|v blocks, head-parallel attention,
channel-parallel convolutions) as one parallel form.

- `leaf_rules.py`, `conv_rules.py`  how a sharded Linear / Conv1D / Conv2d / BatchNorm2d computes (registered in
                                    the one registry of sharding rules, `treadle.sharding_rules`);
- `plan.py`                         the input-gradient sums it costs (NOTE [shared input-gradient sum]);
- `steps.py`                        the recipe steps that state it (`column`, `row`, `check_heads`).
Its options in the planner are the dimension algebra itself (`treadle.planner.dims`: every op's shardings on the
tensor axes), and the layouts that algebra chooses are stated by the planner's core decisions (shard, the sync
at a module's exit, shard_attr, reduce_grads, fork_rng): tensor parallelism is the form every other one adds to.
"""

from __future__ import annotations

from ...form import Form
from . import conv_rules, leaf_rules  # noqa: F401  (register the leaf rules)
from . import plan as _plan


class TensorParallelForm(Form):
    """The faces of tensor parallelism (each delegates to the module that holds it)."""

    name = "tensor"

    def node_cost(self, b, n, combo, pub, cost, rec):
        _plan.node_cost(b, n, combo, pub, cost, rec)

    def ilp_rows(self, m, cg, s, shared):
        _plan.ilp_rows(m, cg, s, shared)

    def evaluate(self, cg, choice, acc):
        _plan.evaluate(cg, choice, acc)

    def adjust_rows(self, cg, choice, rows, shared):
        _plan.adjust_rows(cg, choice, rows, shared)


FORM = TensorParallelForm()
BUILD_STEPS = {"pre_shard": conv_rules.slice_running_stats}
