"""The step of a `treadle.profile.ModelProfile` as a Timeline: one slice per ATen op (its roofline time, its
FLOPs and bytes in the args) on the compute track of one device, and the profile's own memory timeline.

Unlike a plan (NOTE [plan attribution] in costs.py), a profile records every op in run order with its phase
and the live activation bytes after it, so nothing here is attributed: slices follow the records, and the
memory curve is resident bytes plus the recorded live bytes (its maximum is the profile's peak).
"""

from __future__ import annotations

from .timeline import COMPUTE, MemoryPoint, Span, Timeline


def timeline_from_profile(prof) -> Timeline:
    """Slices and memory of `prof` (with op records). Raises ValueError for a profile saved without ops."""
    if not prof.ops:
        raise ValueError(f"timeline_from_profile: the profile of {prof.model} holds no op records "
                         f"(written with ops=False); profile again or save with ops")
    static = float(prof.param_bytes + prof.optimizer_state_bytes)
    other = float(prof.buffer_bytes + prof.input_bytes)
    spans: list[Span] = []
    memory = [MemoryPoint(0.0, static, other, 0.0, 0.0)]
    t = 0.0
    forward_end = None
    for r in prof.ops:
        if r.phase != "forward" and forward_end is None:
            forward_end = t
        if r.time_s > 0:
            spans.append(Span(COMPUTE, r.op, t, r.time_s, r.phase, r.time_s,
                              {"module": r.module or "<model>", "flops": r.flops, "backward_flops": r.backward_flops,
                               "read_bytes": r.read_bytes, "write_bytes": r.write_bytes,
                               "saved_bytes": r.saved_bytes, "dtype": r.dtype, "op_index": r.index}))
            t += r.time_s
        memory.append(MemoryPoint(t, static, other, float(r.live_after_bytes), 0.0))
    totals = {"step_s": prof.step_time_s, "compute_s": prof.forward_time_s + prof.backward_time_s,
              "comm_s": 0.0, "recompute_s": 0.0}
    return Timeline(f"{prof.model} on {prof.hardware.name} (profile)", spans, [COMPUTE], t,
                    t if forward_end is None else forward_end, memory, float(prof.peak_bytes),
                    float(prof.hardware.memory_bytes), 1, totals,
                    ["one slice per ATen op at its roofline time; memory = resident + live bytes after each op "
                     "(static = parameters + optimizer states, other = buffers + inputs, activations = live "
                     "activations, temporaries and gradients)"])
