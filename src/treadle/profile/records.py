"""What a profile holds: one record per ATen op, per-module aggregates, and model totals. Plain data; bytes,
FLOPs and seconds.

Memory figures count *activation memory*: bytes of storages that ops allocate during the step (activations,
temporaries, gradients). `resident_bytes` (parameters, buffers, inputs, optimizer state) is added for the peak.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from .hardware import HardwareSpec

PHASES = ("forward", "backward", "recompute")


class OpRecord:
    """One ATen op as it ran (forward, backward, or recomputation inside backward).

    flops: FLOPs of this op (2 per multiply-add; matrix products only, see `treadle.profile.flops`).
    backward_flops: FLOPs of this forward op's backward by formula, for the inputs that required grad
        (0 for backward and recompute ops, whose own `flops` already are backward work).
    read_bytes / write_bytes: bytes the op reads and writes (0 for views).
    output_bytes: bytes of storages the op newly allocated.
    saved_bytes: bytes of those storages that autograd saved for backward (each storage counted once, at the op
        that produced it; views of one tensor count once).
    temp_bytes: bytes of those storages freed again before the forward ended (forward temporaries).
    live_before_bytes / live_after_bytes: activation bytes live when the op started / right after it allocated
        its outputs (the timeline; its maximum is the activation peak).
    time_s: roofline time on the profile's hardware.
    """

    __slots__ = ("index", "op", "kind", "module", "phase", "dtype", "flops", "backward_flops", "read_bytes",
                 "write_bytes", "output_bytes", "saved_bytes", "temp_bytes", "live_before_bytes", "live_after_bytes",
                 "time_s")

    def __init__(self, index: int, op: str, kind: str, module: str, phase: str, dtype: str) -> None:
        self.index = index
        self.op = op
        self.kind = kind
        self.module = module
        self.phase = phase
        self.dtype = dtype
        self.flops = 0
        self.backward_flops = 0
        self.read_bytes = 0
        self.write_bytes = 0
        self.output_bytes = 0
        self.saved_bytes = 0
        self.temp_bytes = 0
        self.live_before_bytes = 0
        self.live_after_bytes = 0
        self.time_s = 0.0

    def copy_to(self, *, index: int, module: str, live_offset_bytes: int) -> "OpRecord":
        """A copy at another position and module path, its timeline shifted by `live_offset_bytes`."""
        r = _new_record(OpRecord)
        r.index = index
        r.op = self.op
        r.kind = self.kind
        r.module = module
        r.phase = self.phase
        r.dtype = self.dtype
        r.flops = self.flops
        r.backward_flops = self.backward_flops
        r.read_bytes = self.read_bytes
        r.write_bytes = self.write_bytes
        r.output_bytes = self.output_bytes
        r.saved_bytes = self.saved_bytes
        r.temp_bytes = self.temp_bytes
        r.live_before_bytes = self.live_before_bytes + live_offset_bytes
        r.live_after_bytes = self.live_after_bytes + live_offset_bytes
        r.time_s = self.time_s
        return r

    def to_dict(self) -> dict[str, Any]:
        return {s: getattr(self, s) for s in OpRecord.__slots__}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OpRecord":
        r = cls(d["index"], d["op"], d["kind"], d["module"], d["phase"], d["dtype"])
        for s in OpRecord.__slots__:
            setattr(r, s, d[s])
        return r

    def __repr__(self) -> str:
        return (f"OpRecord(index={self.index}, op={self.op!r}, module={self.module!r}, phase={self.phase!r}, "
                f"flops={self.flops}, saved_bytes={self.saved_bytes}, live_after_bytes={self.live_after_bytes})")


_new_record = object.__new__


@dataclass(slots=True)
class ModuleStats:
    """Figures of one module, inclusive of its sub-modules (FLOPs, bytes, seconds)."""

    path: str
    type_name: str
    depth: int
    n_params: int = 0
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_state_bytes: int = 0
    forward_flops: int = 0
    backward_flops: int = 0
    recompute_flops: int = 0
    saved_bytes: int = 0
    output_bytes: int = 0
    temp_bytes: int = 0
    forward_time_s: float = 0.0
    backward_time_s: float = 0.0
    n_ops: int = 0

    @property
    def time_s(self) -> float:
        return self.forward_time_s + self.backward_time_s


@dataclass(slots=True)
class ModelProfile:
    """The result of `treadle.profile.profile`.

    ops: every ATen op in run order (forward, then backward with recomputation interleaved).
    modules: inclusive per-module figures keyed by module path ("" is the whole model), in module order.
    Totals: forward/backward/recompute FLOPs; `model_flops` = forward + backward (no recompute; used for MFU).
    Memory: `resident_bytes` = parameters + buffers + inputs + optimizer state; `peak_bytes` = resident +
    activation peak; `peak_module`/`peak_op_index`/`peak_phase` say where the peak happens.
    Time: `step_time_s` sums the ops' roofline times; `mfu` = model_flops / step_time_s / peak FLOP/s of `dtype`.
    """

    model: str
    hardware: HardwareSpec
    dtype: str
    train: bool
    optimizer: str
    ops: list[OpRecord]
    modules: dict[str, ModuleStats]
    forward_flops: int = 0
    backward_flops: int = 0
    recompute_flops: int = 0
    param_bytes: int = 0
    buffer_bytes: int = 0
    input_bytes: int = 0
    grad_bytes: int = 0
    optimizer_state_bytes: int = 0
    saved_bytes: int = 0
    saved_input_bytes: int = 0
    activation_peak_bytes: int = 0
    peak_module: str = ""
    peak_op_index: int = -1
    peak_phase: str = ""
    step_time_s: float = 0.0
    forward_time_s: float = 0.0
    backward_time_s: float = 0.0
    mfu: float = 0.0
    reused_blocks: list[dict[str, Any]] = field(default_factory=list)
    profile_time_s: float = 0.0

    @property
    def model_flops(self) -> int:
        return self.forward_flops + self.backward_flops

    @property
    def total_flops(self) -> int:
        """Every FLOP the step runs, recomputation included."""
        return self.forward_flops + self.backward_flops + self.recompute_flops

    @property
    def resident_bytes(self) -> int:
        return self.param_bytes + self.buffer_bytes + self.input_bytes + self.optimizer_state_bytes

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.activation_peak_bytes

    def timeline(self) -> Iterator[tuple[int, str, str, int]]:
        """(op index, phase, module, resident + live activation bytes right after the op) in run order."""
        base = self.resident_bytes
        for r in self.ops:
            yield r.index, r.phase, r.module, base + r.live_after_bytes

    def rows(self, *, max_depth: int | None = None) -> list[ModuleStats]:
        """Module figures down to `max_depth` (0: the model only), in module order."""
        return [m for m in self.modules.values() if max_depth is None or m.depth <= max_depth]

    def totals(self) -> dict[str, Any]:
        keys = ("forward_flops", "backward_flops", "recompute_flops", "param_bytes", "buffer_bytes", "input_bytes",
                "grad_bytes", "optimizer_state_bytes", "saved_bytes", "saved_input_bytes", "activation_peak_bytes",
                "peak_module", "peak_op_index", "peak_phase", "step_time_s", "forward_time_s", "backward_time_s",
                "mfu")
        out = {k: getattr(self, k) for k in keys}
        out.update(model_flops=self.model_flops, total_flops=self.total_flops, resident_bytes=self.resident_bytes,
                   peak_bytes=self.peak_bytes)
        return out

    def to_dict(self, *, ops: bool = True) -> dict[str, Any]:
        return {
            "model": self.model, "hardware": self.hardware.to_dict(), "dtype": self.dtype, "train": self.train,
            "optimizer": self.optimizer, "totals": self.totals(), "reused_blocks": self.reused_blocks,
            "profile_time_s": self.profile_time_s,
            "modules": [asdict(m) for m in self.modules.values()],
            "ops": [r.to_dict() for r in self.ops] if ops else [],
        }

    def to_json(self, *, ops: bool = True) -> str:
        return json.dumps(self.to_dict(ops=ops))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelProfile":
        """Inverse of `to_dict` (a profile written with ops=False comes back without op records)."""
        totals = d["totals"]
        stored = {k: totals[k] for k in ("forward_flops", "backward_flops", "recompute_flops", "param_bytes",
                                         "buffer_bytes", "input_bytes", "grad_bytes", "optimizer_state_bytes",
                                         "saved_bytes", "saved_input_bytes", "activation_peak_bytes", "peak_module",
                                         "peak_op_index", "peak_phase", "step_time_s", "forward_time_s",
                                         "backward_time_s", "mfu")}
        return cls(model=d["model"], hardware=HardwareSpec.from_dict(d["hardware"]), dtype=d["dtype"],
                   train=d["train"], optimizer=d["optimizer"], ops=[OpRecord.from_dict(r) for r in d["ops"]],
                   modules={m["path"]: ModuleStats(**m) for m in d["modules"]}, reused_blocks=d["reused_blocks"],
                   profile_time_s=d["profile_time_s"], **stored)

    @classmethod
    def from_json(cls, text: str) -> "ModelProfile":
        return cls.from_dict(json.loads(text))
