"""Start-up time of treadle's entry points, side by side with ``python -c "import torch"``.

Each case runs in a fresh interpreter, 5 times (the median is reported), with this tree's ``src`` first on the
path. The cases: ``import torch`` (the yardstick), ``import treadle``, ``treadle --help`` and a user error of
each entry point that needs no model (they must say their one line, exit 2, before building or spawning
anything). Target: ``treadle --help`` and every CLI user error within 1.5x of ``import torch``.

Run:  HF_HUB_OFFLINE=1 .venv/bin/python bench/bench_startup.py [--runs 5] [--only NAME ...]
Writes bench/results/bench_startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TARGET_RATIO = 1.5


def _plan_file(tmp: Path) -> Path:
    """A plan of the README's shape: llama-3-8b on 64 devices (the 16x4 mesh `treadle plan llama-3-8b --cluster
    8x8:h100` picks); only its model and mesh are read before `--world` is refused."""
    schedule = {"format": "treadle.schedule/1", "mesh": {"shape": [16, 4], "names": ["dp", "tp"]}, "records": []}
    doc = {"format": "treadle.plan/1", "model": {"name": "llama-3-8b", "batch": 32, "seq": 4096, "dtype": "bf16"},
           "decisions": [], "schedule": schedule}
    path = tmp / "plan.json"
    path.write_text(json.dumps(doc))
    return path


def cases(tmp: Path) -> list[tuple[str, list[str], int | None]]:
    """(name, argv after the interpreter, the exit status it must end with; None: not checked)."""
    plan = _plan_file(tmp)
    text = tmp / "corpus.txt"
    text.write_text("a line of text for the byte tokenizer\n" * 200)
    cli = ["-m", "treadle.cli"]
    return [
        ("import torch", ["-c", "import torch"], 0),
        ("import treadle", ["-c", "import treadle"], 0),
        ("treadle --help", [*cli, "--help"], 0),
        ("treadle verify plan.json --world 4 (64-device plan)", [*cli, "verify", str(plan), "--world", "4"], 2),
        ("treadle plan no-such-model", [*cli, "plan", "lama-3-8b", "--cluster", "8x8:h100", "--batch", "32",
                                        "--seq", "4096"], 2),
        ("treadle price missing.json", [*cli, "price", str(tmp / "missing.json"), "--cluster", "2x2:cpu"], 2),
        ("treadle profile gpt-2 (misspelt)", [*cli, "profile", "gpt-2"], 2),
        ("treadle run (no --data)", [*cli, "run", "--nproc", "2", "--model", "tiny-llama"], 2),
        ("treadle run --data missing.txt", [*cli, "run", "--nproc", "2", "--model", "tiny-llama", "--data",
                                            str(tmp / "missing.txt")], 2),
        ("treadle run --recipe zero", [*cli, "run", "--nproc", "2", "--model", "tiny-llama", "--data", str(text),
                                       "--recipe", "zero"], 2),
        ("treadle run --model tiny-lama (misspelt)", [*cli, "run", "--nproc", "2", "--model", "tiny-lama",
                                                      "--data", str(text)], 2),
        ("treadle run --nproc 3 --mesh 2x2", [*cli, "run", "--nproc", "3", "--mesh", "2x2", "--model", "tiny-llama",
                                              "--data", str(text)], 2),
        ("python -m treadle.run (no --data)", ["-m", "treadle.run", "--model", "tiny-llama"], 2),
    ]


def time_case(argv: list[str], runs: int, env: dict[str, str]) -> tuple[float, list[float], int, str]:
    """(median seconds, all seconds, last exit status, last stderr line) over `runs` fresh interpreters."""
    times, rc, err = [], 0, ""
    for _ in range(runs):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=600)
        times.append(time.perf_counter() - t0)
        rc, err = p.returncode, (p.stderr.strip().splitlines() or [""])[-1]
    return statistics.median(times), times, rc, err


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--only", nargs="*", help="run only the cases whose name contains one of these")
    ap.add_argument("--json", default=str(RESULTS / "bench_startup.json"))
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HF_HUB_OFFLINE="1")
    env.pop("TREADLE_RUN_LAUNCHER", None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        todo = cases(Path(tmp))
        if args.only:
            todo = [c for c in todo if c[0] == "import torch" or any(k in c[0] for k in args.only)]
        base = None
        for name, argv, want in todo:
            med, times, rc, err = time_case(argv, args.runs, env)
            base = med if name == "import torch" else base
            ratio = med / base if base else float("nan")
            gated = name not in ("import torch", "import treadle")
            ok = (want is None or rc == want) and (not gated or ratio <= TARGET_RATIO)
            rows.append({"case": name, "median_s": med, "runs_s": times, "ratio_to_torch": ratio, "exit": rc,
                         "want_exit": want, "gated": gated, "ok": ok, "stderr_tail": err[:200]})
            print(f"{name:50s} {med:6.2f} s  {ratio:5.2f}x  exit {rc}" + ("" if ok else "  <-- MISSED")
                  + (f"  | {err[:90]}" if err and rc else ""), flush=True)
    passed = all(r["ok"] for r in rows)
    print(f"\ntarget: --help and every user error <= {TARGET_RATIO}x import torch, with its exit status: "
          + ("met" if passed else "MISSED"))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": args.runs, "target_ratio": TARGET_RATIO, "python": sys.version.split()[0],
                               "cpus": os.cpu_count(), "passed": passed, "cases": rows}, indent=1))
    print(f"wrote {out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
