"""The settings of one training run: a typed dataclass, its command-line arguments and a TOML file with the
same keys (command line wins over the file, the file over a plan file's model, batch and seq, those over the
defaults)."""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import TreadleError


class RunError(TreadleError):
    """`treadle.run` was given settings, data or a checkpoint it cannot use."""


# set (to "1") by `treadle run` for its ranks: the launcher says their errors (NOTE [one line per error])
LAUNCHER_ENV = "TREADLE_RUN_LAUNCHER"
# set (to "1") by ``--debug``: a failed rank writes (and, without a launcher, prints) its traceback, user errors too
DEBUG_ENV = "TREADLE_RUN_DEBUG"


Precision = Literal["fp32", "bf16"]


@dataclass(kw_only=True)
class RunConfig:
    """Every setting of `python -m treadle.run`. Sizes are in samples (sequences of `seq` tokens).

    `batch` is the global batch of one optimizer step; each data-parallel rank takes batch / dp samples in
    `grad_accum` forward/backward passes of `micro_batch` samples (give either; the other is derived).
    """

    model: str = ""
    """A zoo name (``tiny-llama``), a local Hugging Face config directory or ``config.json``, or
    ``package.module:function`` returning ``(model, example_inputs)``."""
    schedule: str | None = None
    """A schedule JSON (Schedule.to_json) or plan JSON (treadle plan -o); else `plan` or `recipe`."""
    plan: str | None = None
    """``auto``: rank 0 plans on `cluster` under `memory_budget_bytes`, broadcasts, every rank builds."""
    recipe: Literal["ddp", "fsdp", "megatron", "megatron-fsdp"] = "ddp"
    """Used when neither `schedule` nor `plan` is given: a ready-made schedule over `mesh`."""
    mesh: str | None = None
    """``DPxTP`` for the recipes, e.g. ``2x2``; default: every rank data-parallel (tp=1) or tp only for
    the megatron recipes (dp=1)."""
    cluster: str | None = None
    """Cluster spec for ``--plan auto`` (treadle.cost.cluster.parse_cluster); default NODESxPROCS:cpu/h100. On CPU
    a preset is measured on the launched ranks first (NOTE [plan for this host]); a cluster file is taken as is."""
    nominal: bool = False
    """``--plan auto`` on the cluster preset as it is (a nominal core, loopback links): no measuring."""
    memory_budget_bytes: float | None = None
    data: list[str] = field(default_factory=list)
    """Files or directories of .txt / .jsonl / .parquet."""
    text_field: str = "text"
    tokenizer: str | None = None
    """A directory holding a Hugging Face ``tokenizer.json`` (or the file); default: bytes (ids 0..255)."""
    seq: int = 128
    batch: int = 8
    micro_batch: int | None = None
    grad_accum: int | None = None
    steps: int = 100
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip_norm: float | None = 1.0
    seed: int = 0
    init: Literal["real", "meta"] = "real"
    """``meta``: create the parameters on the meta device and let `build` materialise each rank's part (a seeded
    init per module, the same global weights for any schedule; not the model's own random init): its shards, one
    module (FSDP2 unit) whole at a time, a pipeline's own stages only (NOTE [late materialisation]).
    ``real``: every rank first creates the whole model in host memory (seeded), then `build` slices it."""
    precision: Precision = "fp32"
    compile: bool = False
    ckpt_dir: str | None = None
    ckpt_every: int = 0
    """Save every K optimizer steps (0: only at the end, when `ckpt_dir` is set)."""
    async_ckpt: bool = False
    resume: str = "auto"
    """``auto`` (the newest complete checkpoint in `ckpt_dir`, if any), ``none``, or a checkpoint directory."""
    export_hf: str | None = None
    """After the last step, write a Hugging Face ``save_pretrained`` directory (safetensors) here."""
    metrics: str | None = None
    """A JSONL file, one line per logged step (rank 0)."""
    tensorboard: str | None = None
    log_every: int = 1
    trace: str | None = None
    """Write a Chrome trace (torch.profiler) of the run's last step on every rank: ``{rank}`` in the path is
    replaced by the rank (default: ``-rank<r>`` before the suffix). Open it beside ``treadle explain
    plan.json --trace``; ``treadle explain plan.json --measured FILE`` compares the step times. A pipeline also
    gets its measured timeline (rank 0; ``-pipeline`` for the rank, of the step before the last where there is
    one): ``treadle price schedule.json --measured FILE --trace T`` draws it beside the predicted one."""
    hardware: str = "auto"
    """Peak FLOP/s for MFU: a preset name, ``cpu`` (calibrated), ``none``; ``auto``: the CUDA preset by
    device name, none on CPU."""
    timeout_s: float = 300.0
    """Collective timeout: a dead or hung rank ends the job after at most this long (plus ~10%)."""
    keep: int = 3
    """Keep the newest K complete checkpoints in `ckpt_dir` (older ones are deleted after a save; 0: all)."""
    skip_nonfinite: int = 0
    """Steps whose loss or gradient norm is NaN / inf whose optimizer step may be skipped (logged) before the
    run stops; 0: the first such step stops the run (nothing of that state is ever saved)."""

    def __post_init__(self) -> None:
        if not self.model:
            raise RunError("treadle.run: give --model (a zoo name such as tiny-llama, a HF config directory, "
                           "or package.module:function)")
        if self.schedule and self.plan:
            raise RunError("treadle.run: give --schedule or --plan, not both")
        if self.plan not in (None, "auto") and not Path(self.plan).is_file():
            raise RunError(f"treadle.run: --plan must be 'auto' or a plan JSON file; {self.plan!r} is neither")
        for name in ("seq", "batch", "steps"):
            if getattr(self, name) < 1:
                raise RunError(f"treadle.run: --{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("micro_batch", "grad_accum"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise RunError(f"treadle.run: --{name.replace('_', '-')} must be >= 1, got {v}")
        for name in ("keep", "skip_nonfinite"):
            if getattr(self, name) < 0:
                raise RunError(f"treadle.run: --{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise RunError(f"treadle.run: --timeout-s must be > 0 seconds, got {self.timeout_s}")
        if self.warmup_steps < 0 or self.ckpt_every < 0 or self.log_every < 1:
            raise RunError(f"treadle.run: need warmup_steps >= 0, ckpt_every >= 0, log_every >= 1; got "
                           f"{self.warmup_steps}, {self.ckpt_every}, {self.log_every}")
        if self.init not in ("real", "meta"):
            raise RunError(f"treadle.run: --init must be real or meta, got {self.init!r}")
        if self.precision not in ("fp32", "bf16"):
            raise RunError(f"treadle.run: --precision must be fp32 or bf16, got {self.precision!r}")
        if self.recipe not in ("ddp", "fsdp", "megatron", "megatron-fsdp"):
            raise RunError(f"treadle.run: unknown --recipe {self.recipe!r}; known: ddp, fsdp, megatron, megatron-fsdp")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise RunError(f"treadle.run: need 0 <= min_lr <= lr and lr > 0; got lr={self.lr}, min_lr={self.min_lr}")
        if self.clip_norm is not None and self.clip_norm <= 0:
            self.clip_norm = None
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if not self.data:
            raise RunError("treadle.run: give --data (text, JSONL or Parquet files, or directories of them)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command-line options (every field of RunConfig) plus ``--config FILE.toml``. Defaults are None here
    so that a TOML value is only overridden by an option actually given."""
    p.add_argument("--config", help="TOML file with the same keys as the options (underscores or dashes)")
    for f in dataclasses.fields(RunConfig):
        flag = "--" + f.name.replace("_", "-")
        help_ = f"(default {f.default!r})" if f.default is not dataclasses.MISSING else None
        if f.type in ("bool",):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif f.name == "data":
            p.add_argument(flag, nargs="+", default=None, help="text / JSONL / Parquet files or directories")
        elif f.name == "betas":
            p.add_argument(flag, nargs=2, type=float, default=None, help=help_)
        elif f.name == "memory_budget_bytes":
            p.add_argument("--memory-budget", dest="memory_budget_bytes", type=_bytes, default=None,
                           help="per-device memory for --plan auto, e.g. 16GiB")
        else:
            conv = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
            p.add_argument(flag, type=conv, default=None, help=help_)


def _bytes(text: str) -> float:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "b": 1}
    t = text.strip().lower()
    for u, scale in units.items():
        if t.endswith(u):
            return float(t[: -len(u)]) * scale
    return float(t)


def load_toml(path: str) -> dict[str, Any]:
    """Keys of a TOML file (dashes or underscores). Raises RunError for a missing file, an unknown key, or a
    ``model`` that a file may not name (`treadle.models.zoo.check_file_model_spec`)."""
    p = Path(path)
    if not p.is_file():
        raise RunError(f"treadle.run: config file {path!r} does not exist")
    try:
        raw = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
        raise RunError(f"treadle.run: cannot read {path}: {exc}") from exc
    out = {}
    for k, v in raw.items():
        key = k.replace("-", "_")
        if key == "memory_budget":  # a size with a unit ("16GiB") or a number of bytes
            key = "memory_budget_bytes"
            if isinstance(v, str):
                try:
                    v = _bytes(v)
                except ValueError:
                    raise RunError(f"treadle.run: {path}: {k} {v!r} is not a size; write e.g. '16GiB'") from None
        if key not in _FIELDS:
            raise RunError(f"treadle.run: {path}: unknown key {k!r}; known: {sorted(_FIELDS)}")
        _check_toml_type(path, k, v, str(_FIELDS[key].type))
        out[key] = v
    if isinstance(out.get("data"), str):
        out["data"] = [out["data"]]
    if "model" in out:  # a file's model is data: a zoo name, a HF config, a registered function (NOTE [files are data])
        from ..models.zoo import check_file_model_spec

        try:
            check_file_model_spec(out["model"], source=path)
        except TreadleError as exc:
            raise RunError(f"treadle.run: {exc}") from None
    return out


_TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "list[str]": "a string or a list of strings", "tuple[float, float]": "a list of two numbers"}


def _toml_kind(v: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a table"}
    return next((n for t, n in names.items() if type(v) is t), type(v).__name__)


def _check_toml_type(path: str, key: str, v: Any, type_text: str) -> None:
    """Raise RunError naming the file, key, expected and found type when TOML value `v` cannot be a RunConfig
    field of type `type_text` (the annotation's text; ``X | None`` takes an X: TOML has no null)."""
    base = type_text.removesuffix(" | None")
    if base.startswith("Literal") or base == "Precision":
        base = "str"
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    ok = {"int": isinstance(v, int) and not isinstance(v, bool), "float": number, "bool": isinstance(v, bool),
          "str": isinstance(v, str),
          "list[str]": isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
          "tuple[float, float]": isinstance(v, list) and len(v) == 2
          and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)}.get(base, True)
    if not ok:
        raise RunError(f"treadle.run: {path}: {key} must be {_TYPE_NAMES.get(base, base)}, got {v!r} "
                       f"({_toml_kind(v)})")


def config_from_args(args: argparse.Namespace, *, say: Callable[[str], None] | None = None) -> RunConfig:
    """Defaults < a plan file's model (``--plan plan.json``: its model, batch and seq) < TOML file (`--config`)
    < options given on the command line. A setting that overrides the plan's is said in one line to `say`."""
    values: dict[str, Any] = load_toml(args.config) if getattr(args, "config", None) else {}
    for name in _FIELDS:
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    plan = values.get("plan")
    if isinstance(plan, str) and plan != "auto" and Path(plan).is_file() and not values.get("schedule"):
        line = _take_plan_model(values, plan)
        if line and say is not None:
            say(line)
    return RunConfig(**values)


def _take_plan_model(values: dict[str, Any], path: str) -> str | None:
    """Fill `values`' model, batch and seq from plan file `path`'s ``model`` entry (`treadle plan -o`) where they
    are not set, and `compile` from a compiled plan's execution (NOTE [execution and float8 in the plan]); returns the line saying which settings override the plan's, or None. The plan's model is data
    (a zoo name, a Hugging Face config directory or a registered function: `check_file_model_spec`). Raises
    RunError naming the file when it is not a plan or its model entry is malformed."""
    from ..schedule.gate import parse_json

    try:
        doc = parse_json(Path(path).read_text(), source=f"treadle.run: --plan {path}", error=RunError,
                         unparsable=" is not JSON")
    except (OSError, UnicodeDecodeError) as exc:
        raise RunError(f"treadle.run: cannot read --plan {path}: {exc}") from None
    if isinstance(doc, dict) and doc.get("execution") == "compiled" and "compile" not in values:
        values["compile"] = True  # a plan made for compiled blocks runs them compiled (--no-compile: eager)
    info = doc.get("model") if isinstance(doc, dict) else None
    if info is None:
        return None
    if not isinstance(info, dict):
        raise RunError(f"treadle.run: --plan {path}: 'model' must be an object with name, batch, seq; "
                       f"got {info!r:.80}")
    overrides = []
    for key, field_name in (("name", "model"), ("batch", "batch"), ("seq", "seq")):
        if key not in info:
            continue
        v = info[key]
        if key == "name" and field_name not in values:  # used: then it must be a name a file may give
            from ..models.zoo import check_file_model_spec

            try:
                check_file_model_spec(v, source=f"--plan {path}")
            except TreadleError as exc:
                raise RunError(f"treadle.run: {exc}") from None
        elif key != "name" and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise RunError(f"treadle.run: --plan {path}: the plan's {key} must be a positive integer, got {v!r:.40}")
        if field_name not in values:
            values[field_name] = v
        elif values[field_name] != v:
            overrides.append((f"--{field_name} {values[field_name]}", f"{field_name} {v}"))
    if not overrides:
        return None
    flags, plans = (", ".join(x) for x in zip(*overrides))
    return f"treadle.run: {flags} override{'s' if len(overrides) == 1 else ''} {path}'s {plans}"


def recipe_mesh(cfg: RunConfig, world: int) -> tuple[int, int]:
    """(dp, tp) of a recipe run (no schedule or plan) on `world` ranks: ``--mesh DPxTP``, else every rank
    data-parallel (tensor-parallel for the megatron recipes). Raises RunError when --mesh does not read or does
    not have `world` ranks."""
    if cfg.mesh:
        try:
            dp, tp = (int(x) for x in cfg.mesh.lower().split("x"))
        except ValueError:
            raise RunError(f"treadle.run: --mesh {cfg.mesh!r}: write DPxTP, e.g. 2x2") from None
    else:
        dp, tp = (1, world) if cfg.recipe.startswith("megatron") else (world, 1)
    if dp < 1 or tp < 1 or dp * tp != world:
        raise RunError(f"treadle.run: --mesh {cfg.mesh} has {dp * tp} ranks but the job has {world}; give a "
                       f"DPxTP mesh of {world} ranks, or launch {dp * tp} processes")
    return dp, tp
