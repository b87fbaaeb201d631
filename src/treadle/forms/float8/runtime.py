"""What build installs for `float8` (the "pre_shard" build step): each recorded linear becomes torchao's
`Float8Linear`, before any form slices or wraps it (FSDP2 then wraps the float8 weights; NOTE [float8 all-gather on
gloo] in `treadle.forms.data.runtime`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...errors import BuildError
from ...schedule.float8_primitive import Float8Spec, float8_specs, tensor_parallel_refusal

logger = logging.getLogger(__name__)


def float8_config(spec: Float8Spec, *, emulate: bool, all_gather: bool) -> Any:
    """torchao's `Float8LinearConfig` of `spec`'s recipe (NOTE [float8 recipes]), emulated or not, with FSDP2's
    float8 all-gather on or off. Raises BuildError when torchao is missing."""
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError as exc:
        raise BuildError(f"float8 needs torchao (pip install 'treadle[float8]' or torchao>=0.14): {exc}") from None
    cfg = Float8LinearConfig.from_recipe_name(spec.recipe)
    return dataclasses.replace(cfg, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)


def has_float8_matmul(device: torch.device) -> bool:
    """Whether `device` runs float8 products natively (CUDA sm_89 and later: Ada, Hopper, Blackwell); elsewhere
    torchao emulates them (operands dequantised, an fp32 product)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def convert_linears(model: nn.Module, view: Any, *, device: torch.device, fsdp: bool, wrapped: bool = True,
                    shards: Mapping[int, tuple] | None = None, where: str = "build") -> list[str]:
    """Swap every linear the schedule's `float8` records name for a `Float8Linear` holding the same weight
    (FSDP2's float8 all-gather wraps it: a new Parameter object, returned via the caller's rebind). Returns the
    converted paths. Raises BuildError for a linear that is gone or no longer an `nn.Linear`, a pipeline,
    ``all_gather=True`` without FSDP2, or a split weight the tensor-parallel rule does not run (NOTE [float8 under
    tensor parallelism]). `shards`: id(parameter) -> its recorded splits (build's table).
    ``wrapped=False`` (the price's rehearsal: no FSDP2 wrapper) leaves the weights plain parameters; the data
    form prices their float8 gathers (`Float8Form.gather_itemsize`), and the rehearsal charges each weight's cast
    whole where FSDP2 casts each rank's shard before the gather."""
    specs = float8_specs(view.extras)
    if not specs:
        return []
    if view.extras.get("pipeline") is not None:
        raise BuildError(f"{where}: float8 with a pipeline is not supported (the stages are captured by "
                         f"torch.export, which would trace through torchao's float8 tensors); drop one of them")
    from torchao.float8.float8_linear import Float8Linear

    emulate = not has_float8_matmul(device)
    done = []
    for path, spec in sorted(specs.items()):
        if spec.all_gather and not fsdp:
            raise BuildError(f"{where}: float8(all_gather=True) at {path or '<model>'!r} needs FSDP2 "
                             f"(data_parallel(shard=True) over more than one rank) to gather the weights")
        cfg = float8_config(spec, emulate=emulate, all_gather=spec.all_gather and wrapped)
        for lin in spec.linears:
            parent_path, _, attr = lin.rpartition(".")
            try:
                parent = model.get_submodule(parent_path)
                mod = getattr(parent, attr)
            except AttributeError:
                raise BuildError(f"{where}: float8 at {path or '<model>'!r} names linear {lin!r}, which no longer "
                                 f"exists (replaced after float8 was stated?)") from None
            if type(mod) is not nn.Linear:
                raise BuildError(f"{where}: float8 at {path or '<model>'!r} names linear {lin!r}, now a "
                                 f"{type(mod).__name__}; state float8 after replacing it")
            split = (shards or {}).get(id(mod.weight))
            why = tensor_parallel_refusal(spec.recipe) if split else None
            if why:
                raise BuildError(f"{where}: linear {lin!r} is float8 and its weight is split over mesh axis "
                                 f"{split[0].axis!r}: {why} (NOTE [float8 under tensor parallelism])")
            setattr(parent, attr, Float8Linear.from_float(mod, config=cfg))
            done.append(lin)
    logger.info("float8: %d linears (%s)", len(done), "emulated" if emulate else "native")
    return done


def install_float8(builder) -> None:
    """The "pre_shard" build step: `convert_linears` on the builder's model; a weight FSDP2 will gather in float8
    is a new Parameter, so the schedule's records follow it (`builder.rebind`)."""
    view = builder.v
    if not float8_specs(view.extras):
        return
    builder.materialize()  # the conversion reads the weights (NOTE [late materialisation])
    before = {n: p for n, p in builder.model.named_parameters(remove_duplicate=False)}
    dp = view.data_parallel
    fsdp = dp is not None and dp.shard and dp.size(builder.mesh) > 1
    convert_linears(builder.model, view, device=builder.mesh.device, fsdp=fsdp, wrapped=builder.wrap,
                    shards=builder.param_shards)
    for n, p in builder.model.named_parameters(remove_duplicate=False):
        if n in before and before[n] is not p:
            builder.rebind(before[n], p)


def precompute_scales(model: nn.Module) -> None:
    """After an optimizer step: the scales of every weight FSDP2 gathers in float8, from one all-reduce of their
    amaxes (torchao's `precompute_float8_dynamic_scale_for_fsdp`, as torchtitan runs it), instead of one all-reduce
    per weight at each of its gathers. Nothing without such weights."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor, precompute_float8_dynamic_scale_for_fsdp

    if any(isinstance(getattr(p, "_local_tensor", None), WeightWithDynamicFloat8CastTensor)
           for p in model.parameters()):
        precompute_float8_dynamic_scale_for_fsdp(model)


def float8_specs_built(model: nn.Module) -> bool:
    """Whether built `model` holds a float8 linear (torchao not imported: none)."""
    import sys

    mod = sys.modules.get("torchao.float8.float8_linear")
    return mod is not None and any(isinstance(m, mod.Float8Linear) for m in model.modules())
