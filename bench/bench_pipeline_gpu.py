"""Pipelines on GPU presets, predicted: the planner (with its pipeline role) against the 3D recipes experts publish.

Issue 27's second benchmark. bf16 mixed precision (fp32 master weights and AdamW states), 80 GiB per device, nodes
of 8 H100 (NVLink 4 inside a node, InfiniBand NDR between). Every schedule, the plans' too, is priced by the same
function, `treadle.price` (a pipeline: its stages timed from one rehearsed micro-batch and laid out in the
schedule class's own order, NOTE [pipeline price]). Cases, each at its recipe's global batch, micro-batch 1:

- Llama-2-70B on 64 H100, seq 4096, global batch 128: NeMo's recipe, TP4 PP4 with 20 virtual stages a rank (80
  stages of one block), DP4 — mesh (pp 4, dp 4, tp 4), interleaved 1F1B over 32 micro-batches.
- Llama-3-70B on 64 H100, seq 8192, global batch 128: Megatron-LM's, TP4 PP8 with 5 virtual stages a rank (40 stages
  of two blocks), DP2 — mesh (pp 8, dp 2, tp 4), interleaved 1F1B over 64 micro-batches.
- Llama-3.1-405B on 512 H100, seq 8192, global batch 256: torchtitan's (benchmarks/llama3_h100_202412_torchtitan.md,
  Table 5: FSDP 8, TP 8, PP 8, local batch 32, full activation checkpointing; 1F1B 100 and interleaved 1F1B 128
  tokens/s/GPU measured with Float8 and torch.compile, which treadle does not price) — mesh (pp 8, dp 8, tp 8),
  FSDP2 over dp, 1F1B over 8 stages and interleaved 1F1B over 16, 32 micro-batches, every block checkpointed.

The recipes' tensor parallelism is treadle's Megatron recipe (column / row-parallel attention and MLP; no sequence
parallelism or vocab-parallel head inside stages). Megatron's distributed optimizer (AdamW states sharded over DP)
has no treadle primitive: each Megatron / NeMo recipe is priced with plain DDP replicas (states whole: an upper
bound on memory) and with FSDP2 over dp beside the pipeline (parameters sharded too: a lower bound). Against them: the planner as `treadle plan --cluster` runs it
(every mesh of up to 3 axes whose inner axis stays inside a node; price_top=1: the best pipelined and unpipelined
plans priced, NOTE [pipelined against unpipelined]), and the planner without pipelines (`pp_axis=None`).
Columns: predicted step, tokens/s per GPU, MFU (bf16 peak), peak memory, planner/recipe step ratio (< 1: faster),
planning seconds. Target (issue 27): the planner at least as fast as every recipe that fits, >= 1.2x faster than
one; planning <= 60 s for 405B on 512 GPUs. Writes bench/results/bench_pipeline_gpu.json.

With ``--verify`` each recipe, and the planner's plans (with and without pipelines; the solver's choice on meshes of
up to 2 axes), is carried onto a tiny LLaMA of 8 blocks on 8 ranks with the same axis names
(`treadle.verify.shrink.carry_schedule`; a pipeline keeps at least 4 stages: a 1F1B recipe on pp 4, an interleaved
one on pp 2 with 2+ stages a rank) and verified against one process on 8 gloo ranks instead
(bench/results/bench_pipeline_gpu_verify.json).

    .venv/bin/python bench/bench_pipeline_gpu.py [--models llama-2-70b llama-3-70b llama-3.1-405b] [--tiny] [--verify]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
GiB = 2**30
# model: (cluster, global batch, seq, [(recipe label, mesh shape, names, pp schedule, stages, microbatches, fsdp,
# full ac, source)])
CASES = {
    "llama-2-70b": ("8x8:h100", 128, 4096, [
        ("NeMo TP4 PP4 VP20 (DP4)", (4, 4, 4), "interleaved_1f1b", 80, 32, False, False,
         "NeMo performance summary: Llama-2-70B, 64 H100, TP4 PP4 VP20 (issue 27)"),
        ("NeMo TP4 PP4 VP20 (ZeRO-3 over DP4)", (4, 4, 4), "interleaved_1f1b", 80, 32, True, False,
         "as above; FSDP2 over dp: the nearest treadle states to Megatron's distributed optimizer")]),
    "llama-3-70b": ("8x8:h100", 128, 8192, [
        ("Megatron-LM TP4 PP8 VP5 (DP2)", (8, 2, 4), "interleaved_1f1b", 40, 64, False, False,
         "Megatron-LM Llama-3-70B, 64 H100, TP4 PP8 VP5 (issue 27)"),
        ("Megatron-LM TP4 PP8 VP5 (ZeRO-3 over DP2)", (8, 2, 4), "interleaved_1f1b", 40, 64, True, False,
         "as above; FSDP2 over dp: the nearest treadle states to Megatron's distributed optimizer")]),
    "llama-3.1-405b": ("64x8:h100", 256, 8192, [
        ("torchtitan FSDP8 x TP8 x PP8 1F1B + full AC", (8, 8, 8), "1f1b", 8, 32, True, True,
         "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md Table 5"),
        ("torchtitan FSDP8 x TP8 x PP8 interleaved + full AC", (8, 8, 8), "interleaved_1f1b", 16, 32, True, True,
         "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md Table 5")]),
    "tiny-llama": ("2x4:h100", 16, 64, [
        ("smoke: TP2 PP2 VP2 (DP2)", (2, 2, 2), "interleaved_1f1b", 4, 4, False, False, "(smoke test)")]),
}


def _build(name: str, batch: int, seq: int):
    from treadle.models.zoo import named_model

    model, inputs = named_model(name, batch=batch, seq=seq, fake=True, dtype=torch.bfloat16)
    model.config.use_cache = False
    return model, inputs


def _cluster(physical, shape, names):
    """`physical`'s links on a 3-axis mesh (pp, dp, tp): the last axis inside a node, the others between."""
    from treadle.cost.cluster import ClusterSpec
    from treadle.mesh import Mesh

    inter, intra = physical.links
    return ClusterSpec(Mesh(tuple(shape), tuple(names)),
                       tuple(intra if i == len(shape) - 1 else inter for i in range(len(shape))), physical.device)


def _recipe(name, inputs, physical, spec):
    """(schedule, cluster) of one published recipe on a fresh fake model."""
    from treadle.mesh import Mesh
    from treadle.models import megatron
    from treadle.models.common import blocks_path
    from treadle.schedule.core import create_schedule

    label, shape, kind, stages, m, fsdp, full_ac, _ = spec
    model, _ = _build(name, *inputs["input_ids"].shape)
    names = ("pp", "dp", "tp")
    sch = create_schedule(model, mesh=Mesh(shape, names))
    megatron(sch, tp="tp", sequence_parallel=False, vocab_parallel_head=False)
    sch.data_parallel(axis="dp", shard=fsdp)
    blocks = blocks_path(sch)
    n = len(sch[blocks].mod)
    ends = sorted({(s + 1) * n // stages - 1 for s in range(stages - 1)})
    for e in ends:
        sch[f"{blocks}.{e}"].cut_pipeline_stage()
    if full_ac:
        for i in range(n):
            sch[f"{blocks}.{i}"].checkpoint()
    sch.pipeline(axis="pp", schedule=kind, n_microbatches=m, example_inputs=inputs)
    return sch, _cluster(physical, shape, names)


SMALL_BATCH, SMALL_SEQ, SMALL_BLOCKS = 8, 32, 8


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=SMALL_BLOCKS, hidden_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                        max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                                        pad_token_id=0, use_cache=False))


def _small_shape(sch) -> tuple[int, ...]:
    """A shrunken mesh of 8 ranks with the schedule's axis names that runs at least 4 pipeline stages: a single-stage
    schedule (1F1B, GPipe) on pp 4 (the innermost other axis 2, the others 1); a multi-stage one on pp 2 (its 2+
    stages a rank) with 2 on each of the two innermost others; without a pipeline 2 on each axis of up to 3 (4 x 2
    for 2, 8 for 1)."""
    names = list(sch.mesh.names)
    piped = next((r for r in sch.records if r.op == "pipeline"), None)
    if piped is None:
        return {1: (8,), 2: (4, 2), 3: (2, 2, 2)}[len(names)]
    pp = piped.args["axis"]
    single = piped.args.get("schedule") in ("1f1b", "gpipe")
    size, left = {pp: 4 if single else 2}, 8 // (4 if single else 2)
    for a in reversed(names):  # the inner (tensor) axes first
        if a != pp:
            size[a] = min(2, left)
            left //= size[a]
    return tuple(size[a] for a in names)


def verify_carried(label: str, name: str, sch) -> dict:
    """`sch` (a schedule of the large model) carried onto a tiny LLaMA of 8 blocks (`carry_schedule`: its stages a
    rank as far as 8 blocks allow, its micro-batches where batch 8 splits so) on a mesh of 8 ranks with at least 4
    stages where it pipelines (`_small_shape`), verified against one process on 8 gloo ranks."""
    import treadle
    from treadle.errors import TreadleError
    from treadle.mesh import Mesh
    from treadle.verify.shrink import carry_schedule

    ids = torch.randint(0, 256, (SMALL_BATCH, SMALL_SEQ), generator=torch.Generator().manual_seed(0))
    small = {"input_ids": ids, "labels": ids}
    t0 = time.perf_counter()
    shape = _small_shape(sch)
    row = {"plan": label, "model": name, "small_mesh": dict(zip(sch.mesh.names, shape))}
    try:
        carried = carry_schedule(sch, _tiny(), mesh=Mesh(shape, tuple(sch.mesh.names)), example_inputs=small)
    except TreadleError as exc:  # a schedule that cannot be carried is a result of this bench, not a crash of it
        return {**row, "stages": 0, "ok": False, "error": f"{type(exc).__name__}: {exc}", "verify_s": 0.0}
    piped = any(r.op == "pipeline" for r in carried.schedule.records)
    stages = sum(r.op == "cut_pipeline_stage" for r in carried.schedule.records) + 1 if piped else 0
    report = treadle.verify(carried.schedule, small, steps=2, timeout_s=600, raise_on_mismatch=False)
    return {**row, "stages": stages, "ok": report.ok, "error": report.error,
            "verify_s": time.perf_counter() - t0, "carried": carried.summary()}


def verify_shrunken(name, spec, physical) -> dict:
    """One recipe carried and verified (`verify_carried`)."""
    big, inputs = _build(name, *CASES[name][1:3])
    sch, _ = _recipe(name, inputs, physical, spec)
    return verify_carried(spec[0], name, sch)


def verify_planned(name, physical, max_axes: int) -> list[dict]:
    """The planner's plans of `name` (pipelines weighed, and without them; the solver's choice, `price_top=0`, on
    meshes of up to `max_axes` axes) carried and verified (`verify_carried`)."""
    from treadle.planner import plan_model
    from treadle.planner.meshes import search_clusters

    out = []
    for label, pp_axis in (("planner", "auto"), ("planner without pipelines", None)):
        model, inputs = _build(name, *CASES[name][1:3])
        plan = plan_model(model, inputs, cluster=search_clusters(physical, max_axes=max_axes),
                          memory_budget_bytes=80 * GiB, price_top=0, pp_axis=pp_axis)
        out.append(verify_carried(f"{label}: {plan.roles} on {plan.cluster.mesh}", name, plan.schedule_for(model)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["llama-2-70b", "llama-3-70b", "llama-3.1-405b"])
    ap.add_argument("--tiny", action="store_true", help="tiny-llama only (a smoke test of the script)")
    ap.add_argument("--max-axes", type=int, default=3, help="most mesh axes the planner searches (default 3)")
    ap.add_argument("--verify", action="store_true", help="only carry each recipe and the planner's plans (solver's "
                    "choice, meshes of up to 2 axes) onto a tiny LLaMA of 8 blocks on 8 ranks (a pipeline: at least 4 "
                    "stages) and verify each on 8 gloo ranks")
    args = ap.parse_args()
    if args.verify:
        from treadle.cost.cluster import parse_cluster

        out = []
        for name in args.models:
            physical = parse_cluster(CASES[name][0])
            out += [verify_shrunken(name, spec, physical) for spec in CASES[name][3]]
            out += verify_planned(name, physical, min(args.max_axes, 2))
        for r in out:
            mesh = "x".join(f"{a}{n}" for a, n in r["small_mesh"].items())
            print(f"{r['model']:15} {r['plan'][:60]:60} {mesh:14} {r['stages']:3d} stages  "
                  f"{'ok' if r['ok'] else 'FAILED'} ({r['verify_s']:.0f} s) {r['error'] or ''}")
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "bench_pipeline_gpu_verify.json").write_text(json.dumps(out, indent=1, default=str))
        return
    from treadle.cost.cluster import parse_cluster
    from treadle.errors import TreadleError
    from treadle.planner import plan_model
    from treadle.planner.meshes import search_clusters
    from treadle.pricing import price

    rows = []
    for name in (["tiny-llama"] if args.tiny else args.models):
        ctext, batch, seq, recipes = CASES[name]
        physical = parse_cluster(ctext)
        world = physical.world_size
        tokens = batch * seq
        case = []
        for spec in recipes:
            t0 = time.perf_counter()
            try:
                model, inputs = _build(name, batch, seq)
                sch, cl = _recipe(name, inputs, physical, spec)
                p = price(sch, inputs, cl)
                case.append({"plan": spec[0], "source": spec[-1], "mesh": str(cl.mesh), "step_s": p.step_s,
                             "mfu": p.mfu, "peak_bytes": p.peak_bytes, "price_s": time.perf_counter() - t0,
                             "bubble": (p.pipeline or {}).get("bubble_fraction")})
            except TreadleError as exc:
                case.append({"plan": spec[0], "source": spec[-1], "error": f"{type(exc).__name__}: {exc}"})
            print(f"  {name}: {spec[0]}: {case[-1].get('step_s', float('nan')) * 1e3:.1f} ms "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        for label, pp_axis in (("planner", "auto"), ("planner without pipelines", None)):
            t0 = time.perf_counter()
            try:
                model, inputs = _build(name, batch, seq)
                plan = plan_model(model, inputs, cluster=search_clusters(physical, max_axes=args.max_axes),
                                  memory_budget_bytes=80 * GiB, price_top=1, pp_axis=pp_axis)
                est = plan.estimate()
                case.append({"plan": label, "roles": plan.roles, "mesh": str(plan.cluster.mesh), "step_s": est.step_s,
                             "mfu": est.mfu, "peak_bytes": est.peak_bytes, "solver_step_s": plan.estimated.step_s,
                             "planning_s": plan.solver["planning_s"], "stages": plan.solver.get("stages")})
            except TreadleError as exc:
                case.append({"plan": label, "error": f"{type(exc).__name__}: {exc}"})
            print(f"  {name}: {label}: {case[-1].get('step_s', float('nan')) * 1e3:.1f} ms "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        planner = next(r for r in case if r["plan"] == "planner")
        for r in case:
            r.update(model=name, cluster=ctext, batch=batch, seq=seq, fits=r.get("peak_bytes", float("inf")) <= 80 * GiB)
            if "step_s" in r:
                r["tokens_per_s_per_gpu"] = tokens / r["step_s"] / world
                if r is not planner and "step_s" in planner:
                    r["planner_over_it"] = planner["step_s"] / r["step_s"]
        rows += case
    print(f"\n{'model':15} {'plan':52} {'mesh':20} {'step s':>8} {'tok/s/GPU':>9} {'MFU':>6} {'peak GiB':>8} "
          f"{'fits':>4} {'planner/it':>10} {'plan s':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:15} {r['plan']:52} n/a: {r['error'][:150]}")
            continue
        label = r["plan"] + (f" ({r['roles']})" if "roles" in r else "")
        ratio = f"{r['planner_over_it']:.3f}" if "planner_over_it" in r else ""
        plan_s = f"{r['planning_s']:.0f}" if "planning_s" in r else ""
        print(f"{r['model']:15} {label[:52]:52} {r['mesh'][5:-1]:20} {r['step_s']:8.3f} "
              f"{r['tokens_per_s_per_gpu']:9.0f} {r['mfu'] * 100:5.1f}% {r['peak_bytes'] / GiB:8.1f} "
              f"{'yes' if r['fits'] else 'NO':>4} {ratio:>10} {plan_s:>6}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("bench_pipeline_gpu_tiny.json" if args.tiny else "bench_pipeline_gpu.json")
    path.write_text(json.dumps(rows, indent=1, default=str))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
