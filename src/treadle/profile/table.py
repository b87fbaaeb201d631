"""Rich tables of a ModelProfile: per-module rows down to a depth, and the totals. Formatting only; units are
chosen here (GiB/MiB, TFLOP/GFLOP, ms), everything else is bytes, FLOPs and seconds."""

from __future__ import annotations

from rich.table import Table

from ..units import fmt_bytes, fmt_count, fmt_flops, fmt_time
from .records import ModelProfile, ModuleStats


def _collapsed_rows(prof: ModelProfile, depth: int) -> list[tuple[str, ModuleStats, int]]:
    """(label, stats, count) rows: each reused run of identical blocks shows as its first block with a count
    (figures per block), its other blocks hidden."""
    hidden: list[str] = []
    first_of: dict[str, tuple[str, int]] = {}
    for run in prof.reused_blocks:
        first, last, count = run["first"], run["last"], run["count"]
        first_of[first] = (f"{first.rpartition('.')[2]}..{last.rpartition('.')[2]}", count)
        container = run["container"]
        prefix = f"{container}." if container else ""
        keys = [p for p in prof.modules if p.startswith(prefix) and p.count(".") == first.count(".")]
        start = keys.index(first) if first in keys else 0
        hidden.extend(k for k in keys[start + 1:start + count])
    rows = []
    for m in prof.rows(max_depth=depth):
        if any(m.path == h or m.path.startswith(h + ".") for h in hidden):
            continue
        label = m.path.rpartition(".")[2] if m.path else "<model>"
        count = 1
        if m.path in first_of:
            label, count = first_of[m.path]
        rows.append(("  " * m.depth + label, m, count))
    return rows


def module_table(prof: ModelProfile, *, depth: int = 2, collapse_blocks: bool = True) -> Table:
    """One row per module down to `depth` (0: the model only), indented by depth, inclusive figures. With
    `collapse_blocks`, a run of identical blocks is one row ("0..79", count x80) with per-block figures."""
    t = Table(title=f"{prof.model} on {prof.hardware.name} ({prof.dtype}), per module, inclusive",
              title_justify="left")
    for col in ("module", "type", "x", "params", "FLOPs fwd", "FLOPs bwd", "saved act", "time fwd", "time bwd",
                "% time"):
        t.add_column(col, justify="left" if col in ("module", "type") else "right", no_wrap=True)
    total_s = prof.step_time_s or 1.0
    if collapse_blocks:
        rows = _collapsed_rows(prof, depth)
    else:
        rows = [("  " * m.depth + (m.path.rpartition(".")[2] if m.path else "<model>"), m, 1)
                for m in prof.rows(max_depth=depth)]
    for label, m, count in rows:
        t.add_row(label, m.type_name, f"x{count}" if count > 1 else "", fmt_count(m.n_params),
                  fmt_flops(m.forward_flops), fmt_flops(m.backward_flops + m.recompute_flops),
                  fmt_bytes(m.saved_bytes), fmt_time(m.forward_time_s), fmt_time(m.backward_time_s),
                  f"{100 * m.time_s * count / total_s:.1f}")
    return t


def summary_table(prof: ModelProfile) -> Table:
    """Totals: FLOPs, memory by category, the peak and where it happens, step time, MFU."""
    t = Table(title="totals", show_header=False, title_justify="left")
    t.add_column("what")
    t.add_column("value", justify="right")
    rows = [
        ("FLOPs forward / backward / recompute", f"{fmt_flops(prof.forward_flops)} / "
         f"{fmt_flops(prof.backward_flops)} / {fmt_flops(prof.recompute_flops)}"),
        ("parameters", f"{fmt_count(prof.modules[''].n_params)} ({fmt_bytes(prof.param_bytes)})"),
        ("gradients", fmt_bytes(prof.grad_bytes)),
        (f"optimizer state ({prof.optimizer})", fmt_bytes(prof.optimizer_state_bytes)),
        ("inputs + buffers", fmt_bytes(prof.input_bytes + prof.buffer_bytes)),
        ("saved for backward", fmt_bytes(prof.saved_bytes + prof.saved_input_bytes)),
        ("activation peak (above resident)", fmt_bytes(prof.activation_peak_bytes)),
        ("peak memory", f"{fmt_bytes(prof.peak_bytes)} of {fmt_bytes(prof.hardware.memory_bytes)}"
                        + ("" if prof.peak_bytes <= prof.hardware.memory_bytes else
                           f" (does not fit one device: {prof.peak_bytes / prof.hardware.memory_bytes:.1f}x; "
                           f"shard or checkpoint)")),
        ("peak at", f"{prof.peak_module or '<model>'} ({prof.peak_phase}, op #{prof.peak_op_index})"),
        ("step time (roofline)", f"{fmt_time(prof.step_time_s)} (fwd {fmt_time(prof.forward_time_s)}, "
                                 f"bwd {fmt_time(prof.backward_time_s)})"),
        ("MFU", f"{100 * prof.mfu:.1f} %"),
        ("ops profiled", f"{len(prof.ops)}"),
        ("blocks reused", ", ".join(f"{b['first']}..{b['last']} (x{b['count']})" for b in prof.reused_blocks)
         or "none"),
        ("profile time", fmt_time(prof.profile_time_s)),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t
