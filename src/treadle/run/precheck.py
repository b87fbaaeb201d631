"""Checks of a run's settings that need no process group and no model: the model names something loadable, the
data and the tokenizer exist, and the mesh of the schedule, plan or recipe has the job's world size. `treadle
run` calls them before it spawns a rank, each rank of ``python -m treadle.run`` before its process group, so
a wrong command is one line within seconds (`preflight` checks, on every rank, what needs the job)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import TreadleError
from .config import RunConfig, RunError, recipe_mesh


def check_before_start(cfg: RunConfig, *, world: int | None) -> None:
    """Raise RunError naming the first setting of `cfg` that cannot work on `world` ranks (None: the world is
    not known yet; its checks wait for `setup.make_schedule`). Nothing is imported from the model's library,
    built or started."""
    check_model_spec(cfg.model)
    from .data import list_files

    list_files(cfg.data)
    if cfg.tokenizer:
        p = Path(cfg.tokenizer)
        if not (p / "tokenizer.json" if p.is_dir() else p).is_file():
            raise RunError(f"treadle.run: tokenizer {cfg.tokenizer!r}: no tokenizer.json there")
    if cfg.export_hf and not cfg.ckpt_dir:
        raise RunError("treadle.run: --export-hf writes from the final checkpoint; give --ckpt-dir too")
    if world is None:
        return
    if cfg.schedule or (cfg.plan and cfg.plan != "auto"):
        check_schedule_world(read_schedule_text(cfg.schedule or cfg.plan), world)
    elif cfg.plan is None:
        recipe_mesh(cfg, world)


def check_model_spec(spec: str) -> None:
    """`--model` as the command line gives it: a directory with a Hugging Face ``config.json`` (or the file), a
    zoo name, or ``package.module:function`` (imported later, as given). Raises RunError naming the spec."""
    p = Path(spec)
    if p.is_dir() or p.name == "config.json":
        if not (p / "config.json" if p.is_dir() else p).is_file():
            raise RunError(f"treadle.run: --model {spec!r}: no config.json there")
        return
    from ..models.zoo import check_model_name

    try:
        check_model_name(spec)
    except TreadleError as exc:
        raise RunError(f"treadle.run: --model {spec!r}: {exc}") from None


def read_schedule_text(path: str) -> str:
    """The schedule JSON text of a schedule file or of a plan file (its "schedule" entry). Raises RunError for
    a missing or unparsable file."""
    from ..schedule.gate import parse_json

    p = Path(path)
    if not p.is_file():
        raise RunError(f"treadle.run: schedule file {path!r} does not exist")
    doc = parse_json(p.read_text(), source=f"treadle.run: {path}", error=RunError, unparsable=" is not JSON")
    if isinstance(doc, dict) and "schedule" in doc:
        s = doc["schedule"]
        return s if isinstance(s, str) else json.dumps(s)
    return p.read_text()


def check_schedule_world(text: str, world: int) -> None:
    """Raise RunError when the mesh of schedule JSON `text` does not have `world` ranks."""
    from ..schedule.gate import parse_json

    doc = parse_json(text, source="treadle.run: the schedule", error=RunError)
    saved = doc.get("mesh", {}) if isinstance(doc, dict) else {}
    shape = tuple(saved.get("shape", ())) if isinstance(saved, dict) and isinstance(saved.get("shape"), list) else ()
    if math.prod(shape) != world:
        names = saved.get("names", ()) if isinstance(saved, dict) else ()
        raise RunError(f"treadle.run: the schedule's mesh {dict(zip(names, shape))} needs {math.prod(shape)} ranks, "
                       f"but the job has {world}; launch with that many processes")
