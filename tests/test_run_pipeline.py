"""treadle.run on pipeline schedules, on 4 gloo ranks: the first step's loss and global gradient norm (across stages,
tensor-parallel shards, FSDP2 shards and replicas) equal one process's; checkpoints hold global shapes under the
unbuilt model's names (a tied head is its embedding), so they reshard on load across pipeline changes — PP2 x DP2
-> FSDP4, FSDP4 -> PP2 x TP2, PP2 -> PP4 with other cuts — the parameters copied exactly and the next steps'
losses continuing those of the run that saved."""

from __future__ import annotations

import contextlib

import pytest
import torch

from treadle.testing import spawn

from run_job import losses, run_treadle

BATCH, SEQ = 4, 16
# name -> (mesh shape, axis names, cuts after these blocks, pipeline schedule, micro-batches, data parallel, tp)
SCHEDULES = {
    "pp2xdp2": ((2, 2), ("pp", "dp"), [1], "1f1b", 2, dict(axis="dp", shard=False), False),
    "pp2xfsdp2": ((2, 2), ("pp", "dp"), [1], "gpipe", 2, dict(axis="dp", shard=True), False),
    "pp2xtp2": ((2, 2), ("pp", "tp"), [1], "1f1b", 2, None, True),
    "pp2": ((2, 2), ("pp", "dp"), [0], "1f1b", 4, None, False),      # dp of size 2 unused: replicas of one pipeline
    "pp4": ((4,), ("pp",), [0, 1, 2], "gpipe", 4, None, False),
    "fsdp4": ((4,), ("dp",), [], None, 1, dict(axis="dp", shard=True), False),
}


def _ids() -> dict:
    return {"input_ids": torch.zeros(BATCH, SEQ, dtype=torch.int64), "labels": torch.zeros(BATCH, SEQ, dtype=torch.int64)}


def _make(name: str):
    from treadle import Mesh, build, create_schedule
    from treadle.models import megatron
    from treadle.models.zoo import named_model
    from treadle.run.config import RunConfig
    from treadle.run.layout import layouts, shards_by_name
    from treadle.run.optim import init_optimizer_state, make_optimizer

    shape, names, cuts, kind, mb, dp, tp = SCHEDULES[name]
    torch.manual_seed(0)
    model, _ = named_model("tiny-gpt2", batch=1, seq=SEQ, dropout=False)
    sch = create_schedule(model, mesh=Mesh(shape, names))
    if tp:
        megatron(sch, tp="tp", vocab_parallel_head=False)
    if dp:
        sch.data_parallel(**dp)
    for c in cuts:
        sch[f"transformer.h.{c}"].cut_pipeline_stage()
    if kind:
        sch.pipeline(axis="pp", schedule=kind, n_microbatches=mb, example_inputs=_ids())
    before = shards_by_name(sch)
    built = build(sch)
    spec = sch.view().data_parallel
    lay = layouts(built, before, sch.mesh, spec.shard_axes if spec is not None and spec.shard else None)
    cfg = RunConfig(model="tiny-gpt2", data=["unused"], lr=1e-2, warmup_steps=0, steps=10)
    opt = make_optimizer(built, lay, cfg)
    init_optimizer_state(opt)
    return sch, built, lay, opt, mb


def _step(sch, built, lay, opt, mb, batch: torch.Tensor, *, with_norm: bool = False):
    from treadle.run.loop import train_step
    from treadle.run.setup import data_parallel_coords

    n, i = data_parallel_coords(sch)
    loss, norm = train_step(built, opt, lay, sch.mesh, list(batch.chunk(n)[i].chunk(mb)), clip_norm=1.0)
    return (loss, norm) if with_norm else loss


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (BATCH, SEQ), generator=g) for _ in range(4)]


def _reference_first_step() -> tuple[float, float]:
    from treadle.models.zoo import named_model

    torch.manual_seed(0)
    model, _ = named_model("tiny-gpt2", batch=1, seq=SEQ, dropout=False)
    ids = _batches()[0]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss), float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


def _full_params(made) -> dict[str, torch.Tensor]:
    """Every global parameter this rank holds, by the unbuilt model's name."""
    from treadle.run.layout import named_params

    sch, built, lay, _, _ = made
    return {n: lay[n].gather_full(p, sch.mesh) for n, p in named_params(built)}


def _reshard_rank(rank: int, world: int, src: str, dst: str, path: str):
    from treadle.run import checkpoint as ckpt

    batches = _batches()
    a = _make(src)
    first = _step(*a, batches[0], with_norm=True)
    _step(*a, batches[1])
    ckpt.Checkpointer(path).save(a[1], a[3], a[2], a[0].mesh, step=2)
    full_a = _full_params(a)
    after_a = [_step(*a, b) for b in batches[2:]]
    b_ = _make(dst)
    step = ckpt.load(ckpt.step_dir(path, 2), b_[1], b_[3], b_[2], b_[0].mesh)
    full_b = _full_params(b_)
    after_b = [_step(*b_, b) for b in batches[2:]]
    common = sorted(set(full_a) & set(full_b))
    max_diff = {n: float((full_a[n] - full_b[n]).abs().max()) for n in common}
    return step, sorted(full_a), sorted(full_b), max_diff, after_a, after_b, first


@pytest.mark.slow
@pytest.mark.parametrize("src,dst", [("pp2xdp2", "fsdp4"), ("fsdp4", "pp2xtp2"), ("pp2", "pp4"),
                                     ("pp2xfsdp2", "pp2xdp2")])
def test_pipeline_checkpoints_reshard_on_load(tmp_path, src, dst):
    results = spawn(_reshard_rank, 4, src, dst, str(tmp_path / "ck"), timeout_s=300)
    ref_loss, ref_norm = _reference_first_step()
    held_a, held_b, compared = set(), set(), set()
    for step, names_a, names_b, max_diff, after_a, after_b, (loss0, norm0) in results:
        # the norm over stages, tensor-parallel shards, FSDP shards and replicas is the single-process norm
        assert norm0 == pytest.approx(ref_norm, rel=1e-5) and loss0 == pytest.approx(ref_loss, rel=1e-5)
        assert step == 2
        held_a |= set(names_a)
        held_b |= set(names_b)
        assert all(d == 0.0 for d in max_diff.values()), {n: d for n, d in max_diff.items() if d}  # copied exactly
        compared |= set(max_diff)
        torch.testing.assert_close(torch.tensor(after_b), torch.tensor(after_a), rtol=1e-5, atol=1e-6)
    from treadle.models.zoo import named_model

    model, _ = named_model("tiny-gpt2", batch=1, seq=SEQ, dropout=False)
    every = {n for n, _ in model.named_parameters()}
    assert held_a == every and held_b == every  # the ranks together hold the whole model, under its names
    assert compared  # some rank holds a parameter under both schedules
    assert "lm_head.weight" not in every  # GPT-2's head is its embedding: saved once, by the embedding's name


# ------------------------------------------------------------------------------------------- under torchrun
def _pipeline_schedule(path, *, shard: bool, batch: int = 8, seq: int = 32) -> None:
    from treadle import Mesh, create_schedule
    from treadle.run.setup import load_run_model

    model = load_run_model("tiny-llama", seq=seq, seed=0)
    sch = create_schedule(model, mesh=Mesh((2, 2), ("pp", "dp")))
    sch["model.layers.1"].cut_pipeline_stage()
    sch.data_parallel(axis="dp", shard=shard)
    ids = torch.zeros(batch, seq, dtype=torch.int64)
    sch.pipeline(axis="pp", schedule="1f1b", n_microbatches=2, example_inputs={"input_ids": ids, "labels": ids})
    path.write_text(sch.to_json())


def _run(tmp_path, *extra: str):
    return run_treadle(tmp_path, *extra, nproc=4)


_losses = losses


def _check_stage_metrics(path, stdout: str, *, peak: float, world: int, pp: int) -> None:
    """Per pp rank at the logged steps (every 3rd): its stages, FLOPs that add up to the model's, an MFU of those
    FLOPs over the step, its memory; shown on the console too."""
    import json

    rows = {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert [s for s, r in sorted(rows.items()) if r["stages"]] == [3, 6]
    for s in (3, 6):
        r = rows[s]
        stages = r["stages"]
        assert [(x["pp"], x["stages"]) for x in stages] == [(0, [0]), (1, [1])]
        total = r["mfu"] * r["step_s"] * world * peak  # the model's FLOPs per step, as the overall MFU counts them
        assert sum(x["flops"] for x in stages) * (world // pp) == pytest.approx(total, rel=1e-6)
        for x in stages:
            assert x["mfu"] == pytest.approx(x["flops"] / r["step_s"] / peak, rel=1e-9) and x["mem_bytes"] > 0
        assert stages[1]["flops"] > stages[0]["flops"]  # the same blocks each, and the head on the last stage
    assert "  pp 1 stages [1]: mfu " in stdout


def _check_measured_beside_priced(tmp_path, sched) -> None:
    """--trace wrote every rank's profile and rank 0 the measured pipeline timeline; `treadle price --measured`
    prints it beside the price and draws both, the predicted and the measured, in one trace and one page."""
    import json

    from treadle.cli import main as cli
    from treadle.viz.chrome import validate_chrome_trace

    assert all((tmp_path / f"t-rank{r}.json").exists() for r in range(4))
    doc = json.loads((tmp_path / "t-pipeline.json").read_text())
    assert validate_chrome_trace(doc) == []
    m = doc["otherData"]["measured_pipeline"]
    assert (m["schedule"], m["n_stages"], m["n_microbatches"], [r["stages"] for r in m["ranks"]]) == \
        ("1f1b", 2, 2, [[0], [1]])
    out, html = tmp_path / "both.json", tmp_path / "both.html"
    assert cli(["price", str(sched), "--model", "tiny-llama", "--cluster", "2x2:cpu", "--batch", "8", "--seq", "32",
                "--measured", str(tmp_path / "t-pipeline.json"), "--trace", str(out), "--html", str(html)]) == 0
    both = json.loads(out.read_text())
    assert validate_chrome_trace(both) == []
    procs = sorted(e["args"]["name"].split(":")[0] for e in both["traceEvents"] if e.get("name") == "process_name")
    assert procs == ["treadle measured step", "treadle predicted step"]
    assert "Measured pipeline beside the predicted" in html.read_text()
    from treadle.cli.price import _measured_pipeline
    from treadle.errors import TreadleError

    with pytest.raises(TreadleError, match=r"t-rank0.json: no otherData.measured_pipeline; give the '-pipeline' file"):
        _measured_pipeline(str(tmp_path / "t-rank0.json"), {})


def _first_loss_in_one_process() -> float:
    """The loss `treadle.run` reports at step 1 (its defaults and `run_treadle`'s: tiny LLaMA, seq 32, batch 8,
    meta init), computed here in one process: the model materialised as build does (seeded per module), the
    sampler's first global batch."""
    from run_job import ROOT
    from treadle.run.data import Sampler, make_tokenizer, pack
    from treadle.run.setup import load_run_model, model_inputs
    from treadle.runtime.materialize import materialize

    model = load_run_model("tiny-llama", seq=32, seed=0, meta=True)
    materialize(model, None, "cpu")
    samples = pack([str(ROOT / "examples" / "data" / "village.txt")], seq=32, tokenizer=make_tokenizer(None),
                   vocab_size=model.config.vocab_size)
    batch = samples[Sampler(len(samples), 8, 1, 0).indices(0, 0)]
    with torch.no_grad():
        return float(model(**model_inputs(model, batch)).loss)


@pytest.mark.slow
def test_treadle_run_trains_pp2_x_dp2_and_resumes_bit_exact(tmp_path):
    import shutil

    sched = tmp_path / "pp.json"
    _pipeline_schedule(sched, shard=False)
    res = _run(tmp_path, "--schedule", str(sched), "--ckpt-dir", "ck", "--ckpt-every", "2", "--metrics", "a.jsonl",
               "--hardware", "a100-80gb", "--log-every", "3", "--trace", "t.json")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "batch 8 = 2 dp x 2 accum x 2" in res.stdout  # the pipeline's 2 micro-batches are the accumulation
    first = _losses(tmp_path / "a.jsonl")
    assert sorted(first) == list(range(1, 7)) and first[6] < first[1]
    from treadle.run.metrics import resolve_peak_flops_per_s

    peak = resolve_peak_flops_per_s("a100-80gb", precision="fp32", device=torch.device("cpu"))
    _check_stage_metrics(tmp_path / "a.jsonl", res.stdout, peak=peak, world=4, pp=2)
    _check_measured_beside_priced(tmp_path, sched)
    assert first[1] == pytest.approx(_first_loss_in_one_process(), rel=1e-5)  # the same model and batch
    for s in (4, 6):
        shutil.rmtree(tmp_path / "ck" / f"step_{s:08d}")
    res = _run(tmp_path, "--schedule", str(sched), "--ckpt-dir", "ck", "--ckpt-every", "2", "--metrics", "b.jsonl")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "resumed from ck/step_00000002" in res.stdout
    resumed = _losses(tmp_path / "b.jsonl")
    assert sorted(resumed) == [3, 4, 5, 6] and resumed == {s: first[s] for s in resumed}  # bit-exact
    _check_pp2_x_fsdp2_in_bf16(tmp_path, first)


def test_a_pipeline_run_takes_the_batch_it_was_captured_on(tmp_path):
    from treadle.run.config import RunConfig, RunError
    from treadle.run.setup import load_run_model, pipeline_batches
    from treadle.schedule.replay import load_schedule

    sched = tmp_path / "pp.json"
    _pipeline_schedule(sched, shard=True)
    sch = load_schedule(load_run_model("tiny-llama", seq=32, seed=0), sched.read_text())
    ok = RunConfig(model="tiny-llama", data=["unused"], batch=8, seq=32)
    assert pipeline_batches(sch, ok, 2) == (2, 2)
    with pytest.raises(RunError, match=r"captured on input_ids of shape \(8, 32\); run it with --batch 8 --seq 32 "
                                       r"\(given --batch 16 --seq 32\)"):
        pipeline_batches(sch, RunConfig(model="tiny-llama", data=["unused"], batch=16, seq=32), 2)
    with pytest.raises(RunError, match=r"gradient accumulation is its 2 micro-batches of 2 samples.*--grad-accum 4"):
        pipeline_batches(sch, RunConfig(model="tiny-llama", data=["unused"], batch=8, seq=32, grad_accum=4), 2)
    from treadle.run.loop import autocast_for

    bf16 = RunConfig(model="tiny-llama", data=["unused"], batch=8, seq=32, precision="bf16")
    # FSDP2's policy casts (NOTE [pipeline capture under FSDP2's mixed precision]): the run adds no autocast
    assert isinstance(autocast_for(sch, bf16, torch.device("cpu")), contextlib.nullcontext)


def _check_pp2_x_fsdp2_in_bf16(tmp_path, fp32: dict[int, float]) -> None:
    """NOTE [pipeline capture under FSDP2's mixed precision]: PP2 x FSDP2 in bf16 (part of the PP2 x DP2 test, whose
    fp32 losses it is held to: FSDP2 and DDP replicas compute the same fp32 step to ~1e-6, far inside bf16's
    tolerance). The stages compute in bf16 through FSDP2's policy (the capture traced with the parameters so cast),
    the losses follow the fp32 run within bf16 tolerance and differ from it; the checkpoint holds fp32 parameters."""
    sched = tmp_path / "pp-fsdp.json"
    _pipeline_schedule(sched, shard=True)
    res = _run(tmp_path, "--schedule", str(sched), "--precision", "bf16", "--metrics", "bf16.jsonl",
               "--ckpt-dir", "ck-bf16", "--ckpt-every", "6")  # the fp32 run's 6 steps (its learning-rate schedule)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    bf16 = _losses(tmp_path / "bf16.jsonl")
    l32, l16 = (torch.tensor([run[s] for s in (1, 2, 3)]) for run in (fp32, bf16))
    torch.testing.assert_close(l16, l32, rtol=2e-2, atol=0)
    assert not torch.equal(l16, l32)  # bf16 really ran
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(tmp_path / "ck-bf16" / "step_00000006")).read_metadata()
    dtypes = {str(m.properties.dtype) for k, m in meta.state_dict_metadata.items()
              if k.startswith("model.") and hasattr(m, "properties")}
    assert dtypes == {"torch.float32"}, dtypes
