"""treadle.run pieces in one process: settings and TOML, data reading / packing / sampling, the LR schedule,
and the errors for bad data, bad settings and a schedule written for another model."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from treadle.run.config import RunConfig, RunError, add_arguments, config_from_args
from treadle.run.data import ByteTokenizer, Sampler, pack, read_documents
from treadle.run.optim import lr_at


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------- config
def test_toml_then_command_line(tmp_path):
    (tmp_path / "c.toml").write_text('model = "tiny-llama"\ndata = "a.txt"\nbatch = 16\nlr = 1e-3\n'
                                     'warmup-steps = 5\nprecision = "bf16"\nasync_ckpt = true\n')
    cfg = config_from_args(_args(["--config", str(tmp_path / "c.toml"), "--batch", "32", "--betas", "0.8", "0.9"]))
    assert (cfg.model, cfg.data, cfg.batch, cfg.lr, cfg.warmup_steps) == ("tiny-llama", ["a.txt"], 32, 1e-3, 5)
    assert (cfg.precision, cfg.async_ckpt, cfg.betas) == ("bf16", True, (0.8, 0.9))


def test_toml_unknown_key(tmp_path):
    (tmp_path / "c.toml").write_text('model = "tiny-llama"\nlearning_rate = 1.0\n')
    with pytest.raises(RunError, match="unknown key 'learning_rate'.*known"):
        config_from_args(_args(["--config", str(tmp_path / "c.toml")]))


@pytest.mark.parametrize("kw,msg", [(dict(data=[]), "give --data"), (dict(batch=0), "--batch must be >= 1"),
                                    (dict(precision="fp8"), "fp32 or bf16"), (dict(recipe="zero"), "unknown --recipe"),
                                    (dict(schedule="a.json", plan="auto"), "not both"),
                                    (dict(min_lr=1.0), "min_lr <= lr"), (dict(init="lazy"), "real or meta")])
def test_config_errors(kw, msg):
    with pytest.raises(RunError, match=msg):
        RunConfig(**{"model": "tiny-llama", "data": ["x.txt"], **kw})


def test_forwarded_args_round_trip():
    from treadle.cli.run import forwarded_args

    argv = ["--model", "tiny-gpt2", "--data", "a.txt", "b.jsonl", "--batch", "4", "--async-ckpt", "--memory-budget", "1GiB"]
    again = _args(forwarded_args(_args(argv)))
    assert config_from_args(again) == config_from_args(_args(argv))
    assert again.memory_budget_bytes == 2**30


# ------------------------------------------------------------------------------------------- data
def test_pack_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "abc"}) + "\n\n" + json.dumps({"text": "de"}) + "\n")
    t = pack([str(tmp_path)], seq=4, tokenizer=ByteTokenizer())
    stream = list(b"hello world") + [0] + list(b"abc") + [0] + list(b"de") + [0]
    assert t.shape == (len(stream) // 4, 4)
    assert t.flatten().tolist() == stream[: t.numel()]


def test_data_errors(tmp_path):
    with pytest.raises(RunError, match="data path '.*nope.txt' does not exist"):
        pack([str(tmp_path / "nope.txt")], seq=4, tokenizer=ByteTokenizer())
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(RunError, match="empty.txt' is empty"):
        pack([str(tmp_path / "empty.txt")], seq=4, tokenizer=ByteTokenizer())
    (tmp_path / "short.txt").write_text("ab")
    with pytest.raises(RunError, match="fewer than one sample of seq=64"):
        pack([str(tmp_path / "short.txt")], seq=64, tokenizer=ByteTokenizer())
    (tmp_path / "z.txt").write_text("zz")  # 'z' is byte 122
    with pytest.raises(RunError, match="token id 122 does not fit the model's vocabulary of 100"):
        pack([str(tmp_path / "z.txt")], seq=2, tokenizer=ByteTokenizer(), vocab_size=100)
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(RunError, match=r"bad.jsonl:1: no string field 'text'.*\['body'\]"):
        read_documents(tmp_path / "bad.jsonl")
    (tmp_path / "d").mkdir()
    with pytest.raises(RunError, match="holds no"):
        pack([str(tmp_path / "d")], seq=4, tokenizer=ByteTokenizer())


def test_hf_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from treadle.run.data import make_tokenizer

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("hello world hello moon")
    t = pack([str(tmp_path / "a.txt")], seq=5, tokenizer=make_tokenizer(str(tmp_path)))
    assert t.tolist() == [[2, 3, 2, 1, 0]]


def test_sampler_shards_over_dp_and_resumes():
    s1, s4 = Sampler(10, 4, 1, seed=3), Sampler(10, 4, 4, seed=3)
    for step in range(7):  # crosses epochs 0, 1, 2
        whole = s1.indices(step, 0)
        assert [i for r in range(4) for i in s4.indices(step, r)] == whole
    seen = [i for step in range(5) for i in s1.indices(step, 0)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))  # each epoch once
    assert Sampler(10, 4, 1, seed=4).indices(0, 0) != s1.indices(0, 0)
    with pytest.raises(RunError, match="global batch 6 does not divide over 4"):
        Sampler(10, 6, 4, seed=0)


def test_lr_warmup_then_cosine():
    cfg = RunConfig(model="m", data=["x"], lr=1.0, min_lr=0.1, warmup_steps=4, steps=14)
    lrs = [lr_at(s, cfg) for s in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[9] == pytest.approx(0.1 + 0.45 * (1 + torch.cos(torch.tensor(torch.pi * 5 / 9)).item()))


# ------------------------------------------------------------------------------------------- schedule errors
def test_schedule_errors(tmp_path):
    from treadle import Mesh, create_schedule
    from treadle.models import megatron
    from treadle.models.zoo import named_model
    from treadle.run.setup import load_run_model, make_schedule, model_inputs, pipeline_batches

    gpt2, _ = named_model("tiny-gpt2", batch=1, seq=8)
    path = tmp_path / "gpt2.json"
    path.write_text(megatron(create_schedule(gpt2, mesh=Mesh(2, "tp")), tp="tp").to_json())
    llama = load_run_model("tiny-llama", seq=16, seed=0)
    with pytest.raises(RunError, match="does not fit model 'tiny-llama': unknown module path 'transformer.wte'"):
        make_schedule(llama, RunConfig(model="tiny-llama", data=["x"], schedule=str(path)), world=2, rank=0)
    with pytest.raises(RunError, match=r"mesh \{'tp': 2\} needs 2 ranks, but the job has 4"):
        make_schedule(gpt2, RunConfig(model="tiny-gpt2", data=["x"], schedule=str(path)), world=4, rank=0)
    with pytest.raises(RunError, match="schedule file '.*missing.json' does not exist"):
        make_schedule(gpt2, RunConfig(model="tiny-gpt2", data=["x"], schedule=str(tmp_path / "missing.json")),
                      world=2, rank=0)
    with pytest.raises(RunError, match="--mesh 2x3 has 6 ranks but the job has 4"):
        make_schedule(gpt2, RunConfig(model="tiny-gpt2", data=["x"], recipe="megatron", mesh="2x3"), world=4, rank=0)
    with pytest.raises(RunError, match="--model 'no-such-model'.*unknown model"):
        load_run_model("no-such-model", seq=16, seed=0)
    model, inputs = named_model("tiny-gpt2", batch=4, seq=16, dropout=False)
    pp = create_schedule(model, mesh=Mesh(2, "pp"))
    pp["transformer.h.2"].cut_pipeline_stage()
    pp.pipeline(axis="pp", schedule="gpipe", n_microbatches=2, example_inputs=inputs)
    (tmp_path / "pp.json").write_text(pp.to_json())
    sch = make_schedule(gpt2, RunConfig(model="tiny-gpt2", data=["x"], schedule=str(tmp_path / "pp.json")),
                        world=2, rank=0)  # a pipeline trains (tests/test_run_pipeline.py); its batch is the captured one
    with pytest.raises(RunError, match=r"captured on input_ids of shape \(4, 16\); run it with --batch 4 --seq 16"):
        pipeline_batches(sch, RunConfig(model="tiny-gpt2", data=["x"], batch=8, seq=16), 1)
    with pytest.raises(RunError, match="--compile does not apply to a pipeline schedule yet"):
        pipeline_batches(sch, RunConfig(model="tiny-gpt2", data=["x"], batch=4, seq=16, compile=True), 1)
    with pytest.raises(RunError, match="trains language models called as model\\(input_ids=, labels=\\)"):
        model_inputs(torch.nn.Linear(2, 2), torch.zeros(1, 2))


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["ab", "", "cd"], "id": [1, 2, 3]}), tmp_path / "a.parquet")
    assert read_documents(tmp_path / "a.parquet") == ["ab", "cd"]
    with pytest.raises(RunError, match=r"no column 'body'; columns: \['text', 'id'\]"):
        read_documents(tmp_path / "a.parquet", text_field="body")


def test_metrics_jsonl_and_tensorboard(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from treadle.run.metrics import MetricsLogger, StepMetrics

    cfg = RunConfig(model="m", data=["x"], steps=2, metrics=str(tmp_path / "m.jsonl"), tensorboard=str(tmp_path / "tb"))
    log = MetricsLogger(cfg, enabled=True, start_step=0)
    for step, loss in ((1, 5.0), (2, 4.0)):
        log.log(StepMetrics(step=step, loss=loss, lr=1e-3, grad_norm=1.0, step_s=0.5, tokens=step * 64,
                            tokens_per_s=128.0, mfu=0.25, mem_bytes=2**20, epoch=0.1))
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == [5.0, 4.0] and rows[1]["mfu"] == 0.25
    out = capsys.readouterr().out
    assert "step 2/2 loss 4.0000" in out and "mfu 25%" in out
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == [5.0, 4.0]
    assert MetricsLogger(cfg, enabled=False, start_step=0)._jsonl is None  # other ranks write nothing


def test_mfu_inputs():
    from treadle.run.metrics import model_flops_per_step, resolve_peak_flops_per_s
    from treadle.run.setup import load_run_model

    cpu = torch.device("cpu")
    assert resolve_peak_flops_per_s("auto", precision="bf16", device=cpu) is None
    assert resolve_peak_flops_per_s("none", precision="bf16", device=cpu) is None
    assert resolve_peak_flops_per_s("a100-80gb", precision="bf16", device=cpu) == pytest.approx(312e12)
    with pytest.raises(RunError, match="--hardware 'tpu9'.*known"):
        resolve_peak_flops_per_s("tpu9", precision="fp32", device=cpu)
    model = load_run_model("tiny-gpt2", seq=16, seed=0)
    ids = torch.zeros((2, 16), dtype=torch.int64)
    flops, none = model_flops_per_step(model, {"input_ids": ids, "labels": ids})
    n_params = sum(p.numel() for p in model.parameters())
    assert none is None
    assert 6 * n_params * ids.numel() * 0.5 < flops < 6 * n_params * ids.numel() * 3  # ~6 N T (Kaplan et al.)
    # a pipeline's stages split that count: half the blocks each, the last stage also the head (forward, input
    # and weight gradients: 3 x 2 x tokens x hidden x vocab)
    cfg = model.config
    assert cfg.n_layer % 2 == 0
    cut = [f"transformer.h.{cfg.n_layer // 2 - 1}"]
    again, per_stage = model_flops_per_step(model, {"input_ids": ids, "labels": ids}, cut)
    assert again == flops and sum(per_stage) == flops
    assert per_stage[1] - per_stage[0] == 6 * ids.numel() * cfg.n_embd * cfg.vocab_size


def test_cli_registers_run_and_export():
    from treadle.cli import build_parser
    from treadle.cli.run import forwarded_args

    args = build_parser().parse_args(["run", "--nproc", "2", "--model", "tiny-llama", "--data", "a.txt", "--steps", "3"])
    assert args.nproc == 2 and forwarded_args(args) == ["--model", "tiny-llama", "--data", "a.txt", "--steps", "3"]
    args = build_parser().parse_args(["export-hf", "ck/step_00000003", "--model", "tiny-llama", "-o", "hf"])
    assert (args.checkpoint, args.output) == ("ck/step_00000003", "hf")


def test_health_names_ranks_behind():
    import torch.distributed as dist

    from treadle.run import health

    store = dist.HashStore()
    assert health.behind(4, store=store) == {0: None, 1: None, 2: None, 3: None}
    for rank, step in ((0, 5), (1, 3), (2, 5)):
        health.mark(step, rank=rank, store=store)
    assert health.behind(4, store=store) == {1: 3, 3: None}
    health.mark(3, rank=3, store=store)
    health.mark(5, rank=1, store=store)
    assert health.behind(4, store=store) == {3: 3}


def _plan_auto_rank(rank, world):
    import functools

    from treadle.profile import hardware
    from treadle.run.setup import _auto_clusters, load_run_model, make_schedule

    # rank 0 measures the core without its framework overheads and kernel rates (about 1 s, not 24; those are
    # test_profile_flops'), the group's links as --plan auto measures them
    hardware.calibrate_cpu = functools.partial(hardware.calibrate_cpu, overheads=False, kernels=False)

    # on a cpu preset every rank of the launched group measures the host before rank 0 plans on it
    measured = _auto_clusters(RunConfig(model="tiny-gpt2", data=["x"], plan="auto"), world, rank)
    nominal = _auto_clusters(RunConfig(model="tiny-gpt2", data=["x"], plan="auto", nominal=True), world, rank)
    links = [[link.name for link in c.links] for c in (*measured, *nominal)]
    model = load_run_model("tiny-gpt2", seq=16, seed=0)
    sch = make_schedule(model, RunConfig(model="tiny-gpt2", data=["x"], plan="auto", batch=4, seq=16, nominal=True),
                        world=world, rank=rank)
    try:
        make_schedule(load_run_model("tiny-gpt2", seq=16, seed=0),
                      RunConfig(model="tiny-gpt2", data=["x"], plan="auto", batch=4, seq=16, memory_budget_bytes=1.0,
                                nominal=True), world=world, rank=rank)
        err = None
    except RunError as exc:
        err = str(exc)
    return sch.to_json(), sch.mesh.world_size, err, links, measured[0].cores_per_host


@pytest.mark.slow
def test_plan_auto_broadcasts_one_schedule():
    from treadle.testing import spawn

    (json0, world0, err0, links0, cores0), (json1, world1, err1, links1, _) = spawn(_plan_auto_rank, 2,
                                                                                   timeout_s=240)
    assert json0 == json1 and world0 == world1 == 2  # rank 0 planned, rank 1 received the same schedule
    assert err0 == err1 and "--plan auto failed on rank 0" in err0  # an impossible 1-byte budget, on every rank
    assert links0 == links1 and links0[0][0].startswith("gloo") and set(links0[1]) == {"loopback"}, links0
    assert cores0 == os.cpu_count()


def test_split_batch():
    from treadle.run.data import split_batch

    assert split_batch(16, 2, micro_batch=None, grad_accum=None) == (8, 1)
    assert split_batch(16, 2, micro_batch=2, grad_accum=None) == (2, 4)
    assert split_batch(16, 2, micro_batch=None, grad_accum=4) == (2, 4)
    with pytest.raises(RunError, match="8 per rank, which micro_batch=3 x grad_accum=None does not split"):
        split_batch(16, 2, micro_batch=3, grad_accum=None)
    with pytest.raises(RunError, match="micro_batch=2 x grad_accum=2 does not split"):
        split_batch(16, 2, micro_batch=2, grad_accum=2)


def test_checkpoint_errors(tmp_path):
    import torch.distributed.checkpoint as dcp

    from treadle.run.checkpoint import _check_metadata, export_hf, latest
    from treadle.run.setup import load_run_model

    dcp.save({"model.w": torch.zeros(2, 3)}, checkpoint_id=str(tmp_path / "step_00000004"), no_dist=True)
    (tmp_path / "step_00000009").mkdir()  # a save that never finished
    assert latest(tmp_path) == tmp_path / "step_00000004"
    with pytest.raises(RunError, match="step_00000009 is not a complete checkpoint"):
        _check_metadata(tmp_path / "step_00000009", {})
    with pytest.raises(RunError, match=r"model.w has shape \(2, 3\) there but \(3, 3\) in this model"):
        _check_metadata(tmp_path / "step_00000004", {"model.w": (3, 3)})
    with pytest.raises(RunError, match=r"lacks 1 entries this model needs, e.g. \['model.v'\]"):
        _check_metadata(tmp_path / "step_00000004", {"model.v": (2, 3)})
    with pytest.raises(RunError, match="lacks .* entries .*another model"):
        export_hf(tmp_path / "step_00000004", load_run_model("tiny-gpt2", seq=8, seed=0), tmp_path / "hf")


def test_launch_and_path_errors(tmp_path, monkeypatch):
    from treadle.run.data import make_tokenizer
    from treadle.run.loop import init_distributed

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RunError, match=r"environment \['RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\] not set"):
        init_distributed(10.0)
    with pytest.raises(RunError, match="tokenizer '.*nope': no tokenizer.json there"):
        make_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(RunError, match="--plan must be 'auto' or a plan JSON file"):
        RunConfig(model="m", data=["x"], plan=str(tmp_path / "plan.json"))
