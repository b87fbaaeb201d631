"""NOTE [blocks rehearsed once per context]: a rehearsal of a deep model records every block, and each block's
ops cost the same fake-tensor dispatch (Llama-3.1-405B: 126 blocks, about 40k ops, 8-12 s a price on this host).
A block's records depend on what the schedule states about it and on its neighbours: the block before it made
what it receives (a checkpointed block saves its input, which is charged to the op in the block before that
made it; what the block frees in its forward was made there too), and the block after it decides which of its
outputs are kept. And a checkpointed block's recomputation releases what the recomputation before it still
holds: non-reentrant `torch.utils.checkpoint` keeps some tensors of the last recomputed region (and its input)
alive until the next region recomputes (measured: a block's recomputed activations freed at the 16th op of the
next checkpointed block's recomputation, however far below). So blocks are grouped by *kind* -- the built
block's structure (`profile.blocks`' key: class, local parameter shapes, hooks, plain attributes, recursively)
together with the schedule's records on it, its own index replaced -- and by *context*: the kinds of (previous,
own, next), with the list's ends as kinds of their own, and for a block that holds a checkpointed region the
same triple of the next such block above it (or that there is none).

The rehearsal keeps, of the block list, the first occurrence of every context with both its neighbours (and
every block up to the next checkpointed block above it, with that one's successor; the first and last blocks
are among them), runs the step on that shortened list (the built model, its other blocks restored after), and
rebuilds the full step: each block's forward records are those of the kept block of the same context, renamed,
in order; then the records between the last forward and the first backward; then each
block's backward (and recomputation) in reverse order, likewise; each copy's live-memory timeline shifted by
the net live change of the copies before it; the collectives each block issued go with its records; and, for a
compiled step's price, the data flow between the ops (`_splice_flows`).

Where the shortened step does not have this shape the rehearsal records every block instead (`splice` returns
None): ops between two blocks, a block whose records are not contiguous, a collective of no block issued among
the blocks' records, two kept blocks of one kind whose forward ops differ (a block that behaves by its position
through something its structure does not show), a parameter held by two blocks, or a block buffer autograd saved
(charged once per storage, which a copy cannot tell). What is spliced is checked in the tests against recording
every block, record for record and price for price, on several architectures and schedules with irregular
checkpoint patterns.
"""

from __future__ import annotations

import bisect
import logging
import re
from dataclasses import dataclass

from torch import nn

from ..profile.blocks import _rename, _structure_key, keeps_positions
from ..profile.records import OpRecord
from ..schedule.tree import within

logger = logging.getLogger(__name__)

MIN_SAVED = 2  # blocks a shortened rehearsal must leave out to be worth splicing


@dataclass(frozen=True, slots=True)
class Shortening:
    """Blocks `keys` of the list at `container`, of `kinds`; `kept` (indices into keys, in order) are rehearsed,
    and block i's records are those of `keys[kept[rep[i]]]`."""

    container: str
    keys: tuple[str, ...]
    kinds: tuple[int, ...]
    kept: tuple[int, ...]
    rep: tuple[int, ...]
    holds: tuple[bool, ...] = ()  # per block: whether it holds a checkpointed region

    def path(self, i: int) -> str:
        return f"{self.container}.{self.keys[i]}" if self.container else self.keys[i]

    def alone(self, j: int) -> bool:
        """Whether kept block `j` (a position in `kept`) stands for itself and no other block."""
        return self.rep[self.kept[j]] == j and self.rep.count(j) == 1


def _mentions(text: str, container: str, rel: str, keys: tuple[str, ...]) -> dict[str, list[str]] | None:
    """Per block key, the paths below it that `text` (a record's arguments) names, or None when it names the block
    list in a way that is not one block's path (a glob, a slice)."""
    out: dict[str, list[str]] = {}
    full = re.compile(re.escape(container) + r"\.([^.'\"\s,\]\)]+)((?:\.[^'\"\s,\]\)]+)*)")
    found = 0
    for m in full.finditer(text):
        if m.group(1) not in keys:
            return None
        out.setdefault(m.group(1), []).append(m.group(2))
        found += 1
    if rel and text.count(rel + ".") != found:
        return None
    return out


def block_kinds(model: nn.Module, container: str, records) -> list[int] | None:
    """The kind of each block of the list at `container` in the built `model` (NOTE [blocks rehearsed once per
    context]), or None where a record names blocks in a way the kinds cannot tell apart or a parameter is shared
    between blocks."""
    lst = model.get_submodule(container) if container else model
    keys = tuple(k for k, c in lst._modules.items() if c is not None)
    owner: dict[int, str] = {}
    for k in keys:
        for p in lst._modules[k].parameters():
            if owner.setdefault(id(p), k) != k:
                return None
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owner and not within(name, f"{container}.{owner[id(p)]}" if container else owner[id(p)]):
            return None  # a block's parameter tied to one outside it
    per: dict[str, list[str]] = {k: [] for k in keys}
    paths = {k: (f"{container}.{k}" if container else k) for k in keys}
    for n, r in enumerate(records):
        text = repr(sorted(r.args.items(), key=lambda kv: kv[0]))
        hit = next((k for k in keys if within(r.path, paths[k])), None)
        if hit is not None:
            own = re.sub(re.escape(paths[hit]) + r"(?![^.'\"\s,\]\)])", "<block>", text)  # not block 12 for 1
            per[hit].append(f"{r.op} {r.path[len(paths[hit]):]!r} {own}")
            continue
        above = not r.path or container == r.path or container.startswith(r.path + ".")
        if not above:
            continue
        rel = container[len(r.path) + 1:] if r.path else container
        named = _mentions(text, container, rel if r.path else "", keys)
        if named is None:
            return None
        for k, subs in named.items():
            per[k].append(f"#{n} {r.op} {sorted(subs)}")
    ids: dict[tuple, int] = {}
    return [ids.setdefault((_structure_key(lst._modules[k]), tuple(per[k])), len(ids)) for k in keys]


def shortening(model: nn.Module, container: str | None, records, regions: tuple[str, ...] = ()
               ) -> Shortening | None:
    """Which blocks to rehearse (NOTE [blocks rehearsed once per context]), or None when none can be left out.
    `regions`: the checkpointed module paths (a region around the block list leaves nothing to leave out)."""
    if container is None or any(within(container, r) for r in regions):
        return None
    kinds = block_kinds(model, container, records)
    if kinds is None:
        return None
    n = len(kinds)
    lst = model.get_submodule(container) if container else model
    keys = tuple(k for k, c in lst._modules.items() if c is not None)
    paths = [f"{container}.{k}" if container else k for k in keys]
    holds = [any(within(r, p) for r in regions) for p in paths]
    ids: dict[tuple[int, bool], int] = {}  # a block that holds a region is a kind of its own however it was stated
    kinds = [ids.setdefault((k, h), len(ids)) for k, h in zip(kinds, holds)]
    near = [(kinds[i - 1] if i else -1, kinds[i], kinds[i + 1] if i + 1 < n else -1) for i in range(n)]
    # a checkpointed block's recomputation releases what the one recomputed before it still holds (NOTE):
    # its context includes the next checkpointed block above it (or none)
    above: list[int | None] = [None] * n
    nxt = None
    for i in reversed(range(n)):
        above[i] = nxt if holds[i] else None
        if holds[i]:
            nxt = i
    # (what it releases was made by every block between them: their kinds are in the context, and kept)
    ctx = [(near[i], tuple(kinds[i + 1:above[i] + 2]) if above[i] is not None else ("end" if holds[i] else None))
           for i in range(n)]
    first: dict[tuple, int] = {}
    keep: set[int] = set()
    for i, c in enumerate(ctx):
        if c not in first:
            first[c] = i
            last = i + 1 if above[i] is None else above[i] + 1
            keep.update(j for j in range(i - 1, last + 1) if 0 <= j < n)
    if n - len(keep) < MIN_SAVED:
        return None
    kept = tuple(sorted(keep))
    if not keeps_positions([_structure_key(lst._modules[k]) for k in keys], list(kept)):
        return None  # NOTE [a shortened list keeps its kinds in place]
    pos = {j: p for p, j in enumerate(kept)}
    return Shortening(container, keys, tuple(kinds), kept, tuple(pos[first[c]] for c in ctx), tuple(holds))


class shortened_list:
    """Context manager: the block list holds only the kept blocks (their keys unchanged); restored on exit."""

    def __init__(self, model: nn.Module, s: Shortening) -> None:
        self.lst = model.get_submodule(s.container) if s.container else model
        self.s = s
        self.saved: dict | None = None

    def __enter__(self) -> None:
        self.saved = dict(self.lst._modules)
        keep = {self.s.keys[j] for j in self.s.kept}
        for k in self.s.keys:
            if k not in keep:
                del self.lst._modules[k]

    def __exit__(self, *exc) -> None:
        self.lst._modules.clear()
        self.lst._modules.update(self.saved)


def _segments(records: list[OpRecord], paths: list[str], phases: tuple[str, ...]) -> list[tuple[int, int]] | None:
    """[lo, hi) of each kept block's records of `phases`, or None where one is empty or not contiguous."""
    out = []
    for p in paths:
        idx = [r.index for r in records if r.phase in phases and within(r.module, p)]
        if not idx or idx[-1] - idx[0] + 1 != len(idx):
            return None
        out.append((idx[0], idx[-1] + 1))
    return out


def splice(records: list[OpRecord], collectives: list[tuple], s: Shortening, final_live: int,
           frees: list[tuple[int, int, int]] | None = None, flows: list | None = None,
           owners: dict[int, tuple[int, str]] | None = None) -> tuple[list[OpRecord], list[tuple], list] | None:
    """The full step's records and collectives rebuilt from the shortened one (NOTE [blocks rehearsed once per
    context]), or None where the shortened step does not have the shape splicing needs. `frees`: the shortened
    step's (records before, allocating record, bytes) of each free (`StepRecorder.frees`), checked by
    `_lives_local`; `flows` (`StepRecorder.flows`) are spliced too where given (`_splice_flows`, with `owners`:
    storage id -> (kept position, name below the block) of the kept blocks' parameters and buffers), else the
    third item returned is []."""
    kept = [s.path(j) for j in s.kept]
    fwd = _segments(records, kept, ("forward",))
    bwd = _segments(records, kept, ("backward", "recompute"))
    if fwd is None or bwd is None:
        return None
    if any(a[1] != b[0] for a, b in zip(fwd, fwd[1:])) or any(b[1] != a[0] for a, b in zip(bwd, bwd[1:])):
        logger.debug("block reuse: ops between blocks; rehearsing every block")
        return None
    if fwd[-1][1] > bwd[-1][0]:
        return None
    sig: dict[int, list] = {}
    for j, p in enumerate(kept):  # blocks of one kind run the same forward ops wherever they stand
        ops = [(r.op, r.flops, r.output_bytes) for r in records[fwd[j][0]:fwd[j][1]]]
        if sig.setdefault(s.kinds[s.kept[j]], ops) != ops:
            logger.debug("block reuse: %s runs other ops than a block of its kind; rehearsing every block", p)
            return None
    if frees is not None and not _lives_local(frees, s, fwd, bwd, len(records)):
        return None
    n = len(s.keys)
    # the full step's pieces: (source lo, source hi, kept position of the source block or None, block or None, phase)
    pieces = [(0, fwd[0][0], None, None, "gap")]
    pieces += [(*fwd[s.rep[i]], s.rep[i], i, "fwd") for i in range(n)]
    pieces.append((fwd[-1][1], bwd[-1][0], None, None, "gap"))
    pieces += [(*bwd[s.rep[i]], s.rep[i], i, "bwd") for i in reversed(range(n))]
    pieces.append((bwd[0][1], len(records), None, None, "gap"))
    own = _collectives_by_piece(collectives, kept, fwd, bwd, len(records))
    if own is None:
        return None
    live = [r.live_before_bytes for r in records] + [final_live]
    out: list[OpRecord] = []
    colls: list[tuple] = []
    at = live[0]
    names: dict[tuple[str, str, str], str] = {}
    for lo, hi, r_, i_, ph in pieces:
        src, dst = (kept[r_], s.path(i_)) if r_ is not None else (None, None)
        shift = at - live[lo]
        base = len(out)
        for r in records[lo:hi]:
            m = r.module
            if src is not None:
                m = names.get((m, src, dst))
                if m is None:
                    m = names[(r.module, src, dst)] = _rename(r.module, src, dst)
            out.append(r.copy_to(index=len(out), module=m, live_offset_bytes=shift))
        key = ("block", src, ph) if src is not None else ("gap", lo)
        for n_before, module, phase, kind, axis, nbytes in own.get(key, ()):
            mod = _rename(module, src, dst) if src is not None else module
            colls.append((base + n_before - lo, mod, phase, kind, axis, nbytes))
        at += live[hi] - live[lo]
    if flows is None:
        return out, colls, []
    spliced = _splice_flows(records, flows, s, pieces, fwd, bwd, owners or {})
    return None if spliced is None else (out, colls, spliced)


def _splice_flows(records: list[OpRecord], flows: list, s: Shortening, pieces: list[tuple], fwd: list[tuple[int, int]],
                  bwd: list[tuple[int, int]], owners: dict[int, tuple[int, str]]) -> list | None:
    """The data flow of the full step (`StepRecorder.flows`: per record, the storage identities it reads and
    writes) rebuilt from the shortened one, or None where it cannot be told. A compiled step's price reads only
    which identities are equal (`pricing.compiled`), so each storage a block's records make is named by the copy
    that makes it, its position in the copied records and its place among that op's outputs; a read names the
    copy that made what it reads: the reader's own block, or the block as far from it as the maker is from the
    reader's kept block (within the contiguous kept blocks around it), whose records must run the maker's ops. A
    kept block's parameter or buffer is named by the copy's block and its name; what is made outside the blocks
    keeps its identity."""
    where: list[tuple | None] = [None] * len(records)  # record -> (kept position, phase) of the block records
    for j, (lo, hi) in enumerate(fwd):
        where[lo:hi] = [(j, "fwd")] * (hi - lo)
    for j, (lo, hi) in enumerate(bwd):
        where[lo:hi] = [(j, "bwd")] * (hi - lo)
    seg = {"fwd": fwd, "bwd": bwd}
    instance = {(i, ph): x for x, (_, _, _, i, ph) in enumerate(pieces) if i is not None}
    ops = {}

    def ops_of(j: int, ph: str) -> list[str]:
        if (j, ph) not in ops:
            lo, hi = seg[ph][j]
            ops[(j, ph)] = [r.op for r in records[lo:hi]]
        return ops[(j, ph)]

    def slot(made: int, ident) -> int:
        return next((w for w, (x, _) in enumerate(flows[made][1]) if x == ident), -1)

    out: list = []
    for x, (lo, hi, r, i, ph) in enumerate(pieces):
        def name(ident):
            sid, made = ident
            if made == -2:
                return ("none", x, sid)
            if made == -1:
                own = owners.get(sid)
                if own is None or r is None:
                    return ident
                d = s.kept[own[0]] - s.kept[r]
                if own[0] - r != d or not 0 <= i + d < len(s.keys):
                    raise LookupError
                return ("param", i + d, own[1])
            src = where[made]
            if src is None:  # made outside the blocks: one instance
                return ident
            k, pk = src
            if r is None:  # read outside the blocks: only the blocks that stand for themselves alone
                if not s.alone(k):
                    raise LookupError
                target = s.kept[k]
            else:
                d = s.kept[k] - s.kept[r]
                if k - r != d or not 0 <= i + d < len(s.keys):
                    raise LookupError
                target = i + d
            y = instance[(target, pk)]
            if ops_of(s.rep[target], pk) != ops_of(k, pk):
                raise LookupError
            return ("made", y, made - seg[pk][k][0], slot(made, ident))

        try:
            for a in range(lo, hi):
                reads, writes = flows[a]
                out.append((tuple((name(t), b) for t, b in reads), tuple((name(t), b) for t, b in writes)))
        except LookupError:
            logger.debug("block reuse: a data flow the splice cannot name; rehearsing every block")
            return None
    return out


def _collectives_by_piece(collectives: list[tuple], kept: list[str], fwd: list[tuple[int, int]],
                          bwd: list[tuple[int, int]], n_records: int) -> dict | None:
    """Each collective under the piece of the shortened step it belongs to: a kept block's forward or backward
    records (by its module and phase), or the gap before, between or after the blocks' records (by where it was
    issued); None where one falls elsewhere or the pieces would not give back the collectives' order."""
    own: dict[tuple, list[tuple]] = {}
    gaps = [(0, fwd[0][0]), (fwd[-1][1], bwd[-1][0]), (bwd[0][1], n_records)]
    for c in collectives:
        n_before, module = c[0], c[1]
        j = next((j for j, p in enumerate(kept) if within(module, p)), None)
        if j is not None:
            cls = "fwd" if c[2] == "forward" else "bwd"
            lo, hi = (fwd if cls == "fwd" else bwd)[j]
            if not lo <= n_before <= hi:
                return None
            own.setdefault(("block", kept[j], cls), []).append(c)
            continue
        gap = next((g for g in gaps if g[0] <= n_before <= g[1]), None)
        if gap is None:
            return None
        own.setdefault(("gap", gap[0]), []).append(c)
    order = [("gap", gaps[0][0]), *(("block", p, "fwd") for p in kept), ("gap", gaps[1][0]),
             *(("block", p, "bwd") for p in reversed(kept)), ("gap", gaps[2][0])]
    if [c for k in order for c in own.get(k, ())] != list(collectives):
        return None
    return own


def _lives_local(frees: list[tuple[int, int, int]], s: Shortening, fwd: list[tuple[int, int]],
                 bwd: list[tuple[int, int]], n_records: int) -> bool:
    """Whether every storage's life ends where a splice repeats it faithfully (NOTE [blocks rehearsed once per
    context]): of the records some block takes, one a kept block made is freed in that block's records, a
    neighbour's, or another's with every block between them kept (a checkpointed region's release); a storage
    made or freed outside the blocks is so by a block whose records stand for itself alone (the first and last
    blocks). Where a block's storage lives on
    into the records between or around the blocks (what the model's forward holds until it returns), the
    shortened step frees it once per kept block, not once per block: not spliced. Frees after the last record
    are read by nothing."""
    starts = sorted([(lo, j) for j, (lo, _) in enumerate(fwd)] + [(lo, j) for j, (lo, _) in enumerate(bwd)])
    ends = {lo: (j, hi) for j, (lo, hi) in list(enumerate(fwd)) + list(enumerate(bwd))}

    def block_of(i: int) -> int | None:  # the kept block (position in the shortened list) whose records hold i
        k = bisect.bisect_right(starts, (i, len(fwd))) - 1
        if k < 0:
            return None
        lo = starts[k][0]
        j, hi = ends[lo]
        return j if i < hi else None

    uses = [0] * len(s.kept)
    for r in s.rep:
        uses[r] += 1
    alone = s.alone
    for before, made, _ in frees:
        if made < 0 or before <= 0 or before >= n_records:  # (after the last record: nothing reads it)
            continue
        a, f = block_of(made), block_of(before - 1)
        if f is not None and not uses[f]:
            continue  # freed in records no block takes: the blocks that stand for them free it alike
        if a is None or f is None:  # made or freed outside the blocks: by a block that stands for itself alone
            if not all(j is None or alone(j) for j in (a, f)):
                logger.debug("block reuse: a storage of op %d freed before op %d (outside the blocks); "
                             "rehearsing every block", made, before)
                return False
            continue
        if abs(a - f) > 1 and s.kept[a] - s.kept[f] != a - f and not (alone(a) and alone(f)):
            logger.debug("block reuse: a storage of %s freed in %s; rehearsing every block", s.path(s.kept[a]),
                         s.path(s.kept[f]))
            return False
    return True
