"""The golden plans and prices: what the planner and `treadle.price` answer on fixed cases, written once before a
refactor and compared after it (`tests/test_golden.py`: the same decisions, step and peak within 1e-9).

Cases (issue "One module per parallel form"): the README's Llama-3-8B plan on 8x8:h100 (every logical mesh, 80 GiB),
Llama-2-70B on 8x8:h100, GPT-2-XL on 1x8:h100, the demo's GPT-2 on 2x2 CPU (the hand Megatron schedule's price,
the plan in its memory and the plan without a budget) on the fixed cluster file `cpu_2x2_cluster.json`, and the
schedules of `bench/bench_planner.py recipes`, each priced.

    .venv/bin/python tests/golden/make_golden.py            # rewrite tests/golden/golden.json
    .venv/bin/python tests/golden/make_golden.py --check    # compare, print the differences
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden.json"
CPU_CLUSTER = HERE / "cpu_2x2_cluster.json"
GiB = 2**30
REL_TOL = 1e-9


def _plan_entry(plan) -> dict:
    est = plan.estimated
    out = {"mesh": [list(plan.cluster.mesh.shape), list(plan.cluster.mesh.names)], "roles": plan.roles,
           "decisions": [str(d) for d in plan.decisions], "schedule": plan.schedule.to_python().splitlines(),
           "solver_step_s": est.step_s, "solver_peak_bytes": est.peak_bytes,
           "checkpoints": plan.solver["checkpoints"]}
    if plan.price is not None:
        out["price_step_s"] = plan.price["step_s"]
        out["price_peak_bytes"] = plan.price["peak_bytes"]
    return out


def _price_entry(p) -> dict:
    return {"step_s": p.step_s, "peak_bytes": p.peak_bytes}


def gpu_cases(only: str | None = None) -> dict:
    """The README's three GPU plans and the bench's recipe schedules, each priced."""
    sys.path.insert(0, str(HERE.parents[1] / "bench"))
    import bench_planner as bp

    from treadle.cost.cluster import enumerate_meshes, parse_cluster
    from treadle.errors import PlanError
    from treadle.mesh import Mesh
    from treadle.planner.meshes import search_clusters
    from treadle.planner import plan_model
    from treadle import price
    from treadle.schedule.core import create_schedule

    out = {}
    for name, ctext, batch, seq in bp.RECIPE_CASES:
        if only and only != name:
            continue
        t0 = time.perf_counter()
        physical = parse_cluster(ctext)
        nodes, dpn = physical.mesh.shape
        model, inputs = bp._build(name, batch, seq)
        plan = plan_model(model, inputs, cluster=search_clusters(physical), memory_budget_bytes=80 * GiB)
        case = {"plan": _plan_entry(plan), "recipes": {}}
        meshes = enumerate_meshes(nodes, dpn, intra=physical.links[1], inter=physical.links[0],
                                  device=physical.device, max_ndim=2)
        for label, shape, names, apply in bp._recipes(name, nodes * dpn, dpn):
            fresh, _ = bp._build(name, batch, seq)
            sch = create_schedule(fresh, mesh=Mesh(shape, names))
            try:
                apply(sch)
            except Exception as exc:  # noqa: BLE001 - a recipe the model cannot take, as the bench lists it
                case["recipes"][label] = {"error": type(exc).__name__}
                continue
            try:
                case["recipes"][label] = _price_entry(price(sch, inputs, bp._recipe_cluster(meshes, shape, names)))
            except PlanError as exc:  # a batch the data-parallel axis does not divide, as the bench lists it
                case["recipes"][label] = {"error": str(exc)}
        out[f"{name} {ctext}"] = case
        print(f"  {name} {ctext}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def demo_cases() -> dict:
    """The demo's three schedules on the fixed 2x2 CPU cluster (examples/demo_gpt2.py, without training)."""
    sys.path.insert(0, str(HERE.parents[1] / "examples"))
    from demo_gpt2 import gpt2

    import treadle
    from treadle.cost.cluster import ClusterSpec
    from treadle.mesh import Mesh
    from treadle.models import megatron
    from treadle.planner import plan_model

    cluster = ClusterSpec.from_json(CPU_CLUSTER.read_text())
    ids = torch.randint(0, 1024, (8, 64), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    sch = treadle.create_schedule(gpt2(), mesh=Mesh((2, 2), ("dp", "tp")))
    megatron(sch, tp="tp", dp="dp", checkpoint_fraction=0.5)
    hand = treadle.price(sch, inputs, cluster)
    plan = plan_model(gpt2(), inputs, cluster=cluster, memory_budget_bytes=hand.peak_bytes, price_top=4)
    free = plan_model(gpt2(), inputs, cluster=cluster, price_top=4)
    return {"demo gpt2 2x2:cpu": {"hand": _price_entry(hand), "plan": _plan_entry(plan),
                                  "plan without budget": _plan_entry(free)}}


def form_cases() -> dict:
    """Each parallel form on the fixed 2x2 CPU cluster, tiny LLaMA (grouped-query attention, rotary buffers):
    hand schedules priced (Megatron + sequence parallel + vocab-parallel loss, DDP over both axes, HSDP, ZeRO-3
    without reshard) and the planner with data parallelism fixed to each kind (DDP, ZeRO-3 / HSDP, none)."""
    import treadle
    from treadle.cost.cluster import ClusterSpec
    from treadle.mesh import Mesh
    from treadle.models import megatron
    from treadle.models.zoo import named_model
    from treadle.planner import plan_model

    cluster = ClusterSpec.from_json(CPU_CLUSTER.read_text())
    mesh = Mesh((2, 2), ("dp", "tp"))

    def fresh():
        torch.manual_seed(0)
        return named_model("tiny-llama", batch=8, seq=32, dropout=False)

    hand = {
        "megatron sp vocab ckpt": lambda s: megatron(s, tp="tp", dp="dp", sequence_parallel=True,
                                                     checkpoint_fraction=0.5),
        "megatron zero3": lambda s: megatron(s, tp="tp", dp="dp", zero3=True),
        "ddp dp,tp": lambda s: s.data_parallel(axis=("dp", "tp")),
        "hsdp": lambda s: s.data_parallel(axis="tp", shard=True, replicate="dp"),
        "zero3 keep": lambda s: s.data_parallel(axis=("dp", "tp"), shard=True, reshard_after_forward=False),
    }
    out: dict = {}
    for label, apply in hand.items():
        model, inputs = fresh()
        sch = treadle.create_schedule(model, mesh=mesh)
        apply(sch)
        out[f"price {label}"] = _price_entry(treadle.price(sch, inputs, cluster))
    # the forms before pipelines were planned (pp_axis=None keeps these plans the same), then the pipeline form's
    for label, kw in {"ddp": dict(dp_axis="dp", zero=False), "zero": dict(zero=True, reshard_after_forward=None),
                      "no dp": dict(dp_axis=None), "budget": dict(memory_budget_bytes=3 * 2**20),
                      "tight budget": dict(memory_budget_bytes=2.4 * 2**20)}.items():
        model, inputs = fresh()
        out[f"plan {label}"] = _plan_entry(plan_model(model, inputs, cluster=cluster, price_top=2, pp_axis=None, **kw))
    for label, kw in {"pipeline tp": dict(pp_axis="tp"),
                      "pipeline tp budget": dict(pp_axis="tp", memory_budget_bytes=3 * 2**20)}.items():
        model, inputs = fresh()
        out[f"plan {label}"] = _plan_entry(plan_model(model, inputs, cluster=cluster, price_top=2, **kw))
    return {"forms tiny-llama 2x2:cpu": out}


# the cases in parts that the test runs apart (two files, so that the test workers share them): name -> compute
PARTS = {"demo": demo_cases, "forms": form_cases, "gpu llama-3-8b": lambda: gpu_cases("llama-3-8b"),
         "gpu llama-2-70b": lambda: gpu_cases("llama-2-70b"), "gpu gpt2-xl": lambda: gpu_cases("gpt2-xl")}


def compute() -> dict:
    return {k: v for part in PARTS.values() for k, v in part().items()}


def differences(want, got, where: str = "") -> list[str]:
    """Every place `got` differs from `want`: floats beyond REL_TOL, anything else unequal."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{where}: missing {k!r}" for k in want if k not in got]
        out += [f"{where}: unexpected {k!r}" for k in got if k not in want]
        for k in want:
            if k in got:
                out += differences(want[k], got[k], f"{where}/{k}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{where}: {len(want)} entries, now {len(got)}: {sorted(set(map(str, want)) ^ set(map(str, got)))[:6]}"]
        return [d for i, (a, b) in enumerate(zip(want, got)) for d in differences(a, b, f"{where}[{i}]")]
    if isinstance(want, float) or isinstance(got, float):
        if isinstance(want, (int, float)) and isinstance(got, (int, float)) and (
                math.isclose(want, got, rel_tol=REL_TOL, abs_tol=0.0) or want == got):
            return []
        return [f"{where}: {want!r} -> {got!r}"]
    return [] if want == got else [f"{where}: {want!r} -> {got!r}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with golden.json instead of writing it")
    args = ap.parse_args()
    t0 = time.perf_counter()
    got = compute()
    print(f"computed in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.check:
        diff = differences(json.loads(GOLDEN.read_text()), got)
        print("\n".join(diff) or "same as golden.json")
        sys.exit(1 if diff else 0)
    GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
