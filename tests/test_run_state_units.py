"""treadle.run keeps its state, in one process: checkpoint manifests catch flipped and truncated bytes, DCP
metadata is read as data (a crafted pickle runs nothing), the checkpoint directory's lock, retention, settings of
the wrong type, bad data files, preemption signals, the process-count limit, and who `health` blames."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from treadle.run.config import RunError


def _legacy_ckpt(path, **tensors) -> None:
    """A DCP checkpoint as an older treadle wrote it (no manifest)."""
    dcp.save(tensors or {"model.w": torch.arange(6.0).view(2, 3)}, checkpoint_id=str(path), no_dist=True)


def _with_manifest(path):
    from treadle.run.manifest import data_files, file_entry, write_manifest

    write_manifest(path, {n: file_entry(path / n) for n in data_files(path)}, step=4, world_size=1)
    return path


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# ------------------------------------------------------------------------------------------- manifest
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_manifest_catches_flipped_truncated_and_missing_files(tmp_path):
    from treadle.run.checkpoint import verify
    from treadle.run.manifest import check_share

    ck = tmp_path / "step_00000004"
    _legacy_ckpt(ck)
    _with_manifest(ck)
    assert verify(ck) == []
    shard = ck / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (problem,) = verify(ck)
    assert problem == f"{shard}: SHA-256 differs from the manifest (the bytes changed after the save)"
    shard.write_bytes(bytes(data[:100]))
    (problem,) = verify(ck)
    assert problem.startswith(f"{shard}: 100 bytes, the manifest says ") and "truncated" in problem
    shard.unlink()
    assert verify(ck) == [f"{shard}: missing (the manifest lists {len(data)} bytes)"]
    # the files are split over the ranks: each rank checks its share
    assert sorted(check_share(ck, 0, 2) + check_share(ck, 1, 2)) == sorted(check_share(ck, 0, 1))
    (ck / "manifest.json").write_text("{")
    assert verify(ck) == [f"{ck / 'manifest.json'}: unreadable manifest (JSONDecodeError)"]
    (ck / "manifest.json").write_text(json.dumps({"format": "other"}))
    assert verify(ck) == [f"{ck / 'manifest.json'}: not a treadle-checkpoint manifest"]
    assert verify(tmp_path / "nothing") == [f"{tmp_path / 'nothing'} is not a complete checkpoint (no manifest: "
                                            f"the save did not finish)"]


def test_retention_partials_and_quarantine(tmp_path):
    from treadle.run.manifest import complete_checkpoints, partial_dir, prune, quarantine, remove_partials, step_dir

    for step in (2, 4, 6, 8):
        step_dir(tmp_path, step).mkdir()
        (step_dir(tmp_path, step) / "manifest.json").write_text("{}")
    partial_dir(tmp_path, 10).mkdir()  # a save that died: never counted, removed by the next job
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [8, 6, 4, 2]
    assert prune(tmp_path, 0) == []
    assert prune(tmp_path, 2) == [step_dir(tmp_path, 4), step_dir(tmp_path, 2)]
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [8, 6]
    assert remove_partials(tmp_path) == [partial_dir(tmp_path, 10)] and not partial_dir(tmp_path, 10).exists()
    assert quarantine(step_dir(tmp_path, 8)).name == "step_00000008.corrupt"
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [6]


# ------------------------------------------------------------------------------------------- metadata as data
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_real_metadata_loads(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    from treadle.run.safe_pickle import load_metadata

    _legacy_ckpt(tmp_path / "ck", w=torch.zeros(2, 3), b=torch.zeros(3, dtype=torch.bfloat16),
                 step=torch.tensor(3), rng=torch.zeros(2, 5, dtype=torch.uint8))
    md = load_metadata(tmp_path / "ck" / ".metadata")
    assert isinstance(md, Metadata) and tuple(md.state_dict_metadata["w"].size) == (2, 3)
    assert md.state_dict_metadata["b"].properties.dtype == torch.bfloat16


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_crafted_metadata_runs_nothing(tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from treadle.run.checkpoint import export_hf
    from treadle.run.safe_pickle import MetadataRefused, load_metadata
    from treadle.run.setup import load_run_model

    marker = tmp_path / "marker"
    ck = tmp_path / "step_00000004"
    _legacy_ckpt(ck)
    (ck / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(MetadataRefused, match=r"\.metadata refers to posix\.system, which DCP metadata never holds: "
                                              r"refused unread"):
        load_metadata(ck / ".metadata")
    # a manifest does not vouch for it: the file is refused by its content, whoever rewrote the manifest
    _with_manifest(ck)
    with pytest.raises(RunError, match="refers to posix.system"):
        export_hf(ck, load_run_model("tiny-gpt2", seq=8, seed=0), tmp_path / "hf")
    from treadle.cli import main

    assert main(["export-hf", str(ck), "--model", "tiny-gpt2", "-o", str(tmp_path / "hf")]) == 2
    assert not marker.exists()
    # a bytes entry would be loaded with torch.load(weights_only=False): refused as well
    (ck / ".metadata").write_bytes(pickle.dumps(Metadata({"model.w": BytesStorageMetadata()})))
    with pytest.raises(MetadataRefused, match="BytesStorageMetadata"):
        load_metadata(ck / ".metadata")
    (ck / ".metadata").write_bytes(pickle.dumps(Metadata({}))[:20])
    with pytest.raises(RunError, match="is damaged .truncated or not DCP metadata"):
        load_metadata(ck / ".metadata")
    (ck / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(RunError, match="holds a dict, not DCP Metadata"):
        load_metadata(ck / ".metadata")
    with pytest.raises(RunError, match="cannot read checkpoint metadata"):
        load_metadata(tmp_path / "none" / ".metadata")


# ------------------------------------------------------------------------------------------- lock
def _owner_file(path, pid: int) -> None:
    from treadle.run.lock import proc_state

    st = proc_state(pid)
    path.write_text(json.dumps({"host": __import__("socket").gethostname(), "pid": pid, "started": "then",
                                "proc_start": st[1] if st else ""}))


def test_lock_refuses_a_live_owner_and_takes_over_a_dead_one(tmp_path, caplog):
    from treadle.run.lock import LOCK, DirLock, read_owner

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _owner_file(tmp_path / LOCK, live.pid)
        with pytest.raises(RunError, match=rf"--ckpt-dir {tmp_path} is in use by another job \(host .*, pid "
                                           rf"{live.pid}, started then; lock .*treadle.lock\); wait for it to end"):
            DirLock(tmp_path).acquire()
    finally:
        live.kill()
        live.wait()
    lock = DirLock(tmp_path)
    with caplog.at_level("WARNING", logger="treadle.run.lock"):
        lock.acquire()  # that pid is dead now: a stale lock
    assert f"took over the stale lock {tmp_path / LOCK}" in caplog.text and "that process is gone" in caplog.text
    assert read_owner(tmp_path / LOCK).pid == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK).exists()
    (tmp_path / LOCK).write_text("{torn")  # a torn write: stale
    DirLock(tmp_path).acquire()
    other = tmp_path / "other"
    other.mkdir()
    (other / LOCK).write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "x"}))
    with pytest.raises(RunError, match="in use by another job .host elsewhere, pid 1"):
        DirLock(other).acquire()  # another host's pid cannot be checked from here


# ------------------------------------------------------------------------------------------- settings and data
@pytest.mark.parametrize("line,msg", [
    ('batch = "eight"', r"batch must be an integer, got 'eight' \(a string\)"),
    ("batch = 8.5", r"batch must be an integer, got 8.5 \(a number\)"),
    ("lr = true", r"lr must be a number, got True \(a boolean\)"),
    ("async_ckpt = 1", r"async_ckpt must be true or false, got 1 \(an integer\)"),
    ("data = [1, 2]", r"data must be a string or a list of strings, got \[1, 2\]"),
    ("betas = [0.9]", r"betas must be a list of two numbers"),
    ("precision = 16", r"precision must be a string, got 16"),
    ('memory-budget = "lots"', r"memory-budget 'lots' is not a size"),
    ("batch = [", r"cannot read .*c.toml"),
])
def test_toml_wrong_types(tmp_path, line, msg):
    from test_run_units import _args

    from treadle.run.config import config_from_args

    (tmp_path / "c.toml").write_text(f'model = "tiny-llama"\n{line}\n')
    with pytest.raises(RunError, match=msg):
        config_from_args(_args(["--config", str(tmp_path / "c.toml")]))


@pytest.mark.parametrize("kw,msg", [(dict(keep=-1), "--keep must be >= 0"),
                                    (dict(skip_nonfinite=-2), "--skip-nonfinite must be >= 0"),
                                    (dict(timeout_s=0.0), "--timeout-s must be > 0")])
def test_new_setting_errors(kw, msg):
    from treadle.run.config import RunConfig

    with pytest.raises(RunError, match=msg):
        RunConfig(model="m", data=["x"], **kw)


def test_bad_data_files(tmp_path):
    from treadle.run.data import read_documents

    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not parquet at all")
    with pytest.raises(RunError, match=r"bad.parquet is not a readable Parquet file: .*magic bytes"):
        read_documents(tmp_path / "bad.parquet")
    (tmp_path / "deep.jsonl").write_text('{"text": "ok"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(RunError, match=r"deep.jsonl:2: JSON nested too deeply to read"):
        read_documents(tmp_path / "deep.jsonl")
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(RunError, match=r"latin.jsonl: not UTF-8 text \(byte 13"):
        read_documents(tmp_path / "latin.jsonl")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(RunError, match=r"column 'text' holds int at row 0, not text"):
        read_documents(tmp_path / "ints.parquet")
    (tmp_path / "dir.txt").mkdir()
    with pytest.raises(RunError, match="cannot read data file .*dir.txt"):
        read_documents(tmp_path / "dir.txt")


# ------------------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("argv,msg", [
    (["--nproc", "0"], "treadle run: error: --nproc must be >= 1 (processes on this host), got 0"),
    (["--nproc", "2", "--batch=-4"], "treadle run: error: --batch must be >= 1, got -4"),
    (["--nproc", "1000000"], "treadle run: error: --nproc: 1,000,000 processes on this host exceed the limit of "),
])
def test_treadle_run_refuses_in_one_line(capsys, argv, msg):
    from treadle.cli import main

    assert main(["run", *argv, "--model", "tiny-llama", "--data", "x.txt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(msg) and err.count("\n") == 1, err


def test_process_count_is_checked_before_anything_starts(monkeypatch):
    import treadle
    from treadle import Mesh, testing
    from treadle.errors import SpawnError

    limit, rule = testing.process_limit()
    assert limit >= 16 and ("per core" in rule or "MiB each" in rule)
    t0 = time.monotonic()
    with pytest.raises(SpawnError, match=r"spawn: 1,000,000 processes on this host exceed the limit of .*"
                                         r"set TREADLE_MAX_PROCS=N to allow N processes"):
        testing.spawn(_never_runs, 1_000_000)
    sch = treadle.create_schedule(torch.nn.Linear(4, 4), mesh=Mesh((1000, 1000), ("dp", "tp")))
    with pytest.raises(SpawnError, match=r"verify on mesh .*: 1,000,000 processes"):
        treadle.verify(sch, {"input": torch.randn(2, 4)})
    with pytest.raises(SpawnError, match=r"train on mesh .*: 1,000,000 processes"):
        treadle.train(sch, {"input": torch.randn(2, 4)})
    assert time.monotonic() - t0 < 5
    monkeypatch.setenv("TREADLE_MAX_PROCS", "3")
    assert testing.process_limit() == (3, "TREADLE_MAX_PROCS=3")
    with pytest.raises(SpawnError, match=r"4 processes on this host exceed the limit of 3 \(TREADLE_MAX_PROCS=3\)"):
        testing.spawn(_never_runs, 4)
    monkeypatch.setenv("TREADLE_MAX_PROCS", "many")
    with pytest.raises(SpawnError, match="TREADLE_MAX_PROCS='many' is not a number"):
        testing.process_limit()


def _never_runs(rank, world):
    raise AssertionError("started")


# ------------------------------------------------------------------------------------------- signals, health
def test_stop_signals_are_noted_then_restored():
    from treadle.run.preempt import StopSignals

    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as s:
        assert s.received is None
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert (s.received, s.signum) == ("SIGUSR1", signal.SIGUSR1)  # the first; the save is under way
    assert signal.getsignal(signal.SIGTERM) is before


def test_diagnose_names_the_rank_at_fault():
    from treadle.run import health

    def store_with(beats: dict[int, tuple[float, bool]]):
        store = dist.HashStore()
        for r, (ago, in_coll) in beats.items():
            store.set(f"treadle/run/proc/{r}", json.dumps({"host": "elsewhere", "pid": 100 + r, "error_file": ""}))
            store.set(f"treadle/run/beat/{r}", json.dumps({"t": time.time() - ago, "in_collective": in_coll,
                                                           "where": f"f{r}"}))
            health.mark(5, rank=r, store=store)
        return store

    store = store_with({0: (0.1, True), 1: (30.0, True), 2: (0.2, True)})
    (c,) = health.diagnose(3, me=0, store=store, wait_s=0)
    assert c.rank == 1 and c.describe().startswith("rank 1 (pid 101 on elsewhere) stopped responding (no heartbeat "
                                                   "for 30 s")
    store = store_with({0: (0.1, True), 1: (0.1, False), 2: (0.2, True)})
    (c,) = health.diagnose(3, me=0, store=store, wait_s=0)
    assert c.rank == 1 and "is busy outside any collective at f1 while the others wait (hung)" in c.why
    health.report_failure(2, "ValueError: broken", store=store)  # an error of its own comes first
    (c,) = health.diagnose(3, me=0, store=store, wait_s=0)
    assert (c.rank, c.why, c.own_error) == (2, "failed: ValueError: broken", True)
    store = store_with({0: (0.1, True), 1: (0.1, True)})
    health.mark(3, rank=1, store=store)
    (c,) = health.diagnose(2, me=0, store=store, wait_s=0)
    assert (c.rank, c.why) == (1, "fell behind (last finished step 3)")
    store = store_with({0: (0.1, True), 1: (0.1, False)})
    health.report_failure(1, "RuntimeError: closed", echo=True, store=store)  # failing too, not hung
    assert health.diagnose(2, me=0, store=store, wait_s=0) == []
    assert health.diagnose(2, me=0, store=None) == []  # outside a job: nothing known


def test_a_line_is_said_once_per_job(capsys):
    from treadle.run import failure

    store = dist.HashStore()
    for _ in range(3):  # three ranks with the same error
        failure._say_once("treadle.run: disk full", "disk full", store)
    assert capsys.readouterr().err == "treadle.run: disk full\n"


# ------------------------------------------------------------------------------------------- more refusals
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_refusals(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from treadle.run.checkpoint import _check_metadata, export_hf, verify
    from treadle.run.manifest import read_manifest
    from treadle.run.setup import load_run_model

    ck = tmp_path / "step_00000001"
    _legacy_ckpt(ck)
    _with_manifest(ck)
    doc = json.loads((ck / "manifest.json").read_text())
    del doc["files"][".metadata"]
    (ck / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="lists no .metadata"):
        read_manifest(ck)
    (ck / ".metadata").write_bytes(pickle.dumps(Metadata({"model.w": MetadataIndex("model.w")})))
    (ck / "manifest.json").unlink()
    with pytest.raises(RunError, match=r"model.w is a MetadataIndex, not a tensor"):
        _check_metadata(ck, {"model.w": (2, 3)})
    # an older treadle's checkpoint (no manifest) with a truncated shard: refused by DCP's reader, in one line
    model = load_run_model("tiny-gpt2", seq=8, seed=0)
    old = tmp_path / "step_00000002"
    _legacy_ckpt(old, **{f"model.{n}": p.detach().clone() for n, p in model.named_parameters()})
    assert verify(old) == []  # nothing to check it against
    shard = old / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(RunError, match=rf"checkpoint {old} could not be read on rank 0: "):
        export_hf(old, model, tmp_path / "hf")


def test_failure_reports(tmp_path, capsys, monkeypatch):
    from treadle.run import failure
    from treadle.run.agree import JobError

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert failure.report(JobError("treadle.run: disk full"), rank=1, world=2) == 2
    assert capsys.readouterr().err == ""  # said by rank 0
    doc = json.loads((tmp_path / "error.json").read_text())["message"]
    assert doc["message"] == "treadle.run: disk full" and int(doc["extraInfo"]["timestamp"]) > 0
    assert failure.report(JobError("treadle.run: disk full"), rank=0, world=2) == 2
    assert capsys.readouterr().err == "treadle.run: disk full\n"
    assert failure.report(RunError("treadle.run: no such file"), rank=1, world=2) == 2
    assert capsys.readouterr().err == "treadle.run: rank 1: no such file\n"
    err = RuntimeError("[/x/gloo/transport/tcp/pair.cc:537] Connection closed by peer. This is typically caused by x")
    assert failure.report(err, rank=0, world=2) == 1
    assert capsys.readouterr().err == ("treadle.run: rank 0 failed: RuntimeError: Connection closed by peer (a peer "
                                       "rank died or hung past the collective timeout; nothing in the job's store "
                                       "says which)\n")
    try:
        raise KeyError("a bug")
    except KeyError as exc:
        assert failure.report(exc, rank=1, world=2) == 1
    out = capsys.readouterr().err
    assert out.startswith("treadle.run: rank 1 failed:\nTraceback") and "KeyError: 'a bug'" in out
    monkeypatch.setenv(failure.LAUNCHER_ENV, "1")  # under `treadle run`: the launcher says it
    assert failure.report(RunError("treadle.run: quiet"), rank=0, world=1) == 2
    assert capsys.readouterr().err == ""
    assert failure.report_before_start(RunError("treadle.run: --batch must be >= 1")) == 2
    assert json.loads((tmp_path / "error.json").read_text())["message"]["message"] == \
        "treadle.run: --batch must be >= 1"


def test_a_schedule_file_that_is_no_schedule_is_one_run_error(tmp_path):
    """treadle.run reads schedule and plan files through the gate's JSON reader: deep nesting, text that is no
    JSON and a plan's schedule entry are data, a RunError naming the file (never a RecursionError)."""
    from treadle.run.precheck import read_schedule_text as _read_schedule_text

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(RunError, match=r"deep.json: JSON nested too deeply|deep.json: JSON nested \d+ levels"):
        _read_schedule_text(str(deep))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(RunError, match=r"bad.json is not JSON"):
        _read_schedule_text(str(bad))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": "treadle.plan/1", "schedule": {"format": "treadle.schedule/1"}}))
    assert json.loads(_read_schedule_text(str(plan))) == {"format": "treadle.schedule/1"}
