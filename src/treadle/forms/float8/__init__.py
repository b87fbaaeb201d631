"""Float8 training — a module's linear layers with float8 matrix products (torchao's float8 training) — as one
form. It parallelises nothing: it changes what each rank computes and what FSDP2 moves, and it plugs into build,
the price and verify through the same faces as the parallel forms.

How a user states it: ``sch["model.layers"].float8(recipe="tensorwise", all_gather=True)``, a primitive of the
language (`treadle.schedule.float8_primitive` checks and records it: the recipe is a name, NOTE [float8 recipes]).
Everything else is here:

- `runtime.py`  the "pre_shard" build step: each recorded linear becomes torchao's `Float8Linear` (native on CUDA
                sm_89+, emulated elsewhere), before FSDP2 wraps it; refused with a pipeline;
- `tensor_parallel.py`  the leaf rule of a float8 linear whose weight a tensor axis splits: each operand cast with
                its amax over the split axes, and the scales of such weights FSDP2 gathers in float8 (the
                "post_hooks" step; NOTE [float8 under tensor parallelism]; tensorwise only);
- the price: the rehearsed step runs the float8 linears, so their casts and scale reductions are recorded as the
                ops they are, and each product whose operands hold float8 data is charged at the device's float8
                peak on the float8 bytes (NOTE [float8 in the price] in `treadle.profile.recorder`); FSDP2
                gathers an `all_gather=True` weight at one byte an element (`gather_itemsize`);
- verify: the reference is the original converted the same way, emulated (NOTE [what verified means for
                float8], below);
- `plan.py`     the planner's role `Roles.float8` (NOTE [execution and float8 in the plan]): the blocks' linears,
                replicated over tensor axes under it, and the `float8` decision; the price weighs it.

NOTE [what verified means for float8]: float8 is not bit-exact against the model as written, so `verify` checks
two things apart. (1) Distribution: the distributed float8 model against the single-process float8 model (the
original with the same linears converted, emulated on the CPU) at the dtype's usual tolerance for the forward and
every gradient of the first step; after an optimizer step a weight whose value moved by a rounding difference can
round to the neighbouring float8 value, so the later steps' checks allow one float8 (e4m3) rounding step,
`FLOAT8_STEP_RTOL`. Under tensor parallelism that allowance holds from the first forward (unless the caller gives
its own tolerance): a row-parallel leaf sums its partial products in another order than one process, and a later
cast may round an element of the slightly different sum to the neighbouring float8 value, a difference that then
spreads (a tiny LLaMA at 16 x 128 tokens: 1.5e-3 of a tensor's scale in the fourth block). A cast's scale taken
from a slice instead of the whole tensor differs by less than that step (4-7% measured), so verify cannot see it:
`tests/test_float8_tensor_parallel.py` holds the casts exact where no sum reorders them (NOTE [float8 under tensor
parallelism]). (2) Fidelity: the single-process float8 model against the original, the signal-to-quantisation-
noise ratio (SQNR, dB) of the loss and of every gradient, held to `FLOAT8_MIN_SQNR_DB` (the report names the worst).
"""

from __future__ import annotations

from ...form import Form
from ...schedule.float8_primitive import float8_linears
from . import plan as _plan
from . import price as _price
from .tensor_parallel import install_split_gather_scales  # (and registers the float8 linear's leaf rule)
from .runtime import convert_linears, float8_specs_built, install_float8, precompute_scales

# (2) of NOTE [what verified means for float8]: e4m3 keeps 3 mantissa bits, a relative rounding error of at most
# 2^-4 an element (~30 dB for one cast of a uniform tensor), e5m2 (the output gradients) 2 bits, 2^-3 (~24 dB);
# a weight gradient sums products of both. On the tiny LLaMA of the tests (tensorwise, every linear of the blocks)
# the loss measured 78 dB and every parameter gradient 19-25 dB; the bound below leaves 4 dB of margin under the
# worst of them and still fails a float8 path that drops a scale (a factor of 2 is 0 dB).
FLOAT8_MIN_SQNR_DB = 15.0
# (1): one e4m3 rounding step, relative to a tensor's scale, for the checks after an optimizer step
FLOAT8_STEP_RTOL = 2.0 ** -3


class Float8Form(Form):
    """The faces of float8 training."""

    name = "float8"

    # the planner's faces (`plan.py`) and the price's (`price.py`), as they are
    capture_facts = staticmethod(_plan.capture_facts)
    role_options = staticmethod(_plan.role_options)
    keep_roles = staticmethod(_plan.keep_roles)
    role_label = staticmethod(_plan.role_label)
    keep_strategy = staticmethod(_plan.keep_strategy)
    decisions = staticmethod(_plan.decisions)
    price_step = staticmethod(_price.price_step)

    def after_optimizer_step(self, model):
        if float8_specs_built(model):
            precompute_scales(model)

    def gather_itemsize(self, view, name):  # FSDP2 gathers an all_gather=True weight as float8
        lin, _, attr = name.rpartition(".")
        spec = float8_linears(view.extras).get(lin)
        return 1 if spec is not None and spec.all_gather and attr == "weight" else None


FORM = Float8Form()
BUILD_STEPS = {"pre_shard": install_float8, "post_hooks": install_split_gather_scales}
__all__ = ["FORM", "BUILD_STEPS", "convert_linears", "FLOAT8_MIN_SQNR_DB", "FLOAT8_STEP_RTOL"]
