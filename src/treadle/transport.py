"""What a model loses when it reaches another process by pickle, restored (`restore_after_load`).

NOTE [registrations lost in transport]: `verify`, `train` and a schedule log's pickled module send a model to
fresh processes with `torch.save` / `torch.load`. Unpickling rebuilds the modules' state but runs no
constructor, so whatever a class records at construction in a process-wide table is missing in a process that
never built one. Hugging Face's output capturing is such a table: `PreTrainedModel.__init__` registers the
class's `_can_record_outputs` (which submodule outputs `output_router_logits`, `output_hidden_states` and
`output_attentions` collect), and a model unpickled without it collects nothing. Its MoE models then return no
router logits, so a config with `output_router_logits=True` fails in forward (the load-balancing loss reads
them); others silently return no hidden states. `restore_after_load` registers every such module's class again,
where it is not registered already, from the module's own attribute: the same entry its constructor would have
made. Nothing else is changed; a model without those classes is left alone.

The other way round, a model that has collected outputs once holds the hooks that collect them (functions local
to Hugging Face's installer, which pickle refuses), so it cannot be sent at all. `sendable` hands the sender a
copy without those hooks and with the model marked as not hooked, so that the receiving process installs its
own on first use; a model without them is sent as it is (no copy).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from torch import nn


def restore_after_load(obj: Any) -> None:
    """Restore, for every module of `obj` (a module, or a dict / list / tuple holding modules), the registrations
    its classes make at construction (NOTE [registrations lost in transport])."""
    modules = [obj] if isinstance(obj, nn.Module) else [v for v in _values(obj) if isinstance(v, nn.Module)]
    capturing = sys.modules.get("transformers.utils.output_capturing")
    base = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    registry = getattr(capturing, "_CAN_RECORD_REGISTRY", None)
    if registry is None or base is None:
        return
    for root in modules:
        for m in root.modules():
            if isinstance(m, base) and str(m.__class__) not in registry:
                registry[m] = getattr(m, "_can_record_outputs", None)


def _values(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple)):
        return list(obj)
    return []


_CAPTURING_HOOK = "install_output_capuring_hook.<locals>.output_capturing_hook"  # Hugging Face's name, as spelt there
_HOOKED_FLAG = "_output_capturing_hooks_installed"


def _capturing(m: nn.Module) -> list[int]:
    return [k for k, h in m._forward_hooks.items() if getattr(h, "__qualname__", "") == _CAPTURING_HOOK]


def sendable(model: nn.Module) -> nn.Module:
    """`model` as a pickle can carry it to another process: itself, or, where it holds output-capturing hooks, a
    deep copy without them, marked as not hooked (NOTE [registrations lost in transport]). The caller's model is
    not changed."""
    if not any(_capturing(m) for m in model.modules()):
        return model
    out = copy.deepcopy(model)
    for m in out.modules():
        for k in _capturing(m):
            del m._forward_hooks[k]
        if getattr(m, _HOOKED_FLAG, False):
            setattr(m, _HOOKED_FLAG, False)
    return out
