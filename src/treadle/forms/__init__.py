"""The parallel forms, each one package, registered here — the one place — in the order every core layer calls them.

    sequence: sequence parallelism      vocab: the vocab-parallel embedding and loss      data: DDP / ZeRO-3 / HSDP

How to add a form: `docs/architecture.md`.
"""

from __future__ import annotations

from ..form import register_form
from ..runtime.build import register_build_extension
from . import data, sequence, vocab

for _form in (sequence, vocab, data):
    register_form(_form.FORM)
    for _phase, _step in _form.BUILD_STEPS.items():
        register_build_extension(_phase, _step)
