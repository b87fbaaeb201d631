"""treadle's main demo, the whole story on a stock Hugging Face GPT-2 and a 2 x 2 CPU mesh (4 gloo processes):

1. a hand-written schedule: the Megatron recipe (tensor parallel on "tp") plus data parallel on "dp";
2. the planner: given the measured cluster and the hand schedule's memory (its priced peak) as the budget, it
   writes a schedule itself and explains it;
3. the planner again, with the devices' own memory (no budget: what `plan_model` does by default);
each schedule is verified against the original model (outputs, every gradient, an optimizer step) and trained,
then all three are timed again in the reverse order (the machine's drift falls on each alike).

Run: `make demo` (or `python examples/demo_gpt2.py` in the set-up venv).
"""

import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import treadle  # noqa: E402
from treadle import Mesh  # noqa: E402
from treadle.cost.this_host import calibrate_this_host  # noqa: E402
from treadle.models import megatron  # noqa: E402
from treadle.planner import plan_model  # noqa: E402


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # the same weights every call
    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1024, n_positions=128,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)  # the model as written: nothing below edits its code


def show(sch: treadle.Schedule, head: int = 4, tail: int = 2) -> None:
    lines = sch.to_python().splitlines()
    print(f"  {len(lines)} primitives, e.g.")
    for line in lines[:head] + ["..."] + lines[-tail:]:
        print("     ", line)


def check_and_train(sch: treadle.Schedule, inputs: dict) -> list[float]:
    """Verify, train 6 steps; returns the step times of steps 2-6 (seconds)."""
    report = treadle.verify(sch, inputs, steps=2)  # raises VerifyError on any mismatch
    n = {k: sum(c.kind == k for c in report.checks) for k in ("output", "output_grad", "param_grad", "param_step")}
    print(f"  verify: ok on {sch.mesh.world_size} processes: {n['output']} module outputs, {n['output_grad']} "
          f"output gradients, {n['param_grad']} parameter gradients, {n['param_step']} updated parameters")
    result = treadle.train(sch, inputs, steps=6)
    losses = "  ".join(f"{x:.4f}" for x in result.losses)
    print(f"  train: losses {losses}  (median step {statistics.median(result.step_s[1:]) * 1e3:.0f} ms)")
    return list(result.step_s[1:])


def main() -> None:
    ids = torch.randint(0, 1024, (8, 64), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    mesh = Mesh((2, 2), ("dp", "tp"))

    # the cluster, measured explicitly (no hidden state): one CPU core, then the gloo links of this 2x2 mesh and
    # FSDP2's host costs on 4 processes; 4 single-thread ranks share this host's cores (what `treadle plan
    # --cluster 2x2:cpu` and `treadle calibrate --mesh 2x2 --cpu` measure)
    cal = calibrate_this_host(mesh, timeout_s=600)
    cluster = cal.cluster
    print(f"calibrated: {cluster}\n  {cal.notes[0]}\n  {cluster.assumptions()}\n")

    print(f"1. hand-written: Megatron tensor parallel on 'tp' + data parallel on 'dp', {mesh}")
    sch = treadle.create_schedule(gpt2(), mesh=mesh)
    megatron(sch, tp="tp", dp="dp", checkpoint_fraction=0.5)
    show(sch)
    hand = treadle.price(sch, inputs, cluster)  # the same cost model the planner uses, on the schedule as built
    print(f"  priced: {hand.step_s * 1e3:.0f} ms per step, peak {hand.peak_bytes / 2**20:.1f} MiB per device")
    hand_s = check_and_train(sch, inputs)

    print("\n2. planned: the ILP picks every layout and which blocks to checkpoint, in the hand schedule's memory")
    budget = hand.peak_bytes  # the same memory per device as the hand-written schedule: is it as fast?
    # price_top=4: the best plans of the 4 best role assignments are priced as built; the fastest that fits wins
    plan = plan_model(gpt2(), inputs, cluster=cluster, memory_budget_bytes=budget, price_top=4)
    print(f"  budget {budget / 2**20:.1f} MiB per device (the hand schedule's priced peak)")
    print("\n".join("  " + line for line in plan.explain().splitlines()))
    show(plan.schedule)
    planned_s = check_and_train(plan.schedule, inputs)

    print("\n3. planned with the devices' memory (no budget)")
    free = plan_model(gpt2(), inputs, cluster=cluster, price_top=4)
    est = free.estimate()
    print(f"  {free.roles}: priced {est.step_s * 1e3:.0f} ms per step, peak {est.peak_bytes / 2**20:.1f} MiB "
          f"per device")
    show(free.schedule)
    free_s = check_and_train(free.schedule, inputs)

    # the same three again, in the reverse order: each median is over both rounds (steps 2-6 of each)
    free_s += treadle.train(free.schedule, inputs, steps=6).step_s[1:]
    planned_s += treadle.train(plan.schedule, inputs, steps=6).step_s[1:]
    hand_s += treadle.train(sch, inputs, steps=6).step_s[1:]
    hand_ms, planned_ms, free_ms = (statistics.median(x) * 1e3 for x in (hand_s, planned_s, free_s))
    print(f"\n4. measured here (median of 10 steps each, two rounds in opposite orders; 4 processes share this "
          f"machine's cores, a busy machine adds noise):\n"
          f"  planned in the hand's memory {planned_ms:.0f} ms / hand-written {hand_ms:.0f} ms = "
          f"{planned_ms / hand_ms:.2f}\n"
          f"  planned in the devices' memory {free_ms:.0f} ms / hand-written {hand_ms:.0f} ms = {free_ms / hand_ms:.2f}")


if __name__ == "__main__":
    main()
