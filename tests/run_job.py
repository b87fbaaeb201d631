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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "treadle.run", "--model", "tiny-llama", "--data",
           str(ROOT / "examples" / "data" / "village.txt"), "--seq", "32", "--batch", "8", "--steps", str(steps),
           "--lr", "3e-3", "--warmup-steps", str(warmup), "--init", "meta", "--timeout-s", "60", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def losses(path) -> dict[int, float]:
    """Step -> loss of a `--metrics` JSONL file."""
    return {r["step"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines())}
