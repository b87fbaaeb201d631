"""Pipeline parallelism on gloo: GPT-2 (4 layers) in 2 and 4 stages, GPipe / 1F1B / interleaved, and pp x tp.

Reference semantics (NOTE [pipeline loss] in treadle.forms.pipeline.runtime): the single-process model's loss on the
whole batch is the mean over its tokens; every micro-batch holds the same number of tokens, so it equals the
mean of the micro-batch losses. torch.distributed.pipelining sums the micro-batch gradients and, with
``scale_grads=True`` (its default), divides them by the micro-batch count: those are the gradients of the
mean loss, compared with the reference as they are. With ``scale_grads=False`` they are ``n_microbatches``
times the reference, which one case checks explicitly.
"""

from __future__ import annotations

import pytest
import torch

import treadle
from treadle import Mesh, ScheduleError, create_schedule
from treadle.models import megatron
from treadle.runtime.params import local_slice
from treadle.testing import spawn
from tiny_models import lm_inputs, tiny_gpt2

BATCH, SEQ, STEPS, LR = 8, 16, 3, 0.1  # SGD: steps do not amplify rounding like Adam


def _inputs():
    inp = lm_inputs(BATCH, SEQ, seed=3)
    return {**inp, "use_cache": False}


def _model(untied: bool = False):
    model = tiny_gpt2(4)
    if untied:  # the head its own weight, equal to the embedding's at the start
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())
    return model


def _reference(untied: bool = False) -> dict:
    model = _model(untied)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {"losses": [], "grads": []}
    for _ in range(STEPS):
        loss = model(**_inputs()).loss
        loss.backward()
        out["losses"].append(float(loss.detach()))
        # every name of a parameter (lm_head.weight is transformer.wte.weight)
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})
        out["names"] = [n for n, _ in model.named_parameters()]
        opt.step()
        opt.zero_grad()
    return out


def _pp_rank(rank: int, world: int, cases: list[dict]) -> list[dict]:
    results = []
    for case in cases:
        model = _model(case.get("untied", False))
        mesh = Mesh(tuple(case["mesh"]), tuple(case["names"]))
        sch = create_schedule(model, mesh=mesh)
        if "tp" in case["names"]:
            megatron(sch, tp="tp", vocab_parallel_head=False)
        for c in case["cuts"]:
            sch[f"transformer.h.{c}"].cut_pipeline_stage()
        sch.pipeline(axis="pp", schedule=case["schedule"], n_microbatches=case["mb"], example_inputs=_inputs(),
                     scale_grads=case.get("scale_grads", True))
        pipe = treadle.build(sch)
        # unscaled gradients are n_microbatches x the reference: a learning rate divided by that count takes the
        # same SGD steps, so every later step stays comparable
        unscaled = not case.get("scale_grads", True)
        opt = torch.optim.SGD(pipe.parameters(), lr=LR / case["mb"] if unscaled else LR)
        res = {"losses": [], "grads": [], "coords": mesh.coordinate(rank), "stages": pipe.local_stage_indices,
               "shards": {}}
        params = pipe.param_dict()
        for name, p in params.items():
            if id(p) in sch._state.param_shards:
                res["shards"][name] = sch._state.param_shards[id(p)]
        for _ in range(STEPS):
            res["losses"].append(pipe.step(**_inputs()))
            res["grads"].append({n: p.grad.clone() for n, p in params.items() if p.grad is not None})
            opt.step()
            opt.zero_grad()
        res["tied"] = list(pipe.tied)
        res["tied_final"] = {n: p.detach().clone() for n, p in pipe.tied_params().items()}
        results.append(res)
    return results


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Max error relative to the tensor's scale (micro-batches sum in a different order than the full batch)."""
    assert got.shape == want.shape, what
    err = float((got - want).abs().max())
    scale = float(want.abs().max())
    assert err <= 1e-6 + 2e-4 * scale, f"{what}: max abs err {err:.3e} vs scale {scale:.3e}"


def _check(case: dict, per_rank: list[dict], ref: dict, mesh: Mesh) -> None:
    factor = 1.0 if case.get("scale_grads", True) else float(case["mb"])
    sizes = dict(zip(mesh.names, mesh.shape))
    seen: set[str] = set()
    for r, res in enumerate(per_rank):
        for step in range(STEPS):
            assert res["losses"][step] == pytest.approx(ref["losses"][step], rel=1e-5, abs=1e-6), (case, r, step)
            for name, g in res["grads"][step].items():
                want = ref["grads"][step][name] * factor
                if name in res["shards"]:
                    want = local_slice(want, res["shards"][name], res["coords"], sizes)
                _close(g, want, f"{case['schedule']} {name} step {step} rank {r}")
                seen.add(name)
    assert set(ref["names"]) <= seen, f"parameters without a gradient: {set(ref['names']) - seen}"


@pytest.mark.slow
def test_pipeline_world2_gpipe_1f1b_interleaved(reference):
    cases = [dict(mesh=[2], names=["pp"], cuts=[1], schedule="gpipe", mb=4),
             dict(mesh=[2], names=["pp"], cuts=[1], schedule="1f1b", mb=4),
             dict(mesh=[2], names=["pp"], cuts=[0, 1, 2], schedule="interleaved_1f1b", mb=4),
             dict(mesh=[2], names=["pp"], cuts=[1], schedule="1f1b", mb=2, scale_grads=False)]
    out = spawn(_pp_rank, 2, cases, timeout_s=240)
    for i, case in enumerate(cases):
        per_rank = [out[r][i] for r in range(2)]
        _check(case, per_rank, reference, Mesh((2,), ("pp",)))
        assert per_rank[0]["tied"] == ["transformer.wte.weight"]  # wte (stage 0) is lm_head (last stage)
        if case["cuts"] == [1]:  # after three steps the two copies are still equal
            torch.testing.assert_close(per_rank[0]["tied_final"]["transformer.wte.weight"],
                                       per_rank[1]["tied_final"]["lm_head.weight"], rtol=0, atol=0)
    assert out[0][2]["stages"] == [0, 2] and out[1][2]["stages"] == [1, 3]


@pytest.mark.slow
def test_pipeline_world4_stages_and_pp_x_tp(reference):
    cases = [dict(mesh=[4], names=["pp"], cuts=[0, 1, 2], schedule="gpipe", mb=4),
             dict(mesh=[4], names=["pp"], cuts=[0, 1, 2], schedule="1f1b", mb=4),
             dict(mesh=[2, 2], names=["pp", "tp"], cuts=[1], schedule="1f1b", mb=4)]
    out = spawn(_pp_rank, 4, cases, timeout_s=300)
    for i, case in enumerate(cases):
        mesh = Mesh(tuple(case["mesh"]), tuple(case["names"]))
        _check(case, [out[r][i] for r in range(4)], reference, mesh)
    assert any(out[r][2]["shards"] for r in range(4))  # tensor-parallel shards inside the stages


def test_cut_outside_a_sequential_container_is_rejected():
    sch = create_schedule(tiny_gpt2(2), mesh=Mesh((2,), ("pp",)))
    with pytest.raises(ScheduleError, match=r"cut_pipeline_stage at sch\['transformer.h.0.attn'\].*not an element "
                                            r"of a sequential container.*transformer.h"):
        sch["transformer.h.0.attn"].cut_pipeline_stage()
    with pytest.raises(ScheduleError, match=r"the last element of 'transformer.h' ends no stage"):
        sch["transformer.h.1"].cut_pipeline_stage()
    sch["transformer.h.0"].cut_pipeline_stage()
    with pytest.raises(ScheduleError, match="already cut here"):
        sch["transformer.h.0"].cut_pipeline_stage()


def test_pipeline_config_errors():
    sch = create_schedule(tiny_gpt2(4), mesh=Mesh((2,), ("pp",)))
    with pytest.raises(ScheduleError, match="no stage boundaries"):
        sch.pipeline(n_microbatches=2, example_inputs=_inputs())
    sch["transformer.h.0"].cut_pipeline_stage()
    sch["transformer.h.1"].cut_pipeline_stage()
    with pytest.raises(ScheduleError, match="3 stages do not spread evenly over mesh axis 'pp' of size 2"):
        sch.pipeline(n_microbatches=2, example_inputs=_inputs())
    sch["transformer.h.2"].cut_pipeline_stage()
    with pytest.raises(ScheduleError, match="batch 8, not divisible by n_microbatches=3"):
        sch.pipeline(n_microbatches=3, example_inputs=_inputs())
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'"):
        sch.pipeline(n_microbatches=2, schedule="zb", example_inputs=_inputs())


def test_stage_io_found_by_liveness_and_numerics_of_the_split():
    """Only the hidden states cross the cut (positions and masks depend on no input: recomputed per stage);
    the last stage hands the logits to the loss; chaining the stage graphs gives the model's loss."""
    from treadle.graph.capture import capture_export
    from treadle.forms.pipeline.stages import split_stages

    model = tiny_gpt2(4)
    inp = {**lm_inputs(2, SEQ, seed=5), "use_cache": False}
    leaves = [f"transformer.h.{i}" for i in range(4)] + ["transformer.wte", "transformer.wpe", "transformer.ln_f",
                                                        "lm_head"]
    gm = capture_export(model, leaves, (), inp, where="test", dynamic=False)
    stages, loss_gm, first = split_stages(gm, cut_paths=["transformer.h.1"], input_names=["input_ids", "labels"],
                                          target="labels")
    assert first == ["input_ids"]
    assert len(stages[0].outputs) == 1 and stages[1].inputs == stages[0].outputs
    assert len(stages[1].outputs) == 1
    calls0 = [n.target for n in stages[0].module.graph.nodes if n.op == "call_module"]
    assert calls0 == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1"]
    with torch.no_grad():
        (h,) = stages[0].module(inp["input_ids"])
        (logits,) = stages[1].module(h)
        loss = loss_gm(logits, inp["labels"])
        ref = model(**inp).loss
    torch.testing.assert_close(loss, ref)


def _pp_build_error(rank: int, world: int, kind: str) -> str:
    sch = create_schedule(_model(), mesh=Mesh((2,), ("pp",)))
    for c in (0, 1, 2):
        sch[f"transformer.h.{c}"].cut_pipeline_stage()
    sch.pipeline(axis="pp", schedule=kind, n_microbatches=4, example_inputs=_inputs())
    try:
        treadle.build(sch)
    except treadle.BuildError as exc:
        return str(exc)
    return "built"


@pytest.mark.slow
def test_pipeline_world2_looped_zero_bubble_and_v_schedules(reference):
    """The other schedules of torch.distributed.pipelining, built and trained: looped BFS and interleaved zero
    bubble (4 stages in a loop), ZBV and DualPipeV (4 stages in a V: rank 0 holds stages 0 and 3, so GPT-2's
    head is untied from its embedding here, see the next test)."""
    cases = [dict(mesh=[2], names=["pp"], cuts=[0, 1, 2], schedule=k, mb=4, untied=k in ("zbv", "dualpipev"))
             for k in ("looped_bfs", "interleaved_zb", "zbv", "dualpipev")]
    out = spawn(_pp_rank, 2, cases, timeout_s=300)
    untied = _reference(untied=True)
    for i, case in enumerate(cases):
        per_rank = [out[r][i] for r in range(2)]
        _check(case, per_rank, untied if case["untied"] else reference, Mesh((2,), ("pp",)))
    assert out[0][0]["stages"] == [0, 2] and out[0][2]["stages"] == [0, 3] and out[1][3]["stages"] == [1, 2]


@pytest.mark.slow
def test_a_v_schedule_refuses_a_parameter_two_stages_of_one_rank_share():
    """ZBV puts the tied embedding (stage 0) and head (stage 3) on rank 0; torch's split backward cannot
    share one weight between two stages of a rank (its gradient came out wrong), so build refuses, naming it."""
    (err, _) = spawn(_pp_build_error, 2, "zbv", timeout_s=120)
    assert err == ("pipeline: schedule 'zbv' places stages 0 and 3 on one rank and both read "
                   "transformer.wte.weight; its split backward (input, then weight gradients) cannot share a "
                   "parameter between two stages of a rank; untie it, or use a schedule that places them on "
                   "different ranks (interleaved_1f1b, looped_bfs)")


def test_the_capture_hands_a_leaf_the_none_its_eager_forward_hands_it():
    """NOTE [eager None arguments]: traced, LLaMA's forward builds an explicit causal mask; eagerly it passes
    None (SDPA's causal kernel). The captured graph passes None again, and the stages compute the model's loss."""
    from treadle.forms.pipeline.stages import eager_nones, hand_leaves_eager_nones, split_stages, stage_leaves
    from treadle.graph.capture import capture_export, record_leaf_outputs
    from tiny_models import tiny_llama

    model = tiny_llama(4)
    inp = {**lm_inputs(2, SEQ, seed=5), "use_cache": False}
    leaves = stage_leaves(model, "model.layers")
    with eager_nones(model, leaves) as nones:
        eager = record_leaf_outputs(model, leaves, inp)
    gm = capture_export(model, leaves, (), inp, where="test", dynamic=False, eager_outputs=eager)
    layer = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "model.layers.0")
    assert layer.kwargs["attention_mask"] is not None  # what tracing took
    done = hand_leaves_eager_nones(gm, nones)
    assert [d for d in done if d.endswith("attention_mask")] == [f"model.layers.{i}.attention_mask" for i in range(4)]
    assert layer.kwargs["attention_mask"] is None
    stages, loss_gm, _ = split_stages(gm, cut_paths=["model.layers.1"], input_names=["input_ids", "labels"],
                                      target="labels")
    with torch.no_grad():
        env = dict(zip(stages[0].outputs, stages[0].module(inp["input_ids"])))
        out = stages[1].module(*(env[k] for k in stages[1].inputs))
        loss = loss_gm(*out, inp["labels"])
        ref = model(**inp).loss
    torch.testing.assert_close(loss, ref)


def _captured(model, inp, container: str, cut: str):
    from treadle.forms.pipeline.stages import (eager_nones, hand_leaves_eager_nones, hand_leaves_standins,
                                               parameter_free_calls, split_stages, stage_leaves)
    from treadle.graph.capture import capture_export, record_leaf_outputs

    leaves = stage_leaves(model, container)
    with eager_nones(model, leaves) as nones, parameter_free_calls(model, leaves) as calls:
        eager = record_leaf_outputs(model, leaves, inp)
    gm = capture_export(model, leaves, (), inp, where="test", dynamic=False, eager_outputs=eager)
    hand_leaves_eager_nones(gm, nones)
    done = hand_leaves_standins(gm, model, calls)
    names = [k for k, v in inp.items() if torch.is_tensor(v)]
    stages, loss_gm, _ = split_stages(gm, cut_paths=[cut], input_names=names, target="labels")
    return done, stages, loss_gm


def test_a_leaf_that_reads_only_the_shape_of_its_input_is_recomputed_not_sent():
    """NOTE [metadata-only inputs]: LLaMA's rotary embedding reads the hidden states for their dtype only; the
    capture proves it (export leaves that input unused), so stage 1 recomputes cos / sin from positions and
    receives only the hidden states; the loss is the model's."""
    from tiny_models import tiny_llama

    model = tiny_llama(4)
    inp = {**lm_inputs(2, SEQ, seed=5), "use_cache": False}
    done, stages, loss_gm = _captured(model, inp, "model.layers", "model.layers.1")
    assert done == ["model.rotary_emb[0]"]
    assert len(stages[1].inputs) == 1  # the hidden states alone
    with torch.no_grad():
        env = dict(zip(stages[0].outputs, stages[0].module(inp["input_ids"])))
        out = stages[1].module(*(env[k] for k in stages[1].inputs))
        loss = loss_gm(*out, inp["labels"])
        ref = model(**inp).loss
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)


class _Shape(torch.nn.Module):  # reads its input's shape and dtype only
    def forward(self, x):
        return torch.arange(x.shape[1], dtype=x.dtype)[None, :, None].expand_as(x) * 0.01


class _Noise(torch.nn.Module):  # reads only the shape too, but draws random numbers: recomputing it would differ
    def forward(self, x):
        return torch.randn(x.shape) * 0.0


class _Scale(torch.nn.Module):  # parameter-free, reads the values
    def forward(self, x):
        return x * x.abs().amax()


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.shape, self.noise, self.scale = _Shape(), _Noise(), _Scale()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 32)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        pe, noise, s = self.shape(h), self.noise(h), self.scale(h)
        for b in self.blocks:
            h = b(h + pe + noise + s)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_only_a_proven_metadata_only_call_is_recomputed():
    """A parameter-free leaf that draws random numbers, or that reads its input's values, keeps its input and is
    sent; the one that reads the shape alone is recomputed."""
    torch.manual_seed(0)
    model = _Toy()
    ids = torch.randint(0, 32, (2, 6))
    done, stages, _ = _captured(model, {"input_ids": ids, "labels": ids.clone()}, "blocks", "blocks.0")
    assert done == ["shape[0]"]
    assert sorted(stages[1].inputs) == ["blocks_0", "noise", "scale"]  # the activation, noise, the scaled input
    assert any(n.op == "call_module" and n.target == "shape" for n in stages[1].module.graph.nodes)  # recomputed


def _pp_autocast_rank(rank: int, world: int) -> list[float]:
    from tiny_models import tiny_llama

    sch = create_schedule(tiny_llama(4), mesh=Mesh((2,), ("pp",)))
    sch["model.layers.1"].cut_pipeline_stage()
    sch.pipeline(axis="pp", schedule="1f1b", n_microbatches=2, example_inputs=_inputs())
    pipe = treadle.build(sch, autocast_dtype=torch.bfloat16)  # as treadle.run --precision bf16 builds it
    loss = pipe.step(**_inputs())
    grads = {n: p.grad.float().norm().item() for n, p in pipe.canonical_parameters().items() if p.grad is not None}
    dtypes = sorted({str(p.grad.dtype) for p in pipe.parameters() if p.grad is not None})
    sch = create_schedule(tiny_llama(4), mesh=Mesh((2,), ("pp",)))
    sch["model.layers.1"].cut_pipeline_stage()
    sch.pipeline(axis="pp", schedule="1f1b", n_microbatches=2, example_inputs=_inputs())
    plain = treadle.build(sch)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain.step(**_inputs())
        refused = ""
    except treadle.BuildError as exc:
        refused = str(exc)
    half = {k: (v[: BATCH // 2] if torch.is_tensor(v) else v) for k, v in _inputs().items()}
    try:
        plain.step(**half)
        wrong_rows = ""
    except treadle.BuildError as exc:
        wrong_rows = str(exc)
    return [loss, grads, dtypes, refused + "|" + wrong_rows]


@pytest.mark.slow
def test_a_pipeline_under_bf16_autocast_matches_the_autocast_model():
    """NOTE [pipeline autocast]: built with autocast_dtype=bf16 (treadle.run --precision bf16 without FSDP), the
    capture is traced and the stages' forwards run under torch.autocast: bf16 compute from fp32 weights, fp32
    gradients; loss and gradient norms match the single-process model under the same autocast to bf16's precision
    (the micro-batch split changes the rounding). A pipeline captured without autocast refuses a step under one;
    a step of other rows than the capture's is refused by name (not a raw view error from inside the stages)."""
    from tiny_models import tiny_llama

    (l0, g0, d0, r0), (l1, g1, d1, r1) = spawn(_pp_autocast_rank, 2, timeout_s=240)
    assert d0 == d1 == ["torch.float32"]
    assert r0 == r1 == ("pipeline: step under torch.autocast('cpu', dtype=torch.bfloat16) but the stages were "
                        "captured without autocast; build with build(sch, autocast_dtype=...) and step without an "
                        "autocast of your own|"
                        f"pipeline step: input 'input_ids' has {BATCH // 2} rows but the stages were captured for "
                        f"{BATCH} per replica (2 micro-batches of {BATCH // 2}: the example batch over the "
                        f"data-parallel replicas); pass {BATCH} rows, or rebuild with example inputs of this "
                        "replica's batch times the replica count")
    model = tiny_llama(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(**_inputs()).loss
    ref.backward()
    assert l0 == l1 and l0 == pytest.approx(float(ref), rel=2e-2)
    got = {**g0, **g1}
    want = {n: p.grad.float().norm().item() for n, p in model.named_parameters()}
    assert set(got) == set(want)
    for n in want:
        assert got[n] == pytest.approx(want[n], rel=5e-2, abs=1e-4), n


def _bound_attr_rank(rank: int, world: int) -> list[str]:
    from treadle.schedule.log import Ref

    out = []
    for where in ("", "transformer.h.0"):
        sch = create_schedule(_model(), mesh=Mesh((2,), ("pp",)))
        name = "loss_function" if not where else "unused_loss"
        sch[where].set_attr(name, Ref("treadle.runtime.losses:VocabParallelLoss", axis="pp", causal=True))
        sch["transformer.h.2"].cut_pipeline_stage()
        sch.pipeline(axis="pp", schedule="1f1b", n_microbatches=2, example_inputs=_inputs())
        try:
            treadle.build(sch)
            out.append("built")
        except treadle.BuildError as exc:
            out.append(str(exc))
    return out


def test_a_mesh_bound_attribute_the_captured_code_calls_is_refused():
    """NOTE [mesh-bound attributes under a pipeline]: the vocab-parallel loss set as the model's loss_function is
    called by the code the pipeline traces into its last stage: refused by name; the same object set on a block
    and never called there builds."""
    for res in spawn(_bound_attr_rank, 2, timeout_s=120):
        assert res[0].startswith("pipeline: loss_function is set by set_attr to a VocabParallelLoss bound to the "
                                 "mesh, and the model's forward calls it outside the blocks"), res[0]
        assert res[1] == "built", res[1]
