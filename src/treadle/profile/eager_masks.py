"""The attention masks an eager run builds, in treadle's runs on fake tensors (NOTE [eager masks]).

NOTE [eager masks]: Hugging Face's mask code (`transformers.masking_utils`) decides per step whether attention needs
an explicit mask, from the *values* of the attention mask and position ids: with no padding and one unpacked sequence
per row it returns no mask, and attention runs causal (`is_causal=True`; grouped-query attention then passes its
key / value heads to SDPA as they are, ``enable_gqa``). It cannot read values under tracing, so when it sees a fake
tensor or runs under `torch.export` it assumes the worst and builds an explicit mask, and SDPA without a mask's
fast path repeats the key / value heads (``repeat_kv``: two copies the size of the queries' per block, kept for
backward). The price's rehearsal and the profiler run on fake tensors, so they priced a step the run does not take:
measured on a tiny LLaMA (8 query heads over 4 KV heads), the rehearsal's block saved 1.41 MB a micro-batch where
the run saves 1.32 MB (a model of treadle's zoo was spared by a hook of the zoo's own, which this replaces).

The planner's capture (an export) takes them in full too. It once took only the packed-sequence decision: applied
in full, the solver's saving from checkpointing a small GQA LLaMA fell to 0.74x the price's (0.87x before). That gap
was the solver's, not the capture's: it charged a checkpointed block's recompute on top of every activation but
nothing for the loss's backward, which the price sees at the same peak (NOTE [a backward's working set] in
`treadle.planner.grad_live`). With both, the solver's activations equal the price's on that model (433.2 MiB each,
none checkpointed; 96.5 vs 96.0 all checkpointed), where the half-applied masks over-counted 20 MiB a block (the
repeated key / value heads and the mask).

`eager_masks(inputs)` makes those runs take the eager run's decisions for `inputs`, the example inputs they are
given. It reads the inputs' values once, where they are real: every ``*attention_mask`` a 2-D mask of ones (or
absent) and every ``*position_ids`` one consecutive run per row (or absent: the model counts them). Then, for the
run inside it, transformers' mask decisions see no padding mask (its values are all ones: the decision an eager
run takes on them), no packed sequences, and no export. Otherwise (padding, packed sequences, a 3-D or 4-D mask, or
a fake mask or fake position ids, whose values cannot be read) nothing is changed: the eager run builds an
explicit mask too. Without transformers' mask module (a model of another library, or a transformers without it)
it does nothing. Real runs (verify, train, a pipeline's stages) are never inside it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor


def plain_inputs(inputs: Mapping[str, Any]) -> bool:
    """Whether an eager run on `inputs` builds no padding or packed-sequence mask (NOTE [eager masks]): every
    ``*attention_mask`` absent or a real 2-D mask of ones, every ``*position_ids`` absent or real with one run of
    consecutive positions per row. A fake one (values unknown) is not plain."""
    for key, value in inputs.items():
        if value is None or not isinstance(value, torch.Tensor):
            if key.endswith(("attention_mask", "position_ids")) and value is not None:
                return False
            continue
        if key.endswith("attention_mask"):
            if isinstance(value, FakeTensor) or value.device.type == "meta" or value.ndim != 2:
                return False
            if not bool((value == 1).all()):
                return False
        elif key.endswith("position_ids"):
            if isinstance(value, FakeTensor) or value.device.type == "meta":
                return False
            if value.shape[-1] > 1 and not bool((value.diff(dim=-1) == 1).all()):
                return False
    return True


@contextlib.contextmanager
def eager_masks(inputs: Mapping[str, Any]) -> Iterator[None]:
    """Inside: transformers' mask decisions are the eager run's on `inputs` (NOTE [eager masks]); restored after."""
    mod = sys.modules.get("transformers.masking_utils")  # imported by any model that builds its masks there
    if mod is None or not plain_inputs(inputs):
        yield
        return
    saved: dict[str, Any] = {}

    def patch(name: str, value: Any) -> None:
        if hasattr(mod, name):
            saved[name] = getattr(mod, name)
            setattr(mod, name, value)

    def no_padding(original):
        def decide(padding_mask, *args, **kwargs):  # the mask is all ones: decided as without one
            return original(None, *args, **kwargs)
        return decide

    patch("is_torchdynamo_exporting", lambda: False)
    for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
        if hasattr(mod, name):
            patch(name, no_padding(getattr(mod, name)))
    patch("find_packed_sequence_indices", lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(mod, name, value)
