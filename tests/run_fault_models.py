"""Models for treadle.run's fault tests (``--model run_fault_models:fault_llama``): tiny LLaMA whose forward
turns the loss NaN, or sends this process SIGTERM, at chosen forward calls on chosen ranks.

TREADLE_TEST_FAULT says which: ``nan:<rank>:<call>,<call>...`` or ``sigterm:<rank>:<call>`` (calls count from
1; one forward per optimizer step in these tests). Unset: plain tiny LLaMA (the same weights)."""

from __future__ import annotations

import os
import signal

import torch.distributed as dist
from torch import nn


class FaultyLM(nn.Module):
    """`inner` (a causal LM called as inner(input_ids=, labels=)) with the fault of TREADLE_TEST_FAULT."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.calls = 0
        kind, rank, calls = (os.environ.get("TREADLE_TEST_FAULT", "none::").split(":") + ["", ""])[:3]
        self.kind, self.rank = kind, int(rank) if rank else -1
        self.at = {int(c) for c in calls.split(",") if c}

    def forward(self, input_ids, labels):
        out = self.inner(input_ids=input_ids, labels=labels)
        self.calls += 1
        if self.calls in self.at and dist.is_initialized() and dist.get_rank() == self.rank:
            if self.kind == "nan":
                out.loss = out.loss * float("nan")
            elif self.kind == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
        return out


def fault_llama(batch: int, seq: int):
    from treadle.models.zoo import named_model

    model, inputs = named_model("tiny-llama", batch=batch, seq=seq, dropout=False)
    return FaultyLM(model), inputs
