"""Every plan of ``bench_planner.py recipes``, verified numerically on CPU with a shrunken config of the same architecture.

For each case of the recipes table — Llama-3-8B on 8x8 H100 (batch 32, seq 4096), Llama-2-70B on 8x8 H100 (batch
16, seq 4096), GPT-2-XL on 1x8 H100 (batch 32, seq 1024) — this builds the very schedules the table prices:
the planner's plan (`plan_model` on the CLI's mesh search, `treadle.cli.plan.search_clusters`, bf16, 80 GiB)
and each published-style recipe (`bench_planner._recipes`: Megatron TP x DP + SP (+ selective checkpointing),
torchtitan FSDP2 x TP + SP + SAC, FSDP2 over all, DDP) on the full-size model (fake tensors). Each schedule
is then carried onto a shrunken model of the same architecture (`treadle.verify.shrink.carry_schedule`): the
same records — shards (module, parameter, dim, blocks, axis), syncs, shard_attr, reduce_grads, fork_rng, the
vocab-parallel loss, data-parallel roles (DDP / FSDP2 / HSDP, reshard flag) and checkpoints (proportional count,
same primitive) — replayed on 2 blocks (block 0 from block 0, block 1 from the last block; every large block's
primitives must equal a carried block's, else it is refused), on a gloo mesh of at most 8 CPU ranks with the
same axis names (tensor axes keep their size up to 4, data-parallel axes shrink to fill 8 ranks: (16, 4) ->
(2, 4), (8, 8) -> (2, 4), (8,) stays). `treadle.verify` then compares loss, every module output and output
gradient, every parameter gradient and the parameters after one AdamW step with the single-process original.

Shrunken configs (chosen by the shrunken tensor size t, so every divisibility the plan relies on still holds):
LLaMA keeps its q-heads-per-kv-head ratio and whether ``num_key_value_groups == num_key_value_heads`` (Llama-2-70B:
64/8 -> 16/4 at t=4; Llama-3-8B: 32/8 -> 32/8, kv heads a multiple of t), hidden 128, FFN/hidden 3.5, vocab 256
(divisible, as 128256 and 32000 are by 64); GPT-2 keeps 25 heads (head dim 8, hidden 200) and an odd vocabulary
(257, as 50257). Two blocks, seq 16, one sequence per data-parallel rank (at least 2). Numerics in fp32 on CPU
(the table is bf16 on GPUs), dropout probabilities 0 (ranks with forked random streams cannot match a single
process otherwise), token-id inputs (no input gradient exists; the embedding output's gradient is checked).
A row the table lists as n/a (the recipe does not apply, or the batch does not divide over its data-parallel
axes) is listed with the reason and not verified.

``--stress`` adds, for each LLaMA row, the same schedule verified at 2 kv heads per tensor rank with an attention
mask (right padding), which sends Hugging Face attention through ``repeat_kv(key, num_key_value_groups)``
instead of SDPA's ``enable_gqa``: a ``shard_attr`` on the wrong attribute shows there, where one kv head per rank
(SDPA broadcasting it over the rank's query heads) hides it.

Prints a table and writes bench/results/verify_planner_plans.json. ``--tiny`` runs it on the recipes table's
tiny cases (``bench_planner.py recipes --tiny``); ``--cases`` picks models; ``--plans`` picks rows by substring.

    .venv/bin/python bench/verify_planner_plans.py [--tiny] [--stress] [--cases llama-2-70b,gpt2-xl] [--plans planner]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench_planner import RECIPE_CASES, TINY_CASES, _build, _recipes

from treadle.errors import TreadleError
from treadle.mesh import Mesh

RESULTS = Path(__file__).resolve().parent / "results"
GiB = 2**30
MAX_RANKS = 8
BLOCKS = 2
SEQ = 16
HEAD_HIDDEN = 128  # shrunken LLaMA hidden size
GPT2_HEAD_DIM = 8
# --stress (LLaMA rows): 2 kv heads per tensor rank (the table's meshes give 1 or 2) and an attention mask, so
# Hugging Face expands kv heads with `repeat_kv(key, num_key_value_groups)` instead of SDPA's enable_gqa
STRESS = {"kv_per_rank": 2, "pad": 2}
STRESS_TEXT = "2 kv heads per tensor rank, attention_mask hiding the last 2 tokens of each row (repeat_kv path)"


# ----------------------------------------------------------------------------- shrinking
def data_parallel_axes(sch) -> tuple[str, ...]:
    dp = sch._state.data_parallel
    return tuple(dp.axes) if dp is not None else ()


def shrunken_mesh(mesh: Mesh, dp_axes: tuple[str, ...], max_ranks: int = MAX_RANKS) -> Mesh:
    """Same axis names, at most `max_ranks` ranks: tensor axes keep their size up to max_ranks/2 (max_ranks
    without data parallelism), the data-parallel axes share what is left (outer ones 2, the innermost the rest)."""
    tp = [a for a in mesh.names if a not in dp_axes and mesh.size(a) > 1]
    budget = max_ranks // (2 if dp_axes else 1)
    sizes = {a: 1 for a in mesh.names}
    for a in tp:
        sizes[a] = min(mesh.size(a), budget)
        budget //= sizes[a]
    left = max_ranks // math.prod(sizes[a] for a in tp)
    live_dp = [a for a in mesh.names if a in dp_axes and mesh.size(a) > 1]
    for k, a in enumerate(live_dp):
        outer = len(live_dp) - 1 - k  # axes after this one
        sizes[a] = min(mesh.size(a), 2 if outer else left)
        left //= sizes[a]
    return Mesh(tuple(sizes[a] for a in mesh.names), tuple(mesh.names))


def shrunken_config(big_config, tp: int, *, kv_per_rank: int | None = None) -> tuple[Any, str]:
    """(config, short description) of a 2-block model of the same architecture as `big_config` whose sizes keep
    the divisibility of the large one over tensor size `tp` (see the module doc). `kv_per_rank` (LLaMA) fixes the
    kv heads at `kv_per_rank` x `tp` instead. Raises ValueError for a family without a rule."""
    cfg = type(big_config)(**big_config.to_dict())
    kind = big_config.model_type
    base = max(tp, 2)
    if kind == "llama":
        q, kv = big_config.num_attention_heads, big_config.num_key_value_heads
        groups = q // kv
        if kv_per_rank is not None:
            kv_s = tp * kv_per_rank
            q_s = kv_s * kv_s if groups == kv else groups * kv_s
        elif groups == kv:  # Llama-2-70B: repeat_kv's group count equals the kv head count; keep the collision
            kv_s, q_s = base, base * base
        else:
            kv_s = base if base != groups else 2 * base
            q_s = groups * kv_s
        head_dim = max(2, HEAD_HIDDEN // q_s)
        hidden = q_s * head_dim
        ratio = big_config.intermediate_size / big_config.hidden_size
        unit = 8 * base
        ffn = max(unit, round(ratio * hidden / unit) * unit)
        vocab = 256 if big_config.vocab_size % 8 == 0 else 257
        for k, v in dict(num_hidden_layers=BLOCKS, hidden_size=hidden, num_attention_heads=q_s,
                         num_key_value_heads=kv_s, head_dim=head_dim, intermediate_size=ffn, vocab_size=vocab,
                         attention_dropout=0.0, use_cache=False).items():
            setattr(cfg, k, v)
        return cfg, f"L{BLOCKS} h{hidden} q{q_s}/kv{kv_s} ffn{ffn} V{vocab}"
    if kind == "gpt2":
        heads = big_config.n_head
        hidden = heads * GPT2_HEAD_DIM
        vocab = 256 if big_config.vocab_size % 8 == 0 else 257
        for k, v in dict(n_layer=BLOCKS, n_embd=hidden, n_head=heads, vocab_size=vocab, n_inner=None,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                         bos_token_id=vocab - 1, eos_token_id=vocab - 1).items():  # the last id, as 50256
            setattr(cfg, k, v)
        return cfg, f"L{BLOCKS} h{hidden} heads{heads} V{vocab}"
    raise ValueError(f"no shrink rule for model_type {kind!r}; rules: llama, gpt2")


def shrunken_model(big_model, tp: int, *, seed: int = 0, kv_per_rank: int | None = None):
    """(model in fp32 with random weights, config description) of `shrunken_config`."""
    cfg, desc = shrunken_config(big_model.config, tp, kv_per_rank=kv_per_rank)
    cfg._attn_implementation = big_model.config._attn_implementation
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        torch.manual_seed(seed)
        model = type(big_model)(cfg).float()
    finally:
        torch.set_default_dtype(previous)
    model.train()
    return model, desc


def lm_inputs(vocab: int, batch: int, seq: int = SEQ, seed: int = 0, *, pad: int = 0) -> dict[str, torch.Tensor]:
    """Token ids and labels; `pad` > 0 adds an attention mask hiding the last `pad` tokens of every row (right
    padding: no query row is fully masked), which sends Hugging Face attention through its masked path."""
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    out = {"input_ids": ids, "labels": ids.clone()}
    if pad:
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[:, seq - pad:] = 0
        out["attention_mask"] = mask
    return out


# ----------------------------------------------------------------------------- one row
def _errors(report) -> tuple[float, float]:
    """(max abs error over the loss and every module output, over every gradient: outputs' and parameters')."""
    def worst(kinds) -> float:
        vals = [c.diff.max_abs for c in report.checks if c.kind in kinds and not math.isnan(c.diff.max_abs)]
        return max(vals) if vals else math.nan

    return worst(("loss", "output")), worst(("output_grad", "input_grad", "param_grad"))


def verify_carried(sch, big_model, *, timeout_s: float = 900.0, kv_per_rank: int | None = None,
                   pad: int = 0) -> dict:
    """Carry `sch` (a schedule of `big_model`, unbuilt) onto its shrunken model and mesh and verify it
    (`kv_per_rank`, `pad`: the stress variant, see `STRESS`). Returns the row's figures (the error, if
    carrying or verifying fails, under ``error``)."""
    from treadle.verify.shrink import carry_schedule
    from treadle.verify.verify import verify

    dp_axes = data_parallel_axes(sch)
    mesh = shrunken_mesh(sch.mesh, dp_axes)
    tp = math.prod(mesh.size(a) for a in mesh.names if a not in dp_axes)
    model, desc = shrunken_model(big_model, tp, kv_per_rank=kv_per_rank)
    dp_n = math.prod(mesh.size(a) for a in dp_axes) if dp_axes else 1
    inputs = lm_inputs(model.config.vocab_size, max(2, dp_n), pad=pad)
    row: dict[str, Any] = {"small_config": desc, "small_mesh": str(mesh), "small_batch": max(2, dp_n),
                           "small_seq": SEQ, "dtype": "float32"}
    try:
        carried = carry_schedule(sch, model, mesh=mesh)
    except TreadleError as exc:
        row["error"] = f"carry: {type(exc).__name__}: {exc}"
        return row
    row.update(carried=carried.summary(), carried_block_records=list(carried.block_records),
               carried_shared_records=list(carried.shared_records))
    t0 = time.perf_counter()
    try:
        report = verify(carried.schedule, inputs, steps=1, timeout_s=timeout_s, raise_on_mismatch=False)
    except TreadleError as exc:
        row["error"] = f"verify: {type(exc).__name__}: {exc}"
        return row
    fwd, grad = _errors(report)
    row.update(verify_s=time.perf_counter() - t0, ok=report.ok, fwd_max_abs=fwd, grad_max_abs=grad,
               n_checks=len(report.checks), n_failed=len(report.failures()),
               first_divergence=report.first_divergence, failures=[str(c) for c in report.failures()[:10]],
               losses=report.losses, ref_losses=report.ref_losses)
    if report.error is not None:
        row["error"] = report.error
    return row


# ----------------------------------------------------------------------------- the table's schedules
def big_schedules(name: str, ctext: str, batch: int, seq: int):
    """(label, schedule or None, model, reason) for each row of the recipes table of one case, built exactly as
    `bench_planner.bench_recipes` builds them (the planner's plan first)."""
    from treadle.cost.cluster import parse_cluster
    from treadle.errors import PlanError
    from treadle.planner.meshes import search_clusters
    from treadle.planner import plan_model
    from treadle.runtime.batch import check_batch
    from treadle.schedule.core import create_schedule

    physical = parse_cluster(ctext)
    nodes, dpn = physical.mesh.shape
    model, inputs = _build(name, batch, seq)
    t0 = time.perf_counter()
    try:
        plan = plan_model(model, inputs, cluster=search_clusters(physical), memory_budget_bytes=80 * GiB)
        print(f"  {name}: planner {plan.cluster.mesh} {plan.roles} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
        yield f"planner ({plan.roles})", plan.schedule, model, None
    except PlanError as exc:
        yield "planner", None, model, f"no plan: {exc}"
    for label, shape, names, apply in _recipes(name, nodes * dpn, dpn):
        fresh, _ = _build(name, batch, seq)
        sch = create_schedule(fresh, mesh=Mesh(shape, names))
        try:
            apply(sch)
        except Exception as exc:  # as bench_planner: a recipe the model cannot take is listed with why
            yield label, None, sch, f"recipe does not apply: {type(exc).__name__}: {exc}"
            continue
        dp = sch._state.data_parallel
        try:
            check_batch(inputs, dp.size(sch.mesh) if dp else 1, axis=dp.label() if dp else None, where="price")
        except TreadleError as exc:
            yield label, None, sch, f"not priced in the table: {exc}"
            continue
        yield label, sch, fresh, None


def run(cases, plans: list[str] | None, timeout_s: float, stress: bool = False) -> list[dict]:
    rows = []
    for name, ctext, batch, seq in cases:
        for label, sch, model, reason in big_schedules(name, ctext, batch, seq):
            if plans and not any(p.lower() in label.lower() for p in plans):
                continue
            row: dict[str, Any] = {"model": name, "cluster": ctext, "batch": batch, "seq": seq, "plan": label}
            if sch is None:
                row["skipped"] = reason
                if hasattr(model, "mesh"):
                    row["mesh"] = str(model.mesh)
                rows.append(row)
                continue
            row["mesh"] = str(sch.mesh)
            variants = [(row, {})]
            if stress and model.config.model_type == "llama":
                variants.append(({**row, "plan": f"stress: {label}", "stress": STRESS_TEXT}, STRESS))
            for r, kw in variants:
                t0 = time.perf_counter()
                r.update(verify_carried(sch, model, timeout_s=timeout_s, **kw))
                status = "ok" if r.get("ok") else "FAILED"
                print(f"  {name}: {r['plan']}: {status} ({time.perf_counter() - t0:.0f} s)"
                      + (f": {r['error'][:200]}" if "error" in r else ""), file=sys.stderr, flush=True)
                rows.append(r)
    return rows


def _mesh_text(m: str) -> str:
    return m.removeprefix("Mesh(").removesuffix(")")


def print_table(rows: list[dict]) -> None:
    print("\nEach plan of the recipes table, carried onto a shrunken model of the same architecture and verified "
          "on gloo CPU ranks in fp32 (max abs errors vs the single-process original; 'carried' below each row)")
    print(f"{'model':11} {'plan':46} {'big mesh':16} {'shrunken config':30} {'small mesh':12} {'fwd err':>9} "
          f"{'grad err':>9} {'pass':>6}")
    for r in rows:
        head = f"{r['model']:11} {r['plan'][:46]:46} {_mesh_text(r.get('mesh', '')):16}"
        if "skipped" in r:
            print(f"{head} n/a: {r['skipped'][:120]}")
            continue
        fwd = f"{r['fwd_max_abs']:.2e}" if not math.isnan(r.get("fwd_max_abs", math.nan)) else "-"
        grad = f"{r['grad_max_abs']:.2e}" if not math.isnan(r.get("grad_max_abs", math.nan)) else "-"
        status = "yes" if r.get("ok") else "NO"
        print(f"{head} {r['small_config'][:30]:30} {_mesh_text(r['small_mesh']):12} {fwd:>9} {grad:>9} {status:>6}")
        if "carried" in r:
            print(f"{'':12}carried: {r['carried']}")
        if not r.get("ok"):
            why = r.get("error") or r.get("first_divergence") or "; ".join(r.get("failures", [])[:2])
            print(f"{'':12}why: {str(why)[:400]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the recipes table's tiny cases (a smoke test of the script)")
    ap.add_argument("--cases", default="", help="comma-separated model names of the cases to run (default: all)")
    ap.add_argument("--plans", default="", help="comma-separated substrings of the rows to verify (default: all)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per verification (default 900)")
    ap.add_argument("--stress", action="store_true", help="also verify each LLaMA row at 2 kv heads per rank with "
                    "a padding mask (Hugging Face's repeat_kv path instead of SDPA's enable_gqa)")
    args = ap.parse_args()
    cases = TINY_CASES if args.tiny else RECIPE_CASES
    if args.cases:
        want = [c.strip() for c in args.cases.split(",") if c.strip()]
        known = [c[0] for c in cases]
        bad = [w for w in want if w not in known]
        if bad:
            ap.error(f"unknown cases {bad}; choose from {known}")
        cases = tuple(c for c in cases if c[0] in want)
    plans = [p.strip() for p in args.plans.split(",") if p.strip()] or None
    t0 = time.perf_counter()
    rows = run(cases, plans, args.timeout, args.stress)
    print_table(rows)
    verified = [r for r in rows if "skipped" not in r]
    print(f"\n{sum(1 for r in verified if r.get('ok'))} of {len(verified)} verified schedules pass "
          f"({len(rows) - len(verified)} rows n/a); {time.perf_counter() - t0:.0f} s")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("verify_planner_plans_tiny.json" if args.tiny else "verify_planner_plans.json")
    path.write_text(json.dumps({"rows": rows, "cases": [list(c) for c in cases]}, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
