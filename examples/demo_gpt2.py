"""treadle's main demo: a stock Hugging Face GPT-2, scheduled with Megatron tensor parallelism + data
parallelism on a 2 x 2 CPU mesh (4 gloo processes), verified against the original, then trained.

Run: `make demo` (or `python examples/demo_gpt2.py` in the set-up venv).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import treadle  # noqa: E402
from treadle import Mesh  # noqa: E402
from treadle.models import megatron  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1024, n_positions=128,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)  # the model as written: nothing below edits its code
    batch = torch.randint(0, config.vocab_size, (8, 64))
    inputs = {"input_ids": batch, "labels": batch}

    mesh = Mesh((2, 2), ("dp", "tp"))
    sch = treadle.create_schedule(model, mesh=mesh)
    megatron(sch, tp="tp", dp="dp", checkpoint_fraction=0.5)  # a recipe of ordinary primitives
    lines = sch.to_python().splitlines()
    print(f"schedule for {mesh}: {len(lines)} primitives, e.g.")
    for line in lines[:4] + ["..."] + lines[-3:]:
        print("   ", line)

    report = treadle.verify(sch, inputs, steps=2)  # raises VerifyError on any mismatch
    n = {k: sum(c.kind == k for c in report.checks) for k in ("output", "output_grad", "param_grad", "param_step")}
    print(f"\nverify: ok on 4 processes -- {n['output']} module outputs, {n['output_grad']} output gradients, "
          f"{n['param_grad']} parameter gradients and {n['param_step']} updated parameters match the original")

    result = treadle.train(sch, inputs, steps=5)
    print("\ntraining on the 2 x 2 mesh (dp x tp):")
    for step, (loss, seconds) in enumerate(zip(result.losses, result.step_s)):
        print(f"  step {step}: loss {loss:.4f}  ({seconds * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
