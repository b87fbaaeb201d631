"""Explanations of a Plan: a per-module table (rich or text), the estimate and the binding constraint.

Formatters build data into a `rich.table.Table` or a string and print nothing; units are picked here
(ms, GiB) and nowhere else.
"""

from __future__ import annotations

from rich.table import Table

GiB = 2**30


def plan_table(plan, *, top: int | None = None) -> Table:
    """Rows of `plan` (most expensive first when `top` is given) as a rich Table."""
    t = Table("module", "x", "layout", "compute ms", "comm ms", "recompute ms", "memory GiB",
              title=f"plan on {plan.cluster} ({plan.roles}, {plan.mode})")
    rows = list(plan.rows)
    if top is not None:
        rows = sorted(rows, key=lambda r: -(r.compute_s + r.comm_s + r.recompute_s))[:top]
    for r in rows:
        t.add_row(r.path, str(r.count), r.layout, f"{r.compute_s * 1e3:.3f}", f"{r.comm_s * 1e3:.3f}",
                  f"{r.recompute_s * 1e3:.3f}", f"{r.memory_bytes / GiB:.3f}")
    return t


def summary_lines(plan) -> list[str]:
    e = plan.estimated
    s = plan.solver
    lines = [f"estimate: {e}",
             f"memory: static {e.static_bytes / GiB:.3f} GiB + activations {e.activation_bytes / GiB:.3f} GiB "
             f"+ recomputed block {e.transient_bytes / GiB:.3f} GiB",
             f"binding constraint: {plan.binding}",
             f"solver: {s.get('status')} (gap {s.get('gap', 0):.2g}), {s.get('n_vars')} vars, "
             f"{s.get('n_constraints')} constraints, planning {s.get('planning_s', 0):.2f} s"]
    ck = s.get("checkpoints") or {}
    if ck:
        lines.append("checkpointed blocks: " + ", ".join(f"{c} like {p}" for p, c in ck.items()))
    alts = s.get("alternatives") or []
    if len(alts) > 1:
        lines.append("role assignments: " + "; ".join(
            f"{a['roles']}: {a['status']} {a['step_s'] * 1e3:.2f} ms {a['peak_bytes'] / GiB:.2f} GiB" for a in alts))
    if plan.unknown_ops:
        lines.append("ops without a sharding rule (run replicated): " +
                     ", ".join(f"{k} x{v}" for k, v in sorted(plan.unknown_ops.items())))
    if s.get("unknown_flops"):
        lines.append("ops without a FLOP formula (priced by bytes only): " +
                     ", ".join(f"{k} x{v}" for k, v in sorted(s["unknown_flops"].items())))
    return lines


def explain_text(plan, *, top: int | None = None) -> str:
    """The table and summary as plain text (fixed-width columns)."""
    head = ("module", "x", "layout", "compute ms", "comm ms", "recompute ms", "memory GiB")
    rows = list(plan.rows)
    if top is not None:
        rows = sorted(rows, key=lambda r: -(r.compute_s + r.comm_s + r.recompute_s))[:top]
    body = [(r.path, str(r.count), r.layout, f"{r.compute_s * 1e3:.3f}", f"{r.comm_s * 1e3:.3f}",
             f"{r.recompute_s * 1e3:.3f}", f"{r.memory_bytes / GiB:.3f}") for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head)] + [fmt.format(*b) for b in body]
    return "\n".join(lines + [""] + summary_lines(plan))
