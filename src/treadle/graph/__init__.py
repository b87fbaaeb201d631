"""Graph layer: capture a sub-module as an FX graph (torch.export / torch.fx) with its children as leaf calls,
match subgraph patterns written as Python functions, and rewrite the graph (replace, decompose, fuse,
checkpoint). The schedule primitives that use it live in `treadle.schedule.graph_primitives`; this package
registers its modules there on import (the schedule never imports the layers below it)."""

from ..schedule.graph_primitives import register_graph_layer
from . import capture as _capture, pattern as _pattern, rewrite as _rewrite

from .capture import record_call
from .traced import TracedModule
from .pattern import Match, ParamRef, capture_pattern, find_matches, register_module_form
from .rewrite import CheckpointRegion, FusedRegion, register_decomposition

__all__ = ["TracedModule", "record_call", "Match", "ParamRef", "capture_pattern", "find_matches",
           "register_module_form", "CheckpointRegion", "FusedRegion", "register_decomposition"]

register_graph_layer(capture=_capture, pattern=_pattern, rewrite=_rewrite)
