"""Tensor parallelism (Megatron-LM's column / row parallel linears, fused q|k|v blocks, head-parallel attention,
channel-parallel convolutions) as one parallel form.

- `leaf_rules.py`, `conv_rules.py`  how a sharded Linear / Conv1D / Conv2d / BatchNorm2d computes (registered in
                                    the one registry of sharding rules, `treadle.sharding_rules`);
The planner's options for it are the dimension algebra itself (`treadle.planner.dims`): every op's shardings
on the tensor axes.
"""

from __future__ import annotations

from ...form import Form
from . import conv_rules, leaf_rules  # noqa: F401  (register the leaf rules)


class TensorParallelForm(Form):
    """The faces of tensor parallelism."""

    name = "tensor"


FORM = TensorParallelForm()
BUILD_STEPS = {"pre_shard": conv_rules.slice_running_stats}
