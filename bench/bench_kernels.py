"""Forward+backward time of one GPT-2 block and one LLaMA block on CPU: eager attention vs treadle's kernel
schedule (SDPA attention + torch.compile-fused residual+norm and bias+GeLU / SwiGLU regions), in one run.

The block is timed on its own, called with exactly the arguments it receives inside the model (recorded once):
    python bench/bench_kernels.py                   # hidden 768, seq 512, batch 2, inductor
    python bench/bench_kernels.py --seq 128 --iters 5 --compiler aot_eager   # quick
Prints a table and writes bench/results/bench_kernels.json. Inductor compiles each fused region on the first
call (tens of seconds cold on CPU); warm-up calls are not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch


def make(family: str, hidden: int, heads: int):
    torch.manual_seed(0)
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=1, n_embd=hidden, n_head=heads, vocab_size=256, n_positions=2048,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model, block = GPT2LMHeadModel(cfg), "transformer.h.0"
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(num_hidden_layers=1, hidden_size=hidden, num_attention_heads=heads,
                          num_key_value_heads=max(1, heads // 3), intermediate_size=hidden * 8 // 3 // 64 * 64,
                          vocab_size=256, max_position_embeddings=2048)
        model, block = LlamaForCausalLM(cfg), "model.layers.0"
    model.config._attn_implementation = "eager"  # the baseline: eager attention (matmul, softmax, matmul)
    model.config.use_cache = False
    return model, block


def time_block(block, args, kwargs, iters: int, warmup: int) -> float:
    """Median seconds of forward + backward of `block` on the recorded call."""
    times = []
    for i in range(warmup + iters):
        x = args[0].detach().clone().requires_grad_(True)
        t0 = time.perf_counter()
        out = block(x, *args[1:], **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
        block.zero_grad(set_to_none=True)
    return statistics.median(times)


def run(family: str, a) -> dict:
    import treadle
    from treadle.graph.capture import record_call
    from treadle.models.kernels import kernel_schedule

    model, path = make(family, a.hidden, a.heads)
    inputs = {"input_ids": torch.randint(1, 256, (a.batch, a.seq)), "use_cache": False}
    args, kwargs = record_call(model, path, inputs)
    eager_s = time_block(model.get_submodule(path), args, kwargs, a.iters, 2)
    small = {"input_ids": inputs["input_ids"][:, :8], "use_cache": False}
    model_a, _ = make(family, a.hidden, a.heads)  # SDPA attention only: no compiled regions
    kernel_schedule(treadle.create_schedule(model_a, mesh=treadle.Mesh((1,), ("tp",))), example_inputs=small,
                    fuse_mlp=False, fuse_norm=False)
    sdpa_s = time_block(model_a.get_submodule(path), args, kwargs, a.iters, 2)
    sch = treadle.create_schedule(model, mesh=treadle.Mesh((1,), ("tp",)))
    t0 = time.perf_counter()
    kernel_schedule(sch, example_inputs=small, compiler=a.compiler)
    schedule_s = time.perf_counter() - t0
    blk = model.get_submodule(path)
    t0 = time.perf_counter()
    time_block(blk, args, kwargs, 1, 0)  # compiles the fused regions
    compile_s = time.perf_counter() - t0
    kernel_s = time_block(blk, args, kwargs, a.iters, 2)
    return {"block": family, "eager_s": eager_s, "sdpa_only_s": sdpa_s, "kernel_s": kernel_s,
            "speedup": eager_s / kernel_s, "sdpa_only_speedup": eager_s / sdpa_s,
            "schedule_s": schedule_s, "first_call_s": compile_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compiler", default="inductor")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = [run(f, a) for f in ("gpt2", "llama")]
    print(f"fwd+bwd of one block, hidden {a.hidden}, {a.heads} heads, seq {a.seq}, batch {a.batch}, "
          f"{a.threads} threads, compiler {a.compiler} (median of {a.iters})")
    print(f"{'block':<7}{'eager ms':>10}{'SDPA only ms':>14}{'all kernels ms':>16}{'speedup':>9}{'first call s':>14}")
    for r in rows:
        print(f"{r['block']:<7}{r['eager_s'] * 1e3:>10.1f}{r['sdpa_only_s'] * 1e3:>14.1f}{r['kernel_s'] * 1e3:>16.1f}"
              f"{r['speedup']:>8.2f}x{r['first_call_s']:>14.1f}")
    out = Path(__file__).parent / "results" / "bench_kernels.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"config": vars(a), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
