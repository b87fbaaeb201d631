"""The regions a kernel schedule fuses, as patterns, and the forms of norm and activation leaves found by behaviour
(NOTE [forms by behaviour]): shared by the named kernel schedules (`kernels.py`) and the ones by data flow
(`fusions.py`). Importing it registers the behaviour probe with the pattern matcher."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ScheduleError
from ..graph.pattern import register_form_probe
from ..schedule.core import Schedule


def bias_gelu_tanh(x, bias):
    return F.gelu(x + bias, approximate="tanh")


def bias_gelu(x, bias):
    return F.gelu(x + bias)


def bias_relu(x, bias):
    return F.relu(x + bias)


def bias_silu(x, bias):
    return F.silu(x + bias)


_BIAS_ACTS = (bias_gelu_tanh, bias_gelu, bias_relu, bias_silu)


def swiglu(gate, up):
    return F.silu(gate) * up


def geglu_tanh(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def geglu(gate, up):
    return F.gelu(gate) * up


# NOTE [forms by behaviour]: LLaMA-like models (Qwen2, Mistral, Gemma, ...) each define their own RMSNorm and
# activation classes. A class is given a functional form only when a probe shows it computes that functional
# (on a copy with random weights and a random input), never because of its name; Gemma's RMSNorm scales by
# (1 + weight), so it is not an ``F.rms_norm`` and its norm fusion is refused before any tracing.
_ACTS = {"silu": (lambda x: F.silu(x), {}), "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), {"approximate": "tanh"}),
         "gelu": (lambda x: F.gelu(x), {"approximate": "none"}), "relu": (lambda x: F.relu(x), {})}
_GATED = {"silu": swiglu, "gelu_tanh": geglu_tanh, "gelu": geglu}


def _eps_of(m: nn.Module) -> float | None:
    for a in ("variance_epsilon", "eps"):
        v = getattr(m, a, None)
        if isinstance(v, float):
            return v
    return None


_PROBED: dict[type, tuple] = {}  # type -> probe result; a class computes one function, so this changes nothing


def probe_norm(m: nn.Module) -> tuple[str, list[int], float] | None:
    """(kind, normalized shape, eps) when `m` computes ``F.layer_norm`` or ``F.rms_norm`` with its weight,
    checked numerically on a copy with random weights; None otherwise (then it is not fused)."""
    import copy

    if isinstance(m, nn.LayerNorm):
        return "layer_norm", list(m.normalized_shape), m.eps
    w, eps = getattr(m, "weight", None), _eps_of(m)
    if (not isinstance(w, torch.Tensor) or w.dim() != 1 or eps is None or getattr(m, "bias", None) is not None
            or len(list(m.parameters())) != 1 or len(list(m.children())) or w.is_meta):
        return None
    key = ("norm", type(m))
    if key not in _PROBED:
        g = torch.Generator().manual_seed(0)
        probe = copy.deepcopy(m).float()
        with torch.no_grad():
            probe.weight.copy_(torch.rand(w.shape, generator=g) + 0.5)
            x = torch.randn(2, 3, w.shape[0], generator=g)
            try:
                ok = torch.allclose(probe(x), F.rms_norm(x, [w.shape[0]], probe.weight, eps), rtol=1e-4, atol=1e-5)
            except Exception:  # not a norm over the last dim
                ok = False
        _PROBED[key] = (ok,)
    return ("rms_norm", [w.shape[0]], eps) if _PROBED[key][0] else None


def probe_activation(m: nn.Module) -> str | None:
    """"silu", "gelu_tanh", "gelu" or "relu" when a parameter-free leaf `m` computes that function (checked on a random
    input); None otherwise."""
    if len(list(m.parameters())) or len(list(m.children())) or isinstance(m, nn.Dropout):
        return None
    key = ("act", type(m))
    if key not in _PROBED:
        x = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
        found = None
        try:
            with torch.no_grad():
                y = m(x)
            found = next((n for n, (fn, _) in _ACTS.items() if isinstance(y, torch.Tensor) and y.shape == x.shape
                          and torch.allclose(y, fn(x), rtol=1e-5, atol=1e-6)), None)
        except Exception:  # takes other inputs: not an activation
            found = None
        _PROBED[key] = (found,)
    return _PROBED[key][0]


def _form_probe(m: nn.Module):
    """The form maker of a leaf recognised by behaviour (an RMSNorm or an activation), for the pattern matcher
    and region inlining (treadle.graph.pattern.module_form)."""
    if probe_norm(m) is not None and not isinstance(m, nn.LayerNorm):
        return lambda mm: ("rms_norm", {"normalized_shape": [mm.weight.shape[0]], "eps": _eps_of(mm)}, ("weight",))
    act = probe_activation(m)
    if act is not None:
        return lambda mm: (act, {}, ()) if act in ("silu", "relu") else ("gelu", dict(_ACTS[act][1]), ())
    return None


register_form_probe(_form_probe)


def residual_norm_pattern(kind: str, shape: list[int], eps: float, dropout_p: float | None, *, both: bool = True):
    """Pattern ``h = [dropout(x)] + residual; return (h,) norm(h)`` for a LayerNorm (``kind="layer_norm"``,
    inputs x, residual, weight, bias) or an RMSNorm (``"rms_norm"``, inputs x, residual, weight). With
    ``both=False`` only the norm is an output (post-norm blocks, where the sum feeds nothing else)."""
    if kind == "layer_norm":
        def residual_layer_norm(x, residual, weight, bias):
            if dropout_p is not None:
                x = F.dropout(x, dropout_p, True)
            h = x + residual
            y = F.layer_norm(h, shape, weight, bias, eps)
            return (h, y) if both else y

        return residual_layer_norm

    def residual_rms_norm(x, residual, weight):
        if dropout_p is not None:
            x = F.dropout(x, dropout_p, True)
        h = x + residual
        y = F.rms_norm(h, shape, weight, eps)
        return (h, y) if both else y

    return residual_rms_norm


def fuse_residual_norm(sch: Schedule, norm_path: str, *, compiler: str, dropout_p: float | None = None) -> int:
    """Fuse ``[dropout +] residual add -> norm`` feeding the norm leaf `norm_path` (relative to traced `sch`).
    Tries the form with dropout first when `dropout_p` is given. Returns the number of fused regions."""
    norm = sch[norm_path].mod
    form = probe_norm(norm)
    if form is None:
        raise ScheduleError(f"fuse_residual_norm at {sch[norm_path].path!r}: {type(norm).__name__} does not compute "
                            f"F.layer_norm or F.rms_norm of its weight (NOTE [forms by behaviour])")
    kind, shape, eps = form
    for p in ([dropout_p] if dropout_p is not None else []) + [None]:
        for both in (False, True):  # the sum as an output only when something else reads it (pre-norm residual)
            ms = [m for m in sch.find_pattern(residual_norm_pattern(kind, shape, eps, p, both=both))
                  if m.outputs[-1].target == norm_path]
            if ms:
                sch.fuse(ms[0], compiler=compiler)
                return 1
    return 0
