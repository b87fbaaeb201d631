"""The pricing layer: `price(sch, example_inputs, cluster)`, the predicted step time, peak memory and MFU of ANY
schedule — one price for every schedule, whoever wrote it. It sits between the runtime (whose model it builds)
and the planner (which asks it, never the reverse).

How (NOTE [pricing by rehearsal]): the schedule is replayed on a copy of its model and built by
`treadle.build` for rank 0 of its mesh on an in-process *fake* process group (collectives return at once,
nothing is sent), so what is priced is exactly what the runtime would run — hand-written primitives
(``sync``, ``shard_attr``, ``set_attr``, ``blocks=3``, the vocab-parallel loss), the Megatron recipes and
planner output alike. One training step of that rank's model then runs on fake tensors under the
profiler's recorder (`treadle.profile.recorder`): every ATen op with its module and phase (forward,
backward, recompute) is priced by the roofline of the rank's device, autograd's saved tensors are
counted by ``saved_tensors_hooks`` (the profiler's figure: one source of truth), and every collective
the built model issues (tensor parallel, sequence parallel, vocab-parallel loss, ``reduce_grads``) is
seen as a ``c10d`` op with its process group (hence its mesh axis) and bytes, priced by the alpha-beta
formulas of `treadle.cost.collective_cost` and placed on the critical path; one issued soon after the
previous blocking collective pays less of its link's measured drift (NOTE [lead-dependent skew]).

Each parallel form adds its part of the step (`treadle.form.Form.price_step`): data parallelism is not run
but priced the way the runtime executes it (`treadle.forms.data`; NOTE [overlap model] in
`treadle.cost.overlap`): DDP reduces gradient buckets (NOTE [DDP buckets]) as soon as their last gradient
is ready, overlapped with the backward still to run; FSDP2 (``data_parallel(shard=True)``: one unit per
entry of every ``nn.ModuleList`` plus the root) all-gathers a unit's parameters one unit ahead in forward
and in backward (prefetch) and reduce-scatters its gradients when its backward ends; the root is gathered
once and not again in backward (FSDP2 keeps the root unsharded after forward); the local copies FSDP2
makes around each collective (2 (full + shard) bytes) are compute where the collective is used; DDP also
broadcasts the buffers every forward (NOTE [DDP buffers]).
Data parallelism over several axes runs on one flattened process group, priced on the slowest link of its
axes (`treadle.cost.links.flat_link`); HSDP all-reduces each reduce-scattered shard over the
replicate axes once its reduce-scatter ends; ``reshard_after_forward=False`` drops the backward gathers
and keeps every unit gathered from forward to backward.

The step ends with the optimizer (AdamW: `treadle.runtime.optimizer.adamw_tensor_s` per parameter tensor and
`adamw_fixed_s`, the same statement the planner charges), after every gradient reduction. Each op also costs the device's fixed `op_overhead_s` (dispatch), and the
framework's host costs are charged where the runtime pays them (NOTE [framework overheads] in
`treadle.profile.hardware`): a recomputed op `checkpoint_op_s` and a checkpointed region
`checkpoint_region_s`; an FSDP2 unit ``fsdp_unit_s + n_params * fsdp_param_s`` per step (half at its
forward, half at its backward); the optimizer's ops ``10 n_tensors`` (per-tensor loop, CPU) or
``12 + 2 n_tensors`` (foreach, GPU) times `op_overhead_s`, plus `subclass_op_overhead_s` per op (loop) or per
list op (foreach) on FSDP2's DTensor parameters.

For a GPU device attention with dropout is rehearsed as the fused kernel a GPU runs (NOTE [attention as a GPU
runs it] in `treadle.profile.fused_attention`); a CPU device keeps PyTorch's CPU kernels.
Data-dependent scalars (``.item()``) read as 1 on fake tensors: pricing needs shapes, not values.
A pipeline (``pipeline``) is priced by the pipeline form (`Form.price_schedule`; NOTE [pipeline price] in
`treadle.forms.pipeline.price`): its stages from one rehearsed micro-batch, laid out in the schedule's own
action order. `price` cannot run inside a launched process group
(it needs its own fake one): call it before ``init_process_group`` or in another process.
"""

from .rehearsal import Rehearsal, rehearse
from .result import Estimate, Price, PriceRow
from .step import StepContext, price

__all__ = ["price", "Price", "PriceRow", "Estimate", "Rehearsal", "StepContext", "rehearse"]
