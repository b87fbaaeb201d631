"""Symbolic profiler: per-op FLOPs, bytes, saved activations and memory timeline on fake tensors, priced on a
hardware spec by roofline. Entry point: `treadle.profile.profile(model, example_inputs, hardware=...)`."""

from .hardware import HARDWARE_PRESETS, HardwareSpec, calibrate_cpu, cpu_spec, hardware_preset
from .profiler import default_loss, profile
from .records import ModelProfile, ModuleStats, OpRecord
from .roofline import mfu, op_time_s

__all__ = ["HARDWARE_PRESETS", "HardwareSpec", "ModelProfile", "ModuleStats", "OpRecord", "calibrate_cpu",
           "cpu_spec", "default_loss", "hardware_preset", "mfu", "op_time_s", "profile"]
