"""Cost model of a device mesh: clusters and links, collective times, layouts and layout conversion.

Everything here is pure data and pure functions in seconds and bytes; nothing builds a process group
(except `calibrate`, which measures a live one)."""

from .cluster import ClusterSpec, enumerate_meshes, parse_cluster
from .convert import ConversionPlan, ConversionStep, conversion_time_s, plan_conversion
from .layout import Layout, local_shape
from .links import LINK_PRESETS, LinkSpec, link_preset

__all__ = ["ClusterSpec", "enumerate_meshes", "parse_cluster", "ConversionPlan", "ConversionStep",
           "conversion_time_s", "plan_conversion", "Layout", "local_shape", "LINK_PRESETS",
           "LinkSpec", "link_preset"]
