"""Repeated blocks: find runs of identical sub-modules, profile two of each run, and splice in the rest.

NOTE [block reuse]: transformer layers in an `nn.ModuleList` (or ModuleDict, Sequential) are usually identical: same
class, same parameter and buffer shapes, dtypes and `requires_grad`, same plain attributes (numbering
attributes such as `layer_idx` aside) and same hooks, recursively. For a run of n >= 4 such blocks b_0..b_{n-1},
the profiler runs the model with only b_0, b_1 and b_{n-1} (the container is shortened in place and restored
after). b_1 is the *template*: it has an identical block before it (what it receives and leaves saved in
forward) and after it (what flows back into it in backward, e.g. gradients summed over blocks that share an
input), so its ops, saved tensors and memory deltas are those of every middle block b_2..b_{n-2}. The full step
is then rebuilt exactly:
- forward: after b_1's ops come copies for b_2..b_{n-2}, each shifted by the template's net live-bytes change;
- backward (reverse order): b_{n-1}'s own ops, copies for b_{n-2}..b_2, then b_1's own ops;
- every record after a spliced segment is shifted by the bytes the copies added.
Totals (FLOPs, bytes, saved bytes, peak and where it is) equal those of profiling every block, op for op; the
tests check this on five architectures. Safety checks, each falling back to profiling every block (`expand`
returns None): b_{n-1}'s forward ops must match the template's op for op (a block whose behaviour depends on
its position, e.g. through `layer_idx`, shows up here), and the template's ops must be contiguous in the run.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator

from torch import nn

from .records import OpRecord

logger = logging.getLogger(__name__)

_SIMPLE = (bool, int, float, str, type(None))
_NUMBERING = ("idx", "index", "layer_id", "layer_num", "block_id")


def _structure_key(m: nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) if p is not None else (n, None)
                   for n, p in m._parameters.items())
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) if b is not None else (n, None) for n, b in m._buffers.items())
    attrs = tuple(sorted((k, v) for k, v in vars(m).items()
                         if isinstance(v, _SIMPLE) and not k.startswith("_") and not any(s in k for s in _NUMBERING)))
    hooks = (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
             len(getattr(m, "_backward_pre_hooks", {})))
    children = tuple((n, _structure_key(c)) for n, c in m._modules.items() if c is not None)
    return type(m).__module__, type(m).__qualname__, params, buffers, attrs, hooks, children


@dataclass(frozen=True, slots=True)
class BlockRun:
    """Children `keys[start:stop]` of the container at `container_path` are identical blocks."""

    container_path: str
    keys: tuple[str, ...]
    start: int
    stop: int

    def member(self, i: int) -> str:
        return f"{self.container_path}.{self.keys[i]}" if self.container_path else self.keys[i]

    @property
    def template(self) -> str:
        return self.member(self.start + 1)

    @property
    def last(self) -> str:
        return self.member(self.stop - 1)

    @property
    def extras(self) -> list[str]:
        """Blocks rebuilt as copies of the template: b_2..b_{n-2}."""
        return [self.member(i) for i in range(self.start + 2, self.stop - 1)]

    def to_dict(self) -> dict[str, Any]:
        return {"container": self.container_path, "first": self.member(self.start),
                "last": self.member(self.stop - 1), "count": self.stop - self.start, "template": self.template}


def find_block_runs(model: nn.Module, *, min_count: int = 4) -> list[BlockRun]:
    """Runs of >= `min_count` consecutive identical children of every ModuleList / ModuleDict / Sequential, outermost
    first (containers inside a run's blocks are left alone: the template is profiled in full; so is a ModuleList or
    ModuleDict inside an entry of any other container)."""
    runs: list[BlockRun] = []
    covered: list[str] = []
    containers = [(p, m) for p, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential))]
    for path, mod in containers:
        if any(path == c or path.startswith(c + ".") for c in covered):
            continue
        if not isinstance(mod, nn.Sequential) and any(
                len(o) >= 2 and path.startswith(f"{op}." if op else "") and path != op for op, o in containers):
            continue  # NOTE [only outer stacks are shortened] in planner/capture.py: a list inside a block (per-head
            # norms zipped with the heads) is not known to run as a chain; a Sequential's forward is one
        keys = tuple(k for k, c in mod._modules.items() if c is not None)
        sig = [_structure_key(mod._modules[k]) for k in keys]
        i = 0
        found: list[BlockRun] = []
        while i < len(keys):
            j = i + 1
            while j < len(keys) and sig[j] == sig[i]:
                j += 1
            if j - i >= min_count:
                found.append(BlockRun(path, keys, i, j))
            i = j
        left_out = {k for run in found for k in range(run.start + 2, run.stop - 1)}
        if not keeps_positions(sig, [k for k in range(len(keys)) if k not in left_out]):
            continue  # NOTE [a shortened list keeps its kinds in place]: this container is profiled whole
        runs += found
        covered.extend(run.member(k) for run in found for k in range(run.start, run.stop))
    return runs


# NOTE [a shortened list keeps its kinds in place]: a model may read a per-block setting by the block's position
# in the list rather than from the block (Hugging Face's hybrid decoders pick each layer's attention mask by
# ``config.layer_types[i]`` over ``enumerate(self.layers)``). A list with blocks left out shifts those positions,
# so the kept blocks would run with another block's setting. A shortened list is therefore used only where, position
# by position, its blocks are of the kinds the full list has there (true for a list of one kind); else its blocks
# are all recorded. (Measured: Qwen2 with sliding-window layers after 4 full ones, 10 blocks, shortened naively:
# 18 ops fewer than recording every block, in the first sliding block.)
def keeps_positions(kinds: list, kept: list[int]) -> bool:
    """Whether the blocks at `kept` (indices, in order) have, at their new positions, the kinds of the full list's
    blocks there (NOTE [a shortened list keeps its kinds in place])."""
    return all(kinds[k] == kinds[p] for p, k in enumerate(kept))


@contextlib.contextmanager
def shortened(model: nn.Module, runs: list[BlockRun]) -> Iterator[None]:
    """Keep the first two and the last block of every run in their containers; restore the others on exit."""
    saved: list[tuple[nn.Module, dict]] = []
    try:
        for run in runs:
            container = model.get_submodule(run.container_path) if run.container_path else model
            saved.append((container, dict(container._modules)))
            for k in run.keys[run.start + 2:run.stop - 1]:
                del container._modules[k]
        yield
    finally:  # last first: two runs of one container each saved it, the first one whole
        for container, modules in reversed(saved):
            container._modules.clear()
            container._modules.update(modules)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _rename(path: str, old: str, new: str) -> str:
    if path == old:
        return new
    if path.startswith(old + "."):
        return new + path[len(old):]
    return path


def _segment(records: list[OpRecord], run: BlockRun, phases: tuple[str, ...]) -> tuple[int, int] | None:
    idx = [r.index for r in records if r.phase in phases and _under(r.module, run.template)]
    if not idx:
        return None
    lo, hi = idx[0], idx[-1]
    others = (run.member(run.start), run.last)  # the other blocks kept in the shortened run
    for r in records[lo:hi + 1]:
        if any(_under(r.module, o) for o in others):
            return None
    return lo, hi


def expand(records: list[OpRecord], runs: list[BlockRun], *, final_live_bytes: int) -> list[OpRecord] | None:
    """The records of the full model rebuilt from a shortened run (see NOTE [block reuse]), or None when a
    template's ops are not contiguous. `final_live_bytes` is the live count after the last op's frees."""
    if not runs:
        return records

    def live_at(i: int) -> int:  # live bytes when op i starts (after the frees that preceded it)
        return records[i].live_before_bytes if i < len(records) else final_live_bytes

    # (first index, last index, run, is_backward)
    segments: list[tuple[int, int, BlockRun, bool]] = []
    for run in runs:
        fwd = _segment(records, run, ("forward",))
        bwd = _segment(records, run, ("backward", "recompute"))
        if fwd is None:
            logger.warning("block reuse: template %s ran no ops; profiling every block", run.template)
            return None
        last = [(r.op, r.flops, r.output_bytes) for r in records if r.phase == "forward" and _under(r.module, run.last)]
        if last != [(r.op, r.flops, r.output_bytes) for r in records[fwd[0]:fwd[1] + 1]]:
            logger.warning("block reuse: %s does not run the ops %s runs (position-dependent blocks?); "
                           "profiling every block", run.last, run.template)
            return None
        segments.append((*fwd, run, False))
        if bwd is not None:
            segments.append((*bwd, run, True))
    segments.sort(key=lambda s: s[0])
    for (_, a_hi, *_), (b_lo, *_) in zip(segments[:-1], segments[1:], strict=True):
        if b_lo <= a_hi:
            logger.warning("block reuse: template segments overlap; profiling every block")
            return None

    out: list[OpRecord] = []
    offset = 0
    pos = 0

    def emit(seg: list[OpRecord], *, old: str, new: str, shift: int) -> None:
        names: dict[str, str] = {}
        base = len(out)
        for i, r in enumerate(seg):
            m = names.get(r.module)
            if m is None:
                m = names[r.module] = _rename(r.module, old, new)
            out.append(r.copy_to(index=base + i, module=m, live_offset_bytes=shift))

    for lo, hi, run, backward in segments:
        for r in records[pos:lo]:
            out.append(r.copy_to(index=len(out), module=r.module, live_offset_bytes=offset))
        seg = records[lo:hi + 1]
        delta = live_at(hi + 1) - live_at(lo)
        extras = run.extras
        if not backward:
            emit(seg, old=run.template, new=run.template, shift=offset)
            for c, name in enumerate(extras, start=1):
                emit(seg, old=run.template, new=name, shift=offset + c * delta)
        else:
            for c, name in enumerate(reversed(extras)):
                emit(seg, old=run.template, new=name, shift=offset + c * delta)
            emit(seg, old=run.template, new=run.template, shift=offset + len(extras) * delta)
        offset += len(extras) * delta
        pos = hi + 1
    for r in records[pos:]:
        out.append(r.copy_to(index=len(out), module=r.module, live_offset_bytes=offset))
    return out


def block_container(model: nn.Module) -> str | None:
    """Path of the model's main stack of repeated blocks: of its nn.ModuleLists, nn.ModuleDicts keyed "0",
    "1", ... in order (torchtitan's layers) and nn.Sequentials of one block class, the one holding the most parameters (then the longest: not a list of
    per-head norms inside a block), so that ``f"{path}.{i}"`` names block i either way; None if none."""
    best, best_key = None, (0, 0)
    for p, m in model.named_modules():
        if not is_block_stack(m):
            continue
        key = (sum(q.numel() for q in m.parameters()), len(m))  # the stack that holds most, not a per-head list
        if key > best_key:
            best, best_key = p, key
    return best


def is_block_stack(m: nn.Module) -> bool:
    """An nn.ModuleList, an nn.ModuleDict keyed "0", "1", ... in order, or an nn.Sequential of two or more
    entries of one class (timm's ``blocks``; not a Linear-GELU-Linear MLP)."""
    if isinstance(m, nn.Sequential):
        return len(m) >= 2 and len({type(c) for c in m}) == 1
    return isinstance(m, nn.ModuleList) or (
        isinstance(m, nn.ModuleDict) and list(m.keys()) == [str(i) for i in range(len(m))])
