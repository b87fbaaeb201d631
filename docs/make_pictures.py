"""Regenerate the README's pictures into docs/img/: one per kind, from the README's Llama-3-8B plan and a
GPT-2 profile (fake tensors: no downloads, no GPU; a few minutes on a laptop). The plan is drawn from
its price (`timeline_from_plan` -> `treadle.viz.timeline_from_price`), the numbers `treadle explain` prints.

    python docs/make_pictures.py            # needs matplotlib (pip install -e '.[viz]')

Writes plan-timeline.png (the predicted step, as the Chrome trace shows it), plan-memory.png,
plan-breakdown.png, profile-memory.png, and plan-report.png (a screenshot of the HTML report) when a
headless chromium is on the PATH. The trace and the HTML report themselves go to a temporary directory
(print its path with --keep).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from treadle.cost.cluster import parse_cluster  # noqa: E402
from treadle.models.zoo import named_model  # noqa: E402
from treadle.planner import plan_model  # noqa: E402
from treadle.profile import profile  # noqa: E402
from treadle.viz import timeline_from_plan, write_chrome_trace  # noqa: E402
from treadle.viz.html import plan_html  # noqa: E402
from treadle.viz.png import breakdown_figure, memory_figure, profile_memory_figure, timeline_figure  # noqa: E402

OUT = Path(__file__).parent / "img"


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    model, inputs = named_model("llama-3-8b", batch=32, seq=4096, fake=True)
    plan = plan_model(model, inputs, cluster=parse_cluster("8x8:h100"), memory_budget_bytes=80 * 2**30,
                      model_spec={"name": "llama-3-8b", "batch": 32, "seq": 4096, "dtype": "fp32"})
    tl = timeline_from_plan(plan)
    tmp = Path(tempfile.mkdtemp(prefix="treadle-pictures-"))
    write_chrome_trace(tl, str(tmp / "plan-trace.json"))
    (tmp / "plan-report.html").write_text(plan_html(plan, timeline=tl))
    for name, make in (("timeline", timeline_figure), ("memory", memory_figure), ("breakdown", breakdown_figure)):
        make(tl).savefig(OUT / f"plan-{name}.png")
    model, inputs = named_model("gpt2", batch=8, seq=1024, fake=True)
    profile_memory_figure(profile(model, inputs, hardware="h100-sxm", name="gpt2")).savefig(OUT / "profile-memory.png")
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=1150,1500", f"--screenshot={OUT / 'plan-report.png'}",
                        (tmp / "plan-report.html").resolve().as_uri()], check=True, capture_output=True, timeout=120)
    else:
        print("no chromium on the PATH: plan-report.png not refreshed", file=sys.stderr)
    for p in sorted(OUT.iterdir()):
        print(p)
    if "--keep" in sys.argv:
        print(f"trace and report in {tmp}")
    else:
        shutil.rmtree(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
