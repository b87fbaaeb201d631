"""`treadle.run --recipe megatron` on a model no named recipe knows (Qwen3: LLaMA's module names plus per-head q/k
norms): rank 0 writes the recipe as a constrained plan and broadcasts it, and the job trains on 2 ranks with the
loss curve of one process (the norms' gradients summed over the tensor axis)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "examples" / "data" / "village.txt"
ARGS = ["--model", "arch_suite:qwen3_for_run", "--data", str(CORPUS), "--seq", "16", "--batch", "4", "--steps", "3",
        "--lr", "3e-3", "--warmup-steps", "1", "--timeout-s", "60"]


def _run(tmp_path: Path, nproc: int, *extra: str) -> dict[int, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    metrics = tmp_path / f"m{nproc}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "treadle.run", *ARGS, *extra, "--metrics", str(metrics)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}


@pytest.mark.slow
def test_the_megatron_recipe_as_a_plan_trains_like_one_process(tmp_path):
    one = _run(tmp_path, 1, "--recipe", "ddp")
    tp2 = _run(tmp_path, 2, "--recipe", "megatron", "--mesh", "1x2")
    assert sorted(one) == sorted(tp2) == [1, 2, 3]
    for step in one:
        assert abs(tp2[step] - one[step]) <= 1e-4 * abs(one[step]), (one, tp2)
