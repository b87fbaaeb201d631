"""A `treadle.run` job on tiny-llama and the village text, launched by torch.distributed.run on this host, for the
tests that train end to end (checkpoints, resumes, metrics)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from treadle.testing import free_port

ROOT = Path(__file__).resolve().parents[1]


def run_treadle(tmp_path, *extra: str, nproc: int = 4, steps: int = 6, warmup: int = 2):
    """`python -m treadle.run` on `nproc` ranks in `tmp_path` (tiny-llama, seq 32, batch 8, `steps` steps); later
    `extra` arguments override the defaults. Returns the CompletedProcess."""
    def cmd(port: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
                "127.0.0.1", "--master-port", str(port), "-m", "treadle.run", "--model", "tiny-llama", "--data",
                str(ROOT / "examples" / "data" / "village.txt"), "--seq", "32", "--batch", "8", "--steps",
                str(steps), "--lr", "3e-3", "--warmup-steps", str(warmup), "--init", "meta", "--timeout-s", "60",
                *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return run_on_a_free_port(cmd, env=env, timeout=300, cwd=tmp_path)


def run_on_a_free_port(cmd, *, tries: int = 3, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd(port), capture_output=True, text=True, **kwargs)` on a port `free_port` gave, again on
    another one (up to `tries` launches) when the launcher could not bind it: another process took the port between
    `free_port` and torchrun's store (EADDRINUSE, before any rank ran: nothing of the job was written)."""
    for left in range(tries, 0, -1):
        res = subprocess.run(cmd(free_port()), capture_output=True, text=True, **kwargs)
        if res.returncode == 0 or left == 1 or not port_taken(res.stdout + res.stderr):
            return res
    raise AssertionError("unreachable")


def port_taken(output: str) -> bool:
    """Whether a torchrun launch failed because its rendezvous port was in use: the launcher's store server could not
    listen on it (the ranks only connect to it as clients, so a rank's failure never reads so)."""
    return "server socket has failed to listen" in output and "EADDRINUSE" in output


def losses(path) -> dict[int, float]:
    """Step -> loss of a `--metrics` JSONL file."""
    return {r["step"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines())}
