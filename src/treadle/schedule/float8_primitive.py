"""The `float8` primitive: a module's linear layers train with float8 matrix products (a mixin of `Schedule`;
what build installs: `treadle.forms.float8`).

A recipe is a name in `FLOAT8_RECIPES` (torchao's `Float8LinearConfig.from_recipe_name`), so a file that states
float8 runs nothing else (NOTE [files are data]). Which linears: every `nn.Linear` in the module's subtree whose
path matches none of `skip`; each is listed in the record's state at schedule time, so build converts exactly
those and refuses what changed since.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from ..errors import ScheduleError

if TYPE_CHECKING:  # (annotations only: core's Schedule mixes this class in)
    from .core import Schedule

EXTRAS_KEY = "float8"  # extras[EXTRAS_KEY]: {module path: Float8Spec}

# NOTE [float8 recipes]: torchao's training recipes (torchao.float8, `Float8LinearConfig.from_recipe_name`), as
# torchtitan states them (`--quantize.linear.float8.recipe_name`):
#   tensorwise          one scale per tensor for the input, the weight and the output gradient (dynamic: the
#                       amax of the tensor each step); the fastest; the only one whose weight FSDP2 may
#                       all-gather in float8 (`all_gather=True`: the scale from the amax over every shard)
#   rowwise             one scale per row of each operand of each product, scales rounded to powers of two
#                       (better accuracy for outliers, a slower kernel)
#   rowwise_with_gw_hp  rowwise, except the weight gradient's product stays in high precision
# e4m3 holds inputs and weights, e5m2 the output gradient (torchao's defaults for these recipes).
FLOAT8_RECIPES = {
    "tensorwise": "dynamic tensorwise scales (e4m3 inputs and weights, e5m2 gradients)",
    "rowwise": "dynamic rowwise scales, power-of-two",
    "rowwise_with_gw_hp": "rowwise; the weight gradient's product in high precision",
}
# torch._scaled_mm needs both dims of a float8 weight divisible by 16 (the kernels' alignment)
FLOAT8_ALIGN = 16


@dataclass(frozen=True)
class Float8Spec:
    """What `float8` recorded on one module: its recipe, whether FSDP2 gathers the weights in float8, and the
    linears it converts (paths in the model, in module order)."""

    recipe: str
    all_gather: bool
    linears: tuple[str, ...]


def float8_specs(extras) -> dict[str, Float8Spec]:
    """The float8 modules a schedule recorded: path -> Float8Spec."""
    return dict(extras.get(EXTRAS_KEY, {}))


def float8_linears(extras) -> dict[str, Float8Spec]:
    """Every linear a schedule converts to float8: path -> the spec that converts it."""
    return {lin: spec for spec in float8_specs(extras).values() for lin in spec.linears}


def weight_users(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it has in `model` (a tied one: several)."""
    out: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(n)
    return out


def float8_refusal(m: nn.Linear, users: list[str]) -> str | None:
    """Why linear `m` (whose weight has the names `users`) cannot be float8, or None: the one rule the primitive
    refuses by and the planner converts by. A subclass of nn.Linear (its forward is its own), a dim the float8
    kernels do not take, a tied weight."""
    if type(m) is not nn.Linear:
        return f"a {type(m).__name__}, a subclass of nn.Linear whose forward torchao's Float8Linear would replace"
    if m.in_features % FLOAT8_ALIGN or m.out_features % FLOAT8_ALIGN:
        return (f"({m.in_features} -> {m.out_features}) has a dim not divisible by {FLOAT8_ALIGN} "
                f"(torch._scaled_mm's alignment)")
    if len(users) > 1:
        return f"shares its weight with {sorted(users)}; a tied weight cannot be float8 for one user only"
    return None


def tensor_parallel_refusal(recipe: str) -> str | None:
    """Why a float8 linear of `recipe` cannot have its weight split over a mesh axis, or None (NOTE [float8 under
    tensor parallelism] in `treadle.forms.float8.tensor_parallel`): the one rule the primitive, build and the
    planner read."""
    if recipe != "tensorwise":
        return (f"recipe {recipe!r} scales per row, and its rows of the output gradient or of the input run along "
                f"the split dim; float8 under tensor parallelism needs recipe 'tensorwise'")
    return None


def _full(path: str, name: str) -> str:
    return f"{path}.{name}" if path and name else path or name


class Float8Primitive:
    """`Schedule.float8` and its checks (the schedule provides `_state`, `mod`, `path`, `_where`,
    `_check_not_built`, `_record`)."""

    def float8(self: "Schedule", *, recipe: str = "tensorwise", all_gather: bool = False,
               skip: tuple[str, ...] | list[str] = ()) -> "Schedule":
        """Train this module's linear layers with float8 matrix products (torchao's float8 training, NOTE [float8
        recipes]): each `nn.Linear` in the subtree becomes torchao's `Float8Linear` at build, whose forward and
        both backward products cast their operands to float8 with dynamic scales and run `torch._scaled_mm`
        (emulated in fp32 where the device has no float8 matrix unit: a CPU, a GPU before sm_89).

        `recipe`: a name in `FLOAT8_RECIPES`. `all_gather`: FSDP2 all-gathers these weights in float8 (half the
        bytes of bf16; tensorwise only; needs ``data_parallel(shard=True)``). `skip`: glob patterns of module
        paths (``"*.mlp.gate"``) left in high precision.

        Every converted linear needs in and out features divisible by 16 (`torch._scaled_mm`'s alignment) and a
        weight of its own (a tied weight would be cast for one user and not the other). Float8 is not
        bit-exact: NOTE [what verified means for float8] in `treadle.forms.float8`. Raises ScheduleError naming
        the path, the linear and its shape at fault."""
        self._check_not_built("float8")
        where = f"float8 at {self._where()}"
        if recipe not in FLOAT8_RECIPES:
            raise ScheduleError(f"{where}: unknown recipe {recipe!r}; known: {sorted(FLOAT8_RECIPES)}")
        if not isinstance(all_gather, bool):
            raise ScheduleError(f"{where}: all_gather must be True or False, got {all_gather!r:.40}")
        if all_gather and recipe != "tensorwise":
            raise ScheduleError(f"{where}: all_gather=True needs recipe 'tensorwise' (one scale per weight, from "
                                f"the amax over every shard); {recipe!r} scales per row")
        skip = (skip,) if isinstance(skip, str) else tuple(skip)
        if not all(isinstance(s, str) for s in skip):
            raise ScheduleError(f"{where}: skip must be module path patterns (strings), got {skip!r:.80}")
        specs = self._state.extras.setdefault(EXTRAS_KEY, {})
        taken = float8_linears(specs and {EXTRAS_KEY: specs})
        linears = []
        for name, m in self.mod.named_modules():
            path = _full(self.path, name)
            if not isinstance(m, nn.Linear) or any(fnmatch.fnmatchcase(path, s) for s in skip):
                continue
            if path in taken:
                raise ScheduleError(f"{where}: linear {path!r} is float8 already (by float8 at "
                                    f"{next(p for p, s in specs.items() if path in s.linears)!r})")
            linears.append((path, m))
        if not linears:
            raise ScheduleError(f"{where}: no nn.Linear in this module's subtree"
                                + (f" outside skip={list(skip)}" if skip else "")
                                + "; float8 converts linear layers (a GPT-2 Conv1D is not one)")
        users = weight_users(self._state.model)
        bad = [(p, why) for p, m in linears if (why := float8_refusal(m, users.get(id(m.weight), [])))]
        if bad:
            first = bad[0][0]
            hint = "*." + first.rpartition(".")[2] if "." in first else first
            raise ScheduleError(f"{where}: {'; '.join(f'linear {p!r} {why}' for p, why in bad[:4])}"
                                f"{' ...' if len(bad) > 4 else ''}; leave them in high precision with skip=[...] "
                                f"(e.g. {hint!r})")
        for path, m in linears:
            prior = self._state.param_shards.get(id(m.weight), [])
            why = tensor_parallel_refusal(recipe) if prior else None
            if why:
                raise ScheduleError(f"{where}: linear {path!r}'s weight is split on mesh axis {prior[0].axis!r} (dim "
                                    f"{prior[0].dim}): {why}; or skip it")
        specs[self.path] = Float8Spec(recipe, all_gather, tuple(p for p, _ in linears))
        self._record("float8", recipe=recipe, all_gather=all_gather, **({"skip": list(skip)} if skip else {}))
        return self
