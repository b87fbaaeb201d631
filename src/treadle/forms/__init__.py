"""The parallel forms, each one package, registered here — the one place — in the order every core layer calls them.

    tensor      tensor parallelism (column / row / fused blocks / heads / channels)
    sequence    sequence parallelism (row shards between the tensor-parallel regions)
    vocab       the vocab-parallel embedding and loss
    data        data parallelism (DDP / ZeRO-3 / HSDP)
    pipeline    pipeline parallelism (stages over a pp axis; its price owns the step's timeline)
    expert      expert parallelism (a mixture-of-experts layer's experts over a data-parallel axis)
    float8      float8 training of linear layers (not a parallel form: it changes what each rank computes and
                what FSDP2 gathers)

How to add a form: `docs/architecture.md`.
"""

from __future__ import annotations

from ..form import register_form
from ..runtime import graph_steps as _graph_steps  # noqa: F401  (the graph-level build steps come first)
from ..runtime.steps import register_build_extension
from . import data, expert, float8, pipeline, sequence, tensor, vocab

for _form in (tensor, sequence, vocab, data, pipeline, expert, float8):
    register_form(_form.FORM)
# build steps in the order build runs them: float8 swaps its linears first (it refuses a pipeline before the
# capture starts); then the pipeline: its capture runs the blocks on global shapes before any form slices a buffer
# ("pre_shard"), and it wraps each of its stages under the data parallelism itself before the data-parallel form
# would wrap the whole model (the first "wrap" that returns a model wins)
for _form in (float8, pipeline, tensor, sequence, vocab, data, expert):
    for _phase, _step in _form.BUILD_STEPS.items():
        register_build_extension(_phase, _step)
