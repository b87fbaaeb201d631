"""What a price says: `Price` (one schedule on one cluster, per device), its rows, and `Estimate`, the short form a
plan keeps. Seconds, bytes, and MFU in 0..1."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..cost.cluster import RankDevice
from ..units import GiB


@dataclass(slots=True)
class Estimate:
    """Predicted per-device figures: seconds, bytes, and model FLOPs utilisation (0..1)."""

    step_s: float
    peak_bytes: float
    mfu: float
    compute_s: float
    comm_s: float
    recompute_s: float
    static_bytes: float
    activation_bytes: float
    transient_bytes: float

    def __str__(self) -> str:
        return (f"step {self.step_s * 1e3:.2f} ms (compute {self.compute_s * 1e3:.2f}, comm {self.comm_s * 1e3:.2f}, "
                f"recompute {self.recompute_s * 1e3:.2f}), peak {self.peak_bytes / GiB:.2f} GiB, "
                f"MFU {self.mfu * 100:.1f}%")


@dataclass(slots=True)
class PriceRow:
    """One module in one phase: `module` path ("" the root), `phase` "fwd" / "bwd" / "recompute",
    compute seconds of the module's own ops, and communication issued there:
    ``comm_s[axis][kind]`` seconds (kind "all_reduce", "all_gather", ...; `source` tells tp / ddp / fsdp
    in `Price.collectives`), of which `exposed_comm_s` delayed compute; `saved_bytes` kept for backward."""

    module: str
    phase: str
    compute_s: float = 0.0
    comm_s: dict[str, dict[str, float]] = field(default_factory=dict)
    exposed_comm_s: float = 0.0
    saved_bytes: int = 0


@dataclass(slots=True)
class Price:
    """The price of one schedule on one cluster, per device (rank 0). Seconds, bytes, MFU in 0..1.

    Time: ``step_s = compute_s + recompute_s + exposed_comm_s``; `comm_s` is all communication and
    ``overlapped_comm_s = comm_s - exposed_comm_s`` the part hidden behind compute (NOTE [overlap model]).
    Memory: ``peak_bytes = static_bytes + activation_bytes + transient_bytes`` where static are parameters,
    optimizer state, buffers, inputs and DDP's bucket copies; activation the bytes autograd saves in
    forward (``saved_tensors_hooks``, storages once); transient the rest of the recorded peak (gradients
    as they appear, temporaries, a recomputed block, FSDP2's gathered units). `grad_bytes` are the local
    gradients. `device` says how the compute rate was derived.

    FLOPs: `model_flops` are the model's useful FLOPs of the whole step (forward + backward of the model as
    written on the global batch, `treadle.profile.model_flops`); `executed_flops` what rank 0 computes in
    forward and backward, replicated work included, recomputation not. ``mfu = model_flops / world / step_s /
    peak``: the one MFU, as the planner's and `treadle.run`'s (a replicated op is work, not useful work).

    Breakdown for timelines: `rows` (per module and phase, see PriceRow); `segments` — the step's compute
    in order, dicts {module, phase, start_s, compute_s, flops, bytes (read + written), ops} (the last
    three None for the optimizer segment); `collectives` — dicts {kind, axis, nbytes,
    time_s, module, phase, source ("tp", "ddp", "fsdp"), blocking, start_s, end_s, exposed_s}, so a
    timeline can draw compute and each axis's channel on one time axis.

    A pipeline (`treadle.forms.pipeline.price`) is priced for its slowest pp rank: `exposed_comm_s` then also
    holds that rank's bubble (waiting for other stages), `peak_bytes` is the largest rank's, and `pipeline`
    says the rest: {schedule, n_microbatches, stages: per-stage rows, ranks: per pp rank its step, busy,
    bubble and peak, bubble_fraction, bubble_s, critical_path, slots}. `execution`: "eager", or "compiled"
    (the blocks under torch.compile, as ``treadle.run --compile``; NOTE [compiled step] in
    `treadle.pricing.compiled`).
    """

    step_s: float
    compute_s: float
    recompute_s: float
    comm_s: float
    exposed_comm_s: float
    overlapped_comm_s: float
    peak_bytes: float
    static_bytes: float
    activation_bytes: float
    transient_bytes: float
    grad_bytes: float
    mfu: float
    model_flops: float
    executed_flops: float
    device: RankDevice
    data_parallel: str
    rows: list[PriceRow]
    segments: list[dict]
    collectives: list[dict]
    pipeline: dict | None = None
    execution: str = "eager"  # or "compiled": the blocks under torch.compile (NOTE [compiled step])

    def estimate(self) -> Estimate:
        """This price as an `Estimate` (comm = exposed communication)."""
        return Estimate(self.step_s, self.peak_bytes, self.mfu, self.compute_s, self.exposed_comm_s,
                        self.recompute_s, self.static_bytes, self.activation_bytes, self.transient_bytes)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (f"step {self.step_s * 1e3:.3f} ms (compute {self.compute_s * 1e3:.3f}, recompute "
                f"{self.recompute_s * 1e3:.3f}, comm {self.comm_s * 1e3:.3f} of which exposed "
                f"{self.exposed_comm_s * 1e3:.3f}), peak {self.peak_bytes / 2**20:.2f} MiB (static "
                f"{self.static_bytes / 2**20:.2f}, activations {self.activation_bytes / 2**20:.2f}, transient "
                f"{self.transient_bytes / 2**20:.2f}), MFU {self.mfu * 100:.2f}% on {self.device.name}"
                + (", compiled" if self.execution == "compiled" else ""))
