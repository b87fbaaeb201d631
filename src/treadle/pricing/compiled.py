"""A compiled step: the op times of a rehearsed step when its blocks run under `torch.compile`.

NOTE [compiled step]: `treadle.run --compile` compiles every block of every nn.ModuleList (`_compile_blocks`:
the outermost ones; the rest of the model stays eager). Inductor then runs a block's forward and its backward
(AOTAutograd) as
- the extern kernels as eager runs them: matrix products, attention, convolutions (cuBLAS / flash kernels;
  inductor does not fuse into them by default), each with the time its record has; and
- between two of them, the block's other ops (pointwise, reductions, copies, views) fused: one generated
  kernel per maximal run of such ops, which reads from memory only what the run takes from outside it and
  writes only what is used outside it (read by a later op of the step, or saved for backward), once.
So a compiled step's time is the eager one with each such run replaced by one kernel of that roofline time and
one launch (`op_overhead_s`). The data flow comes from the rehearsal (`StepRecorder.flows`: which storage each
op read and wrote). A reduction of a whole tensor to a scalar (float8's amax before its cast) ends its run: its
consumers cannot start before every block of it is done, so inductor gives it a kernel of its own and the cast
reads the tensor again. What is not modelled: inductor's other choices of where to split a run (a kernel it
would not make too large: the estimate is otherwise the fastest fusion), the
memory AOTAutograd's partitioner saves by recomputing cheap pointwise ops in backward (the memory is eager's,
at most too high), CUDA graphs (not used by `--compile`), and compile time itself.
"""

from __future__ import annotations

from torch import nn

from ..profile.roofline import memory_time_s
from ..schedule.tree import within

# kinds inductor does not fuse (extern kernels), after `treadle.profile.flops.KINDS`
EXTERN_KINDS = frozenset({"matmul", "attention", "conv"})
SCALAR_BYTES = 8  # what a whole-tensor reduction writes (one float64 at most)
EXECUTIONS = ("eager", "compiled")


def compiled_units(model: nn.Module) -> tuple[str, ...]:
    """Paths of the blocks `treadle.run --compile` compiles in `model`: each element of an nn.ModuleList that is
    not inside another such element."""
    units: list[str] = []
    for path, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and not any(within(path, u) for u in units):
            units += [f"{path}.{name}" if path else name for name, _ in m.named_children()]
    return tuple(units)


def _unit_of(module: str, units: tuple[str, ...], cache: dict[str, str | None]) -> str | None:
    if module not in cache:
        cache[module] = next((u for u in units if within(module, u)), None)
    return cache[module]


def ends_kernel(r) -> bool:
    """A reduction of a whole tensor to a scalar (float8's amax, a norm): inductor computes it in a kernel of its
    own (or a split reduction's two) before any consumer of its result runs, so a fused run ends with it and what
    follows reads its inputs again (NOTE [compiled step])."""
    return r.kind == "reduction" and r.write_bytes <= SCALAR_BYTES < r.read_bytes


def fusion_groups(records, units: tuple[str, ...]) -> list[tuple[int, int]]:
    """Maximal runs [i, j) of consecutive records in one compiled unit and one phase, none an extern kernel and
    none after a whole-tensor reduction inside it (`ends_kernel`), of two ops or more (NOTE [compiled step])."""
    groups: list[tuple[int, int]] = []
    cache: dict[str, str | None] = {}
    start, key = None, None
    for i, r in enumerate(records):
        unit = _unit_of(r.module, units, cache) if r.kind not in EXTERN_KINDS else None
        k = (unit, r.phase) if unit is not None else None
        ended = k is not None and k == key and ends_kernel(records[i - 1])  # this op starts the next kernel
        if k != key or ended:
            if key is not None and i - start > 1:
                groups.append((start, i))
            start, key = i, k
    if key is not None and len(records) - start > 1:
        groups.append((start, len(records)))
    return groups


def compiled_times(records, flows, units: tuple[str, ...], hw) -> list[float]:
    """Per record, its time under compile (NOTE [compiled step]): a fused run's kernel time and launch on its
    first record, 0 on the others; every other record its own time and launch. `flows`: the rehearsal's
    per-record (reads, writes) identities (same length as `records`)."""
    if len(flows) != len(records):
        raise ValueError(f"compiled_times: {len(flows)} flows for {len(records)} records")
    times = [r.time_s + hw.op_overhead_s for r in records]
    groups = fusion_groups(records, units)
    if not groups:
        return times
    # last record reading each storage identity, to know whether a run's output is used after it
    last_read: dict = {}
    for i, (reads, _) in enumerate(flows):
        for ident, _ in reads:
            last_read[ident] = i
    for i, j in groups:
        written: dict = {}
        external = 0.0
        seen_in: set = set()
        for k in range(i, j):
            reads, writes = flows[k]
            if records[k].kind == "view":  # metadata only: what a later op of the run reads through it counts
                reads = ()
            for ident, nbytes in reads:
                if ident not in written and ident not in seen_in:
                    seen_in.add(ident)
                    external += nbytes
            for ident, nbytes in writes:
                written[ident] = max(written.get(ident, 0), nbytes)
        saved = {ident for k in range(i, j) if records[k].saved_bytes for ident, _ in flows[k][1]}
        for ident, nbytes in written.items():  # what the run writes that is used outside it
            if ident in saved or last_read.get(ident, -1) >= j:
                external += nbytes
        times[i] = memory_time_s(external, hw) + hw.op_overhead_s
        for k in range(i + 1, j):
            times[k] = 0.0
    return times
