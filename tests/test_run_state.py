"""treadle.run never loses or corrupts its state, on 2 gloo ranks: a damaged newest checkpoint is passed over for
the older one, whose weights load bit for bit; a NaN loss stops the run (or is skipped, up to --skip-nonfinite)
and is never saved; SIGTERM saves at the next step boundary and the run resumes on the uninterrupted curve; a
full disk, a directory held by another job, an unusable --ckpt-dir and crafted metadata end the run with one
line, exit status 2, and the last good checkpoint kept. The torchrun tests (slow) stop a rank with SIGSTOP and
preempt `treadle run` itself."""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from treadle.testing import free_port, spawn

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "examples" / "data" / "village.txt"
ARGS = ["--model", "run_fault_models:fault_llama", "--data", str(CORPUS), "--seq", "16", "--batch", "4",
        "--warmup-steps", "2", "--timeout-s", "60"]


def _main_rank(rank: int, world: int, argv: list[str], env: dict[str, str], enospc_step: int | None):
    """`python -m treadle.run argv` on this rank: (exit status, stderr, stdout). `enospc_step`: the DCP
    writer raises ENOSPC for the files of that step's save (when no small tmpfs could be mounted)."""
    import contextlib
    import io

    os.environ.update(env)
    if enospc_step is not None:
        from torch.distributed.checkpoint import filesystem

        real = filesystem.FileSystem.create_stream

        @contextlib.contextmanager
        def full_disk(self, path, mode):
            if "w" in mode and f"step_{enospc_step:08d}" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            with real(self, path, mode) as stream:
                yield stream

        filesystem.FileSystem.create_stream = full_disk
    from treadle.run.loop import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        status = main(argv)
    return status, err.getvalue(), out.getvalue()


def _run(argv: list[str], fault: str = "", *, enospc_step: int | None = None) -> tuple[list[int], str, str]:
    res = spawn(_main_rank, 2, [*ARGS, *argv], {"TREADLE_TEST_FAULT": fault}, enospc_step, timeout_s=180)
    return [r[0] for r in res], "".join(r[1] for r in res), "".join(r[2] for r in res)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _saved(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read in this process (its metadata as data)."""
    import torch.distributed.checkpoint as dcp

    from treadle.run.safe_pickle import SafeReader, load_metadata

    md = load_metadata(path / ".metadata").state_dict_metadata
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items()}
    dcp.load(sd, storage_reader=SafeReader(str(path)), no_dist=True)
    return sd


def _steps(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.iterdir() if p.name != "treadle.lock")


# ------------------------------------------------------------------------------------------- integrity
def _fallback_rank(rank: int, world: int, path: str, damage: str):
    import torch.distributed as dist
    from test_run_reshard import _batches, _make, _step

    from treadle.run import checkpoint as ckpt
    from treadle.run.layout import unwrap

    def full_state(sch, built, lay, opt):
        out = {}
        for n, p in unwrap(built).named_parameters():
            out[f"model.{n}"] = lay[n].gather_full(p, sch.mesh).clone()
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optim.{n}.{k}"] = lay[n].gather_full(opt.state[p][k], sch.mesh).clone()
        return out

    a = _make("megatron", (1, 2))  # GPT-2's fused q|k|v: saved by the gathered path
    saver = ckpt.Checkpointer(path, keep=0)
    saved, losses = {}, []
    for step, batch in enumerate(_batches(), 1):
        losses.append(_step(*a, batch))
        if step in (2, 4):
            saver.save(a[1], a[3], a[2], a[0].mesh, step=step)
            saved[step] = full_state(*a)
    if rank == 0:  # damage the newest
        shard = ckpt.step_dir(path, 4) / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        if damage == "flip":
            data[len(data) // 3] ^= 0x40
            shard.write_bytes(bytes(data))
        else:
            shard.write_bytes(bytes(data[: len(data) // 2]))
    dist.barrier()
    source = ckpt.resume_source("auto", path)
    b = _make("megatron", (1, 2))
    step = ckpt.load(source, b[1], b[3], b[2], b[0].mesh)
    loaded = full_state(*b)
    again = [_step(*b, batch) for batch in _batches()[2:]]
    return source.name, step, saved[2] if rank == 0 else None, loaded if rank == 0 else None, losses, again


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_newest_checkpoint_resumes_the_older_bit_for_bit(tmp_path, damage, caplog):
    ck = tmp_path / "ck"
    results = spawn(_fallback_rank, 2, str(ck), damage, timeout_s=180)
    name, step, saved, loaded, losses, again = results[0]
    assert (name, step) == ("step_00000002", 2)
    assert sorted(saved) == sorted(loaded) and len(saved) > 10
    for key, t in saved.items():  # weights and AdamW moments exactly as saved
        assert torch.equal(loaded[key], t), key
    assert again == losses[2:]  # the resumed steps retrace the first run bit for bit
    assert _steps(ck) == ["step_00000002", "step_00000004.corrupt"]  # moved aside, not tried again


def test_damaged_checkpoint_is_named_in_the_log_and_refused_when_asked_for(tmp_path):
    ck = tmp_path / "ck"
    status, err, _ = _run(["--steps", "2", "--ckpt-every", "1", "--ckpt-dir", str(ck)])
    assert status == [0, 0], err
    shard = ck / "step_00000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    status, err, out = _run(["--steps", "2", "--ckpt-dir", str(ck), "--resume", str(ck / "step_00000002")])
    assert status == [2, 2]
    assert _lines(err) == [f"treadle.run: checkpoint {ck / 'step_00000002'} is damaged: {shard}: "
                           f"{shard.stat().st_size} bytes, the manifest says {shard.stat().st_size + 10} (truncated "
                           f"or overwritten); resume from another checkpoint (--resume DIR) or start afresh "
                           f"(--resume none)"], err
    status, err, out = _run(["--steps", "3", "--ckpt-dir", str(ck)])
    assert status == [0, 0], err
    assert f"checkpoint {ck / 'step_00000002'} is damaged: {shard}" in err and "falling back" in err
    assert "resumed from" in out and "step_00000001" in out


# ------------------------------------------------------------------------------------------- non-finite
def test_nan_loss_stops_the_run_and_is_never_saved(tmp_path):
    ck = tmp_path / "ck"
    status, err, out = _run(["--steps", "6", "--ckpt-every", "1", "--keep", "0", "--ckpt-dir", str(ck)], "nan:1:3")
    assert status == [2, 2]
    assert _lines(err) == [f"treadle.run: step 3: loss nan on rank 1; global loss nan, gradient norm nan: stopped, "
                           f"nothing of this state saved (the newest checkpoint is {ck / 'step_00000002'}); "
                           f"--skip-nonfinite 1 would skip such steps"], err
    assert _steps(ck) == ["step_00000001", "step_00000002"]  # and the lock was released
    assert "step 3/6" not in out


def test_skip_nonfinite_skips_the_update_then_stops(tmp_path):
    ck = tmp_path / "ck"
    status, err, _ = _run(["--steps", "6", "--ckpt-every", "1", "--keep", "0", "--ckpt-dir", str(ck),
                           "--skip-nonfinite", "1"], "nan:1:3,5")
    assert status == [2, 2]
    assert "step 3: loss nan on rank 1; global loss nan, gradient norm nan: optimizer step skipped (1 of " \
           "--skip-nonfinite 1)" in err
    assert "treadle.run: step 5: loss nan on rank 1" in err and "--skip-nonfinite 2 would skip" in err
    assert _steps(ck) == [f"step_0000000{i}" for i in range(1, 5)]
    two, three, four = (_saved(ck / f"step_0000000{i}") for i in (2, 3, 4))
    for key, t in two.items():
        if key.startswith(("model.", "optim.")):
            assert torch.equal(three[key], t), key  # step 3's update was not applied
            assert torch.isfinite(four[key]).all(), key
    assert not torch.equal(four["model.inner.lm_head.weight"], two["model.inner.lm_head.weight"])  # step 4 trained


# ------------------------------------------------------------------------------------------- preemption
def test_sigterm_saves_at_the_next_step_and_the_resume_retraces_the_curve(tmp_path):
    status, err, _ = _run(["--steps", "6", "--metrics", str(tmp_path / "whole.jsonl")])
    assert status == [0, 0], err
    whole = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "whole.jsonl").read_text().splitlines())}
    ck = tmp_path / "ck"
    status, err, out = _run(["--steps", "6", "--ckpt-dir", str(ck)], "sigterm:1:3")  # rank 1 only
    assert status == [0, 0], err
    assert "treadle.run: stop requested (SIGTERM on rank 1) at step 4 of 6: saved " \
           f"{ck / 'step_00000004'}; run the same command to resume" in out
    assert _steps(ck) == ["step_00000004"]
    status, err, out = _run(["--steps", "6", "--ckpt-dir", str(ck), "--metrics", str(tmp_path / "resumed.jsonl")])
    assert status == [0, 0], err
    resumed = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "resumed.jsonl").read_text().splitlines())}
    assert resumed == {5: whole[5], 6: whole[6]}


# ------------------------------------------------------------------------------------------- I/O and ownership
def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True)
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_during_a_save_keeps_the_last_checkpoint(tmp_path, mode):
    ck = tmp_path / "small"
    mounted = _mount_tmpfs(ck, "4m")  # one checkpoint of tiny LLaMA (~2.9 MB) fits, two do not
    try:
        status, err, _ = _run(["--steps", "4", "--ckpt-every", "1", "--keep", "2", "--ckpt-dir", str(ck),
                               *(["--async-ckpt"] if mode == "async" else [])],
                              enospc_step=None if mounted else 2)
        assert status == [2, 2], err
        (line,) = _lines(err)
        assert line.startswith("treadle.run: rank ") and "could not write checkpoint step 2: No space left on " \
                                                          "device" in line, line
        assert line.endswith(f"the newest complete checkpoint, {ck / 'step_00000001'}, is kept (free space in {ck}?)")
        assert _steps(ck) == ["step_00000001"]  # no partial directory left behind
        from treadle.run.checkpoint import verify

        assert verify(ck / "step_00000001") == []
    finally:
        if mounted:
            subprocess.run(["umount", str(ck)], check=False)


def test_a_second_job_is_refused_and_a_stale_lock_taken_over(tmp_path):
    from test_run_state_units import _owner_file

    ck = tmp_path / "ck"
    ck.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # the other job's rank 0
    try:
        _owner_file(ck / "treadle.lock", other.pid)
        status, err, out = _run(["--steps", "1", "--ckpt-dir", str(ck)])
        assert status == [2, 2]
        (line,) = _lines(err)
        assert line.startswith(f"treadle.run: --ckpt-dir {ck} is in use by another job (host ") and \
               f"pid {other.pid}" in line, err
        assert "step 1/1" not in out
    finally:
        other.kill()
        other.wait()
    status, err, out = _run(["--steps", "1", "--ckpt-dir", str(ck)])  # that job is gone now
    assert status == [0, 0], err
    assert f"took over the stale lock {ck / 'treadle.lock'}" in err and "that process is gone" in err
    assert _steps(ck) == ["step_00000001"]


def test_unusable_ckpt_dir_is_found_before_the_first_step(tmp_path):
    (tmp_path / "file").write_text("x")
    status, err, out = _run(["--steps", "1", "--ckpt-dir", str(tmp_path / "file" / "ck")])
    assert status == [2, 2]
    assert _lines(err) == [f"treadle.run: --ckpt-dir '{tmp_path / 'file' / 'ck'}' cannot be used: it, or a "
                           f"directory above it, is a file; give a directory this job can write"]
    assert out == ""  # nothing loaded, nothing trained


def test_crafted_metadata_is_refused_on_resume(tmp_path):
    from test_run_state_units import _Evil, _legacy_ckpt, _with_manifest

    marker = tmp_path / "marker"
    ck = tmp_path / "ck"
    crafted = ck / "step_00000009"
    _legacy_ckpt(crafted)
    (crafted / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    _with_manifest(crafted)  # the manifest agrees: the content is what is refused
    status, err, _ = _run(["--steps", "1", "--resume", str(crafted)])
    assert status == [2, 2]
    assert _lines(err) == [f"treadle.run: checkpoint {crafted} is damaged: checkpoint metadata {crafted / '.metadata'} "
                           f"refers to posix.system, which DCP metadata never holds: refused unread (was the file "
                           f"replaced or crafted?); load only checkpoints a treadle run wrote; resume from another "
                           f"checkpoint (--resume DIR) or start afresh (--resume none)"], err
    status, err, out = _run(["--steps", "1", "--ckpt-dir", str(ck)])
    assert status == [0, 0], err
    assert "refers to posix.system" in err and "no intact checkpoint" in err and "steps 0..1" in out
    assert not marker.exists()


# ------------------------------------------------------------------------------------------- under torchrun
def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1"}


def _workers(pid: int) -> list[int]:
    from test_run_torchrun import _children

    return _children(pid)


def _wait_for(path: Path, proc: subprocess.Popen, limit_s: float = 240) -> None:
    deadline = time.monotonic() + limit_s
    while not path.is_dir():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"no {path} after {limit_s} s"
        time.sleep(0.05)


@pytest.mark.slow
def test_stopped_rank_ends_the_job_within_the_timeout_and_is_the_root_cause(tmp_path):
    ck, timeout_s = tmp_path / "ck", 15
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "treadle.run", "--model", "tiny-llama", "--data", str(CORPUS),
           "--seq", "16", "--batch", "8", "--recipe", "megatron", "--mesh", "2x2", "--steps", "2000",
           "--ckpt-dir", str(ck), "--ckpt-every", "2", "--timeout-s", str(timeout_s), "--log-every", "1000"]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(ck / "step_00000002", proc)
        workers = _workers(proc.pid)
        assert len(workers) == 4, workers
        os.kill(workers[2], signal.SIGSTOP)
        stopped_at = time.monotonic()
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - stopped_at
    assert proc.returncode != 0
    assert took < timeout_s * 1.1 + 5, (took, out[-3000:])  # + tearing the ranks down on a loaded host
    ours = [line for line in out.splitlines() if line.startswith("treadle.run: rank")]
    assert len(ours) == 1 and ours[0].startswith(f"treadle.run: rank 2 (pid {workers[2]} on ") \
           and "is stopped (SIGSTOP" in ours[0], out[-3000:]
    root = out.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 2 (local_rank: 2)" in root.split("====", 1)[0], out[-3000:]


@pytest.mark.slow
def test_treadle_run_preempted_by_sigterm_saves_and_resumes(tmp_path):
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "treadle.cli", "run", "--nproc", "2", "--model", "tiny-llama", "--data", str(CORPUS),
           "--seq", "16", "--batch", "4", "--steps", "3000", "--ckpt-dir", str(ck), "--ckpt-every", "5",
           "--log-every", "1000", "--keep", "1"]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(ck / "step_00000005", proc)
        os.kill(proc.pid, signal.SIGTERM)  # the launcher forwards it to the ranks
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "SIGTERM received: saving a checkpoint at the next step boundary" in out, out[-3000:]
    saved = [line for line in out.splitlines() if line.startswith("treadle.run: stop requested (SIGTERM on rank")]
    assert len(saved) == 1, out[-3000:]
    step = int(saved[0].split(" at step ")[1].split(" ")[0])
    assert step > 5 and _steps(ck) == [f"step_{step:08d}"], (out[-3000:], _steps(ck))
    res = subprocess.run([*cmd[:cmd.index("--steps") + 1], str(step + 2), *cmd[cmd.index("--steps") + 2:]],
                         env=_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"resumed from {ck / f'step_{step:08d}'}" in res.stdout


@pytest.mark.slow
@pytest.mark.parametrize("debug", [[], ["--debug"]], ids=["plain", "debug"])
def test_treadle_run_says_a_failed_job_in_one_line(tmp_path, debug):
    """An error only the ranks meet (the data's content; a missing path is refused before they start:
    tests/test_cli_errors.py) is said once, by the launcher, with the rank; with --debug the failed rank's
    traceback comes first (from its error file), then the same line."""
    data = tmp_path / "docs.jsonl"
    data.write_text('{"body": "no text field"}\n')
    res = subprocess.run([sys.executable, "-m", "treadle.cli", "run", "--nproc", "2", "--model", "tiny-llama",
                          "--data", str(data), "--steps", "1", *debug],
                         env=_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 2
    lines = _lines(res.stderr)
    line = lines[-1]  # no torchrun banner, no per-rank echo, no ChildFailedError traceback
    assert line in [f"treadle run: error: rank {r}: {data}:1: no string field 'text' (set --text-field); keys: "
                    f"['body']" for r in (0, 1)], res.stderr
    if not debug:
        assert len(lines) == 1, res.stderr
    else:
        assert lines[0] == "treadle run: the failed rank's traceback (--debug):", res.stderr
        assert "Traceback (most recent call last):" in res.stderr and "treadle/run/data.py" in res.stderr
        assert "ChildFailedError" not in res.stderr and sum("treadle run: error:" in x for x in lines) == 1
