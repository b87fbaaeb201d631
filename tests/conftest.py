"""Suite-wide setup: the spawned ranks start with the Hugging Face model code already imported.

`treadle.testing.spawn` forks every rank from one forkserver that preloads torch, transformers and treadle.
transformers imports its model code lazily, so each rank that unpickles (or builds) an HF model used to import
``modeling_utils`` and the family's module itself: about 3 s of CPU per rank, per spawn, on every verify of
an HF model. Preloading them in the forkserver (once per session, before its first fork) spends that once.
Imports only: no result depends on it (a module that fails to import is skipped, as multiprocessing does).
"""

from __future__ import annotations

from treadle import testing

# the families the zoo and these tests build, and the compile stack torch.export and aot_eager use
_PRELOAD = ["transformers.modeling_utils", "torch._functorch.aot_autograd", "torch.distributed.pipelining",
            *(f"transformers.models.{m}.modeling_{m}" for m in (
                "gpt2", "bert", "llama", "opt", "t5", "bloom", "gptj", "gpt_neo", "gpt_neox", "gemma", "mistral",
                "phi", "qwen2", "roberta"))]


def pytest_configure(config) -> None:
    ctx = testing._context()  # the forkserver starts at the first spawn: its preload list is still open
    ctx.set_forkserver_preload(["torch", "torch.distributed", "transformers", "treadle", *_PRELOAD])
    # one intra-op thread per test worker, as the spawned ranks run (`testing`): two workers fill the two cores, and
    # two threads each only contend (tiny tensors; OpenMP's idle threads spin)
    import torch

    torch.set_num_threads(1)
