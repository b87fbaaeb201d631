"""Pipelines beside data parallelism on gloo: PP x DDP, PP x FSDP2, interleaved PP x DDP on 4 ranks, PP x TP x DP and
PP x HSDP on 8, against one process: the loss, every parameter's gradient and the parameters after SGD steps.

Reference semantics (NOTE [pipeline loss] in treadle.forms.pipeline.runtime): each data-parallel replica runs its
own pipeline on its quarter / half of the batch; every micro-batch holds the same number of tokens, so the mean
over replicas of their mean micro-batch losses is the single-process loss on the whole batch, and the averaged
gradients are its gradients.
"""

from __future__ import annotations

import pytest
import torch

import treadle
from treadle import Mesh, create_schedule
from treadle.forms.pipeline.conflicts import shared_stage_conflict
from treadle.models import megatron
from treadle.runtime.params import local_slice
from treadle.testing import spawn
from tiny_models import lm_inputs, tiny_gpt2

BATCH, SEQ, STEPS, LR = 8, 16, 2, 0.1


def _inputs():
    return {**lm_inputs(BATCH, SEQ, seed=3), "use_cache": False}


def _reference() -> dict:
    model = tiny_gpt2(4)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {"losses": [], "grads": []}
    for _ in range(STEPS):
        loss = model(**_inputs()).loss
        loss.backward()
        out["losses"].append(float(loss.detach()))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})
        opt.step()
        opt.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    out["names"] = [n for n, _ in model.named_parameters()]
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _rank(rank: int, world: int, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        mesh = Mesh(tuple(case["mesh"]), tuple(case["names"]))
        sch = create_schedule(tiny_gpt2(4), mesh=mesh)
        if "tp" in case["names"]:
            megatron(sch, tp="tp", vocab_parallel_head=False)
        for c in case["cuts"]:
            sch[f"transformer.h.{c}"].cut_pipeline_stage()
        sch.data_parallel(**case["dp"])
        sch.pipeline(axis="pp", schedule=case["schedule"], n_microbatches=case["mb"], example_inputs=_inputs())
        st = sch.view()
        before = {n: st.shards_of(p) for n, p in st.model.named_parameters(remove_duplicate=False)}
        pipe = treadle.build(sch)
        dp = sch.view().data_parallel
        n, i = dp.size(mesh), dp.local_index(mesh)
        inputs = {k: (v.chunk(n)[i] if torch.is_tensor(v) else v) for k, v in _inputs().items()}
        params = pipe.param_dict()
        shards = {name: before[name] for name in params if before[name]}
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        res = {"losses": [], "grads": [], "coords": mesh.coordinate(rank), "shards": shards,
               "stages": pipe.local_stage_indices, "dtensor": [], "wrapped": [type(m).__name__ for m in pipe.stages]}
        for _ in range(STEPS):
            res["losses"].append(pipe.step(**inputs))
            res["grads"].append({k: _full(p.grad).clone() for k, p in params.items() if p.grad is not None})
            opt.step()
            opt.zero_grad()
        res["params"] = {k: _full(p.detach()).clone() for k, p in params.items()}
        res["dtensor"] = sorted(k for k, p in params.items() if type(p).__name__ != "Parameter" or hasattr(p, "placements"))
        out.append(res)
    return out


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, what
    err = float((got - want).abs().max())
    scale = float(want.abs().max())
    assert err <= 1e-6 + 2e-4 * scale, f"{what}: max abs err {err:.3e} vs scale {scale:.3e}"


def _check(case: dict, per_rank: list[dict], ref: dict, mesh: Mesh) -> None:
    sizes = dict(zip(mesh.names, mesh.shape))
    dp_axes = case["dp"]["axis"] if isinstance(case["dp"]["axis"], tuple) else (case["dp"]["axis"],)
    dp_axes = dp_axes + tuple(case["dp"].get("replicate", ()))
    seen: set[str] = set()
    for step in range(STEPS):
        # one loss per replica (the pipeline's ranks agree on it); their mean is the whole batch's loss
        per_replica: dict[tuple, float] = {}
        for res in per_rank:
            key = tuple(res["coords"][a] for a in dp_axes)
            per_replica.setdefault(key, res["losses"][step])
            assert res["losses"][step] == pytest.approx(per_replica[key], rel=1e-6), (case, key, step)
        mean = sum(per_replica.values()) / len(per_replica)
        assert mean == pytest.approx(ref["losses"][step], rel=1e-5, abs=1e-6), (case, step)
    for r, res in enumerate(per_rank):
        for step in range(STEPS):
            for name, g in res["grads"][step].items():
                want = ref["grads"][step][name]
                if name in res["shards"]:
                    want = local_slice(want, res["shards"][name], res["coords"], sizes)
                _close(g, want, f"{case['schedule']} {case['dp']} grad {name} step {step} rank {r}")
                seen.add(name)
        for name, p in res["params"].items():
            want = ref["params"][name]
            if name in res["shards"]:
                want = local_slice(want, res["shards"][name], res["coords"], sizes)
            _close(p, want, f"{case['schedule']} {case['dp']} parameter {name} after {STEPS} steps rank {r}")
    assert set(ref["names"]) <= seen, f"parameters without a gradient: {set(ref['names']) - seen}"


@pytest.mark.slow
def test_pp2_x_dp2_ddp_fsdp_and_interleaved(reference):
    cases = [dict(mesh=[2, 2], names=["pp", "dp"], cuts=[1], schedule="1f1b", mb=2, dp=dict(axis="dp", shard=False)),
             dict(mesh=[2, 2], names=["pp", "dp"], cuts=[1], schedule="gpipe", mb=2, dp=dict(axis="dp", shard=True)),
             dict(mesh=[2, 2], names=["pp", "dp"], cuts=[0, 1, 2], schedule="interleaved_1f1b", mb=2,
                  dp=dict(axis="dp", shard=False))]
    out = spawn(_rank, 4, cases, timeout_s=300)
    for i, case in enumerate(cases):
        _check(case, [out[r][i] for r in range(4)], reference, Mesh((2, 2), ("pp", "dp")))
    assert out[0][0]["wrapped"] == ["Stage0"]  # shard=False: the replicas average after the step
    assert out[0][1]["dtensor"], "FSDP2 shards the stage's parameters"
    assert out[0][2]["stages"] == [0, 2]


@pytest.mark.slow
def test_pp2_x_tp2_x_dp2_and_pp2_x_hsdp_on_8_ranks(reference):
    cases = [dict(mesh=[2, 2, 2], names=["pp", "dp", "tp"], cuts=[1], schedule="1f1b", mb=2,
                  dp=dict(axis="dp", shard=True)),
             dict(mesh=[2, 2, 2], names=["pp", "r", "s"], cuts=[1], schedule="1f1b", mb=2,
                  dp=dict(axis="s", shard=True, replicate="r"))]
    out = spawn(_rank, 8, cases, timeout_s=480)
    for i, case in enumerate(cases):
        _check(case, [out[r][i] for r in range(8)], reference, Mesh((2, 2, 2), tuple(case["names"])))
    assert any(out[r][0]["shards"] for r in range(8))  # tensor-parallel shards inside the stages


def test_data_parallel_refuses_a_parameter_two_stages_of_one_rank_share():
    readers = [("transformer.wte.weight", {0, 3}), ("transformer.h.0.attn.c_attn.weight", {0})]
    msg = shared_stage_conflict("interleaved_1f1b", 3, readers, "ddp over dp")
    assert msg is not None and "stages 0 and 3" in msg and "transformer.wte.weight" in msg and "ddp over dp" in msg
    assert shared_stage_conflict("interleaved_1f1b", 2, readers, "ddp over dp") is None  # stage 3 is on rank 1


def _pp_axis_as_dp(rank: int, world: int) -> str:
    sch = create_schedule(tiny_gpt2(4), mesh=Mesh((2,), ("pp",)))
    sch["transformer.h.1"].cut_pipeline_stage()
    sch.data_parallel(axis="pp", shard=False)
    sch.pipeline(axis="pp", n_microbatches=2, example_inputs=_inputs())
    try:
        treadle.build(sch)
    except treadle.BuildError as exc:
        return str(exc)
    return "built"


def _uneven(rank: int, world: int) -> str:
    sch = create_schedule(tiny_gpt2(4), mesh=Mesh((2, 2), ("pp", "dp")))
    sch["transformer.h.1"].cut_pipeline_stage()
    sch.data_parallel(axis="dp", shard=False)
    sch.pipeline(axis="pp", n_microbatches=8, example_inputs=_inputs())
    try:
        treadle.build(sch)
    except treadle.BuildError as exc:
        return str(exc)
    return "built"


@pytest.mark.slow
def test_pipeline_axis_cannot_be_data_parallel_and_the_batch_must_split():
    msgs = spawn(_pp_axis_as_dp, 2, timeout_s=120)
    assert "axis 'pp' carries the stages and cannot also be a data-parallel axis" in msgs[0]
    msgs = spawn(_uneven, 4, timeout_s=120)
    assert "batch 8 does not split into 2 data-parallel replicas (dp) x 8 micro-batches" in msgs[0]
