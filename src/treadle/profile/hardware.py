"""Accelerator specs as data (peak FLOP/s per dtype, memory bandwidth and size), presets, and CPU calibration.

A `HardwareSpec` is what the roofline (`treadle.profile.roofline`) prices an op against. Presets carry the
vendors' published dense peaks (no structured sparsity), each with its source beside it; `compute_efficiency`
and `memory_efficiency` scale the peaks to what well-tuned kernels reach.

The `cpu` preset is ONE CORE of a nominal x86 server core (NOTE [no hidden state]): nothing is measured or
cached behind the caller's back, and the result does not depend on the calling process's thread count. A
rank's rate is that per-core spec times the cores the rank really gets (its threads, and the cores it shares
with the other ranks of its host): `treadle.cost.cluster.ClusterSpec.rank_hardware`. To price this machine
instead, measure it explicitly — `calibrate_cpu()` (one thread by default, i.e. per core) or
``treadle calibrate`` — save the spec and pass the file (``hardware_preset("spec.json")``).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import ProfileError

logger = logging.getLogger(__name__)

TFLOPS = 10**12
GB = 10**9
GIB = 2**30


# the per-op / per-region host costs of NOTE [framework overheads] (seconds per core; a rank scales them)
_OVERHEADS = ("op_overhead_s", "subclass_op_overhead_s", "checkpoint_region_s", "checkpoint_op_s", "fsdp_unit_s",
              "fsdp_param_s", "split_backward_op_s", "selective_region_s", "selective_op_s", "fsdp_kept_unit_s")


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareSpec:
    """One device: peak dense FLOP/s per dtype name, memory bandwidth (bytes/s) and capacity (bytes).

    `peak_flops_per_s` is keyed by torch dtype name without the ``torch.`` prefix ("float32", "bfloat16",
    "float16", optionally "tfloat32", "float8_e4m3fn"). `compute_efficiency` and `memory_efficiency` in (0, 1] are
    the fractions of the peaks that kernels reach in practice. Raises ProfileError on an empty or non-positive
    peak table, non-positive bandwidth or memory, or an efficiency outside (0, 1].
    """

    name: str
    peak_flops_per_s: dict[str, float]
    hbm_bytes_per_s: float
    memory_bytes: int
    compute_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    op_overhead_s: float = 0.0  # fixed cost of dispatching one op (framework + launch); `treadle.price` adds it per op
    # NOTE [framework overheads]: host-side costs of the PyTorch machinery a schedule runs through, per core, in
    # seconds (0 = hidden behind the device, as on a GPU that the host keeps ahead of). `treadle.price` and the
    # planner charge them where the runtime pays them:
    #   subclass_op_overhead_s   extra per op on tensor-subclass arguments (DTensor dispatch: FSDP2's sharded
    #                            parameters in the optimizer step),
    #   checkpoint_region_s      per checkpointed region per step (torch.utils.checkpoint's frame and recompute),
    #   checkpoint_op_s          per recomputed op (saved-tensor hooks and holders around it),
    #   selective_region_s       per selective checkpoint region per step (its two dispatch modes entered),
    #   selective_op_s           per op run under selective checkpointing, forward and recompute (the Python
    #                            dispatch mode asking the policy and caching what it keeps),
    #   fsdp_unit_s              per FSDP2 unit per step (its forward/backward hooks, gather and reduce bookkeeping),
    #   fsdp_param_s             per parameter of an FSDP2 unit per step (copy-in/out views, DTensor wrapping),
    #   fsdp_kept_unit_s         per FSDP2 unit per forward+backward while it stays gathered without gradient sync
    #                            (a pipeline stage between its gathers and its one reduction: the hooks alone),
    #   split_backward_op_s      per backward op of a pipeline stage whose backward a zero-bubble schedule splits
    #                            into input and weight gradients (torch.distributed.pipelining walks the autograd
    #                            graph to group parameters, runs autograd twice and hooks the intermediates).
    # `optimizer_foreach` (when not `optimizer_fused`): AdamW runs its multi-tensor (foreach) kernels, ~12 ops
    # per step, as treadle's runtime makes it where the fused kernel cannot run (NOTE [foreach optimizer] in
    # `treadle.runtime.optimizer`) and PyTorch does by default for CUDA tensors; False: one op sequence per
    # parameter tensor (PyTorch's default on CPU, for an optimizer made elsewhere).
    subclass_op_overhead_s: float = 0.0
    checkpoint_region_s: float = 0.0
    checkpoint_op_s: float = 0.0
    fsdp_unit_s: float = 0.0
    fsdp_param_s: float = 0.0
    split_backward_op_s: float = 0.0
    selective_region_s: float = 0.0
    selective_op_s: float = 0.0
    fsdp_kept_unit_s: float = 0.0
    optimizer_foreach: bool = True
    # `optimizer_fused`: AdamW runs its fused kernel (one pass per element, ~2 list ops plus ~1 dispatch per
    # tensor), as treadle's runtime makes it whenever it can (NOTE [fused optimizer] in
    # `treadle.runtime.optimizer`), and as Megatron-LM (Apex FusedAdam) and torchtitan (fused AdamW) do on
    # GPUs; False: the foreach form or the loop, per `optimizer_foreach`.
    optimizer_fused: bool = True
    # NOTE [kernel rates]: what kernels of a kind really reach, where a single efficiency is too coarse (all
    # optional; empty = `compute_efficiency` for every kernel):
    #   matmul_curve        ((FLOPs of one matrix product, fraction of the dtype's peak it reaches), ...) sorted by
    #                       FLOPs; interpolated in log(FLOPs), clamped at both ends (small products run slower)
    #   attention_efficiency fraction of the peak fused attention kernels reach (kind "attention"), or None
    #   elementwise_s_per_elem {op name: seconds per output element} for pointwise kernels bound by arithmetic
    #                       rather than memory (tanh, exp, erf...): such an op takes at least numel x rate
    matmul_curve: tuple[tuple[float, float], ...] = ()
    attention_efficiency: float | None = None
    elementwise_s_per_elem: dict[str, float] = field(default_factory=dict)
    source: str = field(default="user-defined", compare=False)

    def __post_init__(self) -> None:
        if not self.peak_flops_per_s or any(v <= 0 for v in self.peak_flops_per_s.values()):
            raise ProfileError(f"HardwareSpec {self.name!r} needs a non-empty peak_flops_per_s with positive values; "
                               f"got {self.peak_flops_per_s!r}")
        if self.hbm_bytes_per_s <= 0 or self.memory_bytes <= 0:
            raise ProfileError(f"HardwareSpec {self.name!r} needs hbm_bytes_per_s > 0 and memory_bytes > 0; "
                               f"got {self.hbm_bytes_per_s!r}, {self.memory_bytes!r}")
        for attr in _OVERHEADS:
            v = getattr(self, attr)
            if not v >= 0:
                raise ProfileError(f"HardwareSpec {self.name!r}: {attr} must be >= 0; got {v!r}")
        for attr in ("compute_efficiency", "memory_efficiency", "attention_efficiency"):
            v = getattr(self, attr)
            if v is not None and not 0 < v <= 1:
                raise ProfileError(f"HardwareSpec {self.name!r}: {attr} must be in (0, 1]; got {v!r}")
        object.__setattr__(self, "matmul_curve", tuple(sorted((float(f), float(e)) for f, e in self.matmul_curve)))
        if any(f <= 0 or not 0 < e <= 1 for f, e in self.matmul_curve):
            raise ProfileError(f"HardwareSpec {self.name!r}: matmul_curve needs (FLOPs > 0, fraction in (0, 1]) "
                               f"points; got {self.matmul_curve!r}")
        if any(not v >= 0 for v in self.elementwise_s_per_elem.values()):
            raise ProfileError(f"HardwareSpec {self.name!r}: elementwise_s_per_elem must be >= 0; "
                               f"got {self.elementwise_s_per_elem!r}")

    def __str__(self) -> str:
        top = max(self.peak_flops_per_s.values())
        return (f"{self.name}({top / TFLOPS:.1f} TFLOP/s peak, {self.hbm_bytes_per_s / GB:.0f} GB/s, "
                f"{self.memory_bytes / GIB:.0f} GiB)")

    def peak_for(self, dtype: torch.dtype | str) -> float:
        """Peak dense FLOP/s for `dtype` (a torch dtype or its name). Raises ProfileError listing known dtypes."""
        key = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        if key not in self.peak_flops_per_s:
            raise ProfileError(f"hardware {self.name!r} has no peak FLOP/s for dtype {key!r}; "
                               f"known: {sorted(self.peak_flops_per_s)}")
        return self.peak_flops_per_s[key]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareSpec":
        known = {"name", "peak_flops_per_s", "hbm_bytes_per_s", "memory_bytes", "compute_efficiency",
                 "memory_efficiency", "optimizer_foreach", "optimizer_fused", "matmul_curve", "attention_efficiency",
                 "elementwise_s_per_elem", "source", *_OVERHEADS}
        unknown = set(d) - known
        if unknown:
            raise ProfileError(f"HardwareSpec JSON has unknown fields {sorted(unknown)}; known: {sorted(known)}")
        d = dict(d)
        d["peak_flops_per_s"] = {str(k): float(v) for k, v in d["peak_flops_per_s"].items()}
        d["memory_bytes"] = int(d["memory_bytes"])
        if "matmul_curve" in d:
            d["matmul_curve"] = tuple((float(f), float(e)) for f, e in d["matmul_curve"])
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "HardwareSpec":
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "HardwareSpec":
        """Read a spec written by `save`/`to_json`. Raises ProfileError if the file is missing or malformed."""
        try:
            return cls.from_json(Path(path).read_text())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ProfileError(f"cannot load HardwareSpec from {str(path)!r}: {exc}") from exc


def _gpu(name: str, *, fp32: float, tf32: float | None, half: float, bf16: float | None, fp8: float | None,
         hbm: float, mem: int, source: str) -> HardwareSpec:
    peaks = {"float32": fp32, "float16": half}
    if tf32 is not None:
        peaks["tfloat32"] = tf32
    if bf16 is not None:
        peaks["bfloat16"] = bf16
    if fp8 is not None:
        peaks["float8_e4m3fn"] = fp8
    return HardwareSpec(name=name, peak_flops_per_s=peaks, hbm_bytes_per_s=hbm, memory_bytes=mem, source=source)


# Dense peaks (no 2:4 sparsity). "float32" is the non-tensor-core FP32 rate PyTorch gets with TF32 off (its default
# for matmul); "tfloat32" is listed apart.
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    # Tesla V100 SXM2 32GB datasheet: 15.7 TF FP32, 125 TF FP16 tensor; no BF16; HBM2 900 GB/s
    "v100-32gb": _gpu("v100-32gb", fp32=15.7 * TFLOPS, tf32=None, half=125 * TFLOPS, bf16=None, fp8=None,
                      hbm=900 * GB, mem=32 * GIB, source="NVIDIA V100 datasheet (SXM2)"),
    # A100 SXM4 40GB datasheet: 19.5 TF FP32, 156 TF TF32, 312 TF FP16/BF16; HBM2 1555 GB/s
    "a100-40gb": _gpu("a100-40gb", fp32=19.5 * TFLOPS, tf32=156 * TFLOPS, half=312 * TFLOPS, bf16=312 * TFLOPS,
                      fp8=None, hbm=1555 * GB, mem=40 * GIB, source="NVIDIA A100 datasheet (SXM4 40GB)"),
    # A100 SXM4 80GB datasheet: same compute; HBM2e 2039 GB/s
    "a100-80gb": _gpu("a100-80gb", fp32=19.5 * TFLOPS, tf32=156 * TFLOPS, half=312 * TFLOPS, bf16=312 * TFLOPS,
                      fp8=None, hbm=2039 * GB, mem=80 * GIB, source="NVIDIA A100 datasheet (SXM4 80GB)"),
    # H100 SXM5 datasheet: 67 TF FP32, 494.7 TF TF32, 989.4 TF FP16/BF16, 1978.9 TF FP8 (dense); HBM3 3.35 TB/s
    "h100-sxm": _gpu("h100-sxm", fp32=67 * TFLOPS, tf32=494.7 * TFLOPS, half=989.4 * TFLOPS,
                     bf16=989.4 * TFLOPS, fp8=1978.9 * TFLOPS, hbm=3350 * GB, mem=80 * GIB,
                     source="NVIDIA H100 datasheet (SXM5), dense"),
    # H100 96 GB HBM2e at 500 W (Meta's Grand Teton part, on which torchtitan's benchmark tables were measured;
    # pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md: "96GB HBM2e with 2.4 TB/sec peak memory
    # bandwidth", "500W power limit"). No datasheet gives its compute: the same file says its peak lies between
    # the SXM's (989.4 TF BF16 dense) and the NVL's (835 TF, the H100 NVL datasheet); the midpoint of that range
    # is taken (FP32, TF32, FP8 likewise). Capacity as torch reports it there (memory rows of 95.0 GiB = 100%).
    "h100-hbm2e-500w": _gpu("h100-hbm2e-500w", fp32=(67 + 60) / 2 * TFLOPS, tf32=(494.7 + 417.5) / 2 * TFLOPS,
                            half=(989.4 + 835) / 2 * TFLOPS, bf16=(989.4 + 835) / 2 * TFLOPS,
                            fp8=(1978.9 + 1670) / 2 * TFLOPS, hbm=2400 * GB, mem=95 * GIB,
                            source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 2.4 TB/s, 500 W; "
                                   "peak midway between H100 SXM and NVL"),
    # H200 SXM datasheet: H100 compute; HBM3e 141 GB at 4.8 TB/s
    "h200": _gpu("h200", fp32=67 * TFLOPS, tf32=494.7 * TFLOPS, half=989.4 * TFLOPS, bf16=989.4 * TFLOPS,
                 fp8=1978.9 * TFLOPS, hbm=4800 * GB, mem=141 * GB, source="NVIDIA H200 datasheet (SXM), dense"),
}

_ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "v100": "v100-32gb", "h200-sxm": "h200",
            "h100-96gb": "h100-hbm2e-500w"}


def hardware_preset(name: str) -> HardwareSpec:
    """A preset by name ("v100-32gb", "a100-40gb", "a100-80gb", "h100-sxm", "h100-hbm2e-500w", "h200"), or "cpu" (one nominal core,
    `CPU_CORE`; a rank scales it), or a path to a spec saved as JSON. Raises ProfileError listing the known names."""
    key = name.lower()
    key = _ALIASES.get(key, key)
    if key == "cpu":
        return cpu_spec()
    if key in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[key]
    if name.endswith(".json") or os.path.sep in name:
        return HardwareSpec.load(name)
    raise ProfileError(f"unknown hardware {name!r}; known: {sorted(HARDWARE_PRESETS) + ['cpu']} "
                       f"(aliases {sorted(_ALIASES)}), or a path to a HardwareSpec JSON file")


# ------------------------------------------------------------------------------------------------ CPU calibration

def _machine_key() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    raw = f"{cpu}-{os.cpu_count()}cpu-torch{torch.__version__}"
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in raw)


def _best_time_s(fn, *, reps: int) -> float:
    """Best of `reps` (after a warm-up): the calling thread's CPU time when torch runs on one thread (a busy
    machine preempts the probe without inflating it), wall time otherwise (other threads do the work)."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def _matmul_flops_per_s(dtype: torch.dtype, n: int, reps: int) -> float:
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best_time_s(lambda: torch.mm(a, b), reps=reps)


# NOTE [calibration repeats]: the per-op and checkpoint overheads are differences of small CPU times, and one
# best-of-`reps` measurement of them moved 2x between two calibrations minutes apart on a shared 2-vCPU host
# (op 8.3 vs 14.7 us, recomputed op 27 vs 62 us): a sibling vCPU's load slows even the thread's own CPU time.
# `calibrate_cpu` takes the median of _OVERHEAD_REPEATS independent measurements of each, the two probes
# interleaved so that a slow minute of the host slows both alike. Five repeats were not enough: four
# calibrations in a row on a quiet host read 9.8-18.3 us per recomputed op and 4.6-6.6 us per op, and a bench
# calibration read 29.9 us (LLaMA's 4-rank "DDP + ckpt" then measured 0.88x its price against 1.05x for DDP);
# eleven interleaved repeats read 12.8-15.1 us and 4.6-4.8 us in four calibrations. The median is what removes
# the disturbed samples, not the best-of inside each repeat: four calibrations each of best-of-7 and of best-of-2
# repeats, interleaved, read 13.2-14.2 vs 12.3-14.1 us per recomputed op, 4.4-4.6 vs 4.4-4.5 us per op and
# 8.6-9.7 vs 8.4-9.0 us per split-backward op on a quiet host, and 11.9-12.6 vs 11.7-14.4, 4.3-4.4 vs 4.3-5.1 and
# 7.9-8.4 vs 7.9-8.5 us beside a process busy on the other core; best-of-2 takes 4 s for all the overhead
# probes where best-of-7 took 14 s. So each repeat is a best of _OVERHEAD_REPS.
_OVERHEAD_REPEATS = 11
_OVERHEAD_REPS = 2


def calibrate_cpu(*, matmul_n: int = 1024, copy_bytes: int = 64 * 2**20, reps: int = 7, threads: int = 1,
                  overheads: bool = True, kernels: bool = True) -> HardwareSpec:
    """Measure this machine: fp32 and bf16 `torch.mm` of (`matmul_n`, `matmul_n`) matrices (FLOP/s = 2 n^3 / best
    time), and memory bandwidth as bytes read + written by a `copy_` of `copy_bytes` (best of `reps`).

    The measured rates are what good kernels reach here, so both efficiencies are 1.0. `memory_bytes` is the
    machine's physical memory. Best-of-`reps` timing keeps the fastest (least disturbed) sample, but a machine
    busy with other work still measures low: calibrate when it is quiet. Takes about 1 s (7 s in all with the
    defaults, on a 2-core EPYC host: most of it the repeated overhead probes); nothing is cached.
    It runs on `threads` threads (restored after): with the default 1 the spec is per core, which is what the
    `cpu` device of a ClusterSpec means (ranks scale it by the cores they get).
    With `overheads` it also measures the framework overheads of NOTE [framework overheads]
    (`treadle.profile.overheads`, ~5 s more: NOTE [calibration repeats]), and with `kernels` the kernel rates of
    NOTE [kernel rates] (`treadle.profile.kernel_rates`, ~1.5 s: matmul efficiency by size, fused attention,
    arithmetic-bound pointwise ops; the products on operands out of the private caches: NOTE [operands as a step
    holds them]); the framework overheads it cannot measure here (the DTensor and FSDP2 probes inside an
    initialised process group) keep `CPU_CORE`'s nominal values, and `source` says which.
    """
    from . import kernel_rates as kr
    from . import overheads as ov

    t0 = time.perf_counter()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        peaks = {"float32": _matmul_flops_per_s(torch.float32, matmul_n, reps)}
        peaks["bfloat16"] = _matmul_flops_per_s(torch.bfloat16, matmul_n // 2, reps)
        peaks["float16"] = _matmul_flops_per_s(torch.float16, matmul_n // 4, 2)
        peaks["float8_e4m3fn"] = peaks["float32"]  # torchao emulates float8 products on a CPU: an fp32 product
        src = torch.empty(copy_bytes // 4, dtype=torch.float32).fill_(1.0)
        dst = torch.empty_like(src)
        bw = 2 * copy_bytes / _best_time_s(lambda: dst.copy_(src), reps=reps)
        per_op, fits = [], []
        for _ in range(_OVERHEAD_REPEATS):  # NOTE [calibration repeats]: interleaved
            per_op.append(ov.op_overhead_s(reps=_OVERHEAD_REPS))
            if overheads:
                fits.append(ov.checkpoint_overheads_s(reps=_OVERHEAD_REPS))
        framework = {"op_overhead_s": statistics.median(per_op)}
        if kernels:
            framework["matmul_curve"] = kr.matmul_curve(peaks["float32"], reps=reps)
            framework["attention_efficiency"] = kr.attention_efficiency(peaks["float32"], reps=reps)
            framework["elementwise_s_per_elem"] = kr.elementwise_s_per_elem(reps=reps)
        if overheads:
            framework["checkpoint_region_s"] = statistics.median(f[0] for f in fits)
            framework["checkpoint_op_s"] = statistics.median(f[1] for f in fits)
            framework["split_backward_op_s"] = statistics.median(
                ov.split_backward_op_s(reps=_OVERHEAD_REPS) for _ in range(_OVERHEAD_REPEATS))
            sel = [ov.selective_overheads_s(reps=_OVERHEAD_REPS) for _ in range(_OVERHEAD_REPEATS)]
            framework["selective_region_s"] = statistics.median(f[0] for f in sel)
            framework["selective_op_s"] = statistics.median(f[1] for f in sel)
            dist_ov = ov.distributed_overheads_s(reps=reps)
            if dist_ov is not None:
                (framework["subclass_op_overhead_s"], framework["fsdp_unit_s"],
                 framework["fsdp_param_s"], framework["fsdp_kept_unit_s"]) = dist_ov
    finally:
        torch.set_num_threads(before)
    nominal = {k: getattr(CPU_CORE, k) for k in _OVERHEADS if k not in framework}
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 16 * GIB
    note = f"; nominal {sorted(nominal)}" if nominal else ""
    spec = HardwareSpec(name="cpu", peak_flops_per_s=peaks, hbm_bytes_per_s=bw, memory_bytes=int(mem),
                        compute_efficiency=1.0, memory_efficiency=1.0, optimizer_foreach=True,
                        **framework, **nominal,
                        source=f"calibrated on {threads} thread(s) of {_machine_key()} at "
                               f"{time.strftime('%Y-%m-%dT%H:%M:%S')}{note}")
    logger.info("calibrated cpu in %.2f s: %.1f GFLOP/s fp32, %.1f GB/s", time.perf_counter() - t0,
                peaks["float32"] / 1e9, bw / GB)
    return spec


# NOTE [no hidden state]: one core of a nominal x86-64 server CPU: 2 FMA units x 8 fp32 lanes (AVX2) x 2 FLOP
# x 2.5 GHz = 80 GFLOP/s fp32 (bf16/fp16 run at the fp32 rate without AMX; float8 products are emulated as fp32
# ones, NOTE [float8 in the price]), and ~10 GB/s of memory bandwidth
# per core (a 16-core socket's ~160 GB/s shared), and ~10 us to dispatch one eager op (PyTorch's CPU
# dispatcher and Python: `calibrate_cpu` times 1000 one-element adds). The framework overheads (NOTE
# [framework overheads]) are PyTorch 2.13 eager on a 2.5 GHz EPYC core as `treadle.profile.overheads` measured
# them, rounded: DTensor dispatch ~30 us an op, non-reentrant checkpoint ~0.3 ms a region + ~0.1 ms a recomputed
# op, FSDP2 ~1.5 ms a unit + ~20 us a parameter per step (~0.15 ms a unit's forward and backward kept gathered
# without sync), a split (zero-bubble) stage backward ~10 us more per
# backward op, selective checkpointing's dispatch modes ~70 us a region + ~10 us per op they see (forward and
# recompute; measured on this 2-core EPYC host); ~15 us per op of a training step (module calls and autograd included). AdamW runs in the foreach form, as the runtime makes it. Kernel rates (NOTE [kernel rates]) as
# `treadle.profile.kernel_rates` measured them there, rounded: square fp32 products of n = 32 / 64 / 128 / 256
# reach 20 / 65 / 90 / 95% of the peak, CPU flash attention 40%, and transcendental pointwise kernels cost
# 1.3-5 ns an element. A fixed constant, so a plan never depends on where it was made.
_CPU_POINTWISE_S = {"tanh": 4.8e-9, "exp": 1.8e-9, "log": 2.2e-9, "sigmoid": 1.3e-9, "erf": 2.5e-9, "sin": 1.7e-9,
                    "cos": 1.8e-9, "silu": 1.5e-9, "gelu": 1.6e-9, "silu_backward": 1.8e-9, "gelu_backward": 2.5e-9,
                    "_softmax": 1.8e-9, "_log_softmax": 1.7e-9, "_log_softmax_backward_data": 1.4e-9}
CPU_CORE = HardwareSpec(name="cpu", peak_flops_per_s={"float32": 80e9, "bfloat16": 80e9, "float16": 80e9,
                                                      "float8_e4m3fn": 80e9},
                        hbm_bytes_per_s=10 * GB, memory_bytes=16 * GIB, op_overhead_s=15e-6,
                        subclass_op_overhead_s=30e-6, checkpoint_region_s=300e-6, checkpoint_op_s=100e-6,
                        fsdp_unit_s=2e-3, fsdp_param_s=100e-6, split_backward_op_s=10e-6, selective_region_s=70e-6,
                        selective_op_s=10e-6, fsdp_kept_unit_s=150e-6, optimizer_foreach=True,
                        matmul_curve=((6.6e4, 0.2), (5.2e5, 0.65), (4.2e6, 0.9), (3.4e7, 0.95)),
                        attention_efficiency=0.4, elementwise_s_per_elem=_CPU_POINTWISE_S,
                        source="nominal x86-64 core (AVX2 2x FMA at 2.5 GHz, 10 GB/s); calibrate_cpu for yours")


def cpu_spec(*, recalibrate: bool = False) -> HardwareSpec:
    """The `cpu` device: the nominal per-core `CPU_CORE` (NOTE [no hidden state]); with `recalibrate` the
    per-core spec measured now by `calibrate_cpu` (explicit, never cached — save it and pass the file)."""
    return calibrate_cpu() if recalibrate else CPU_CORE
