"""A schedule's Python lines as a person reads them in a report: sorted by module path numerically
(``layers.2`` before ``layers.10``), and the identical instances of a repeated block collapsed to one.

    collapse_schedule(plan.python_lines())
    # 97 calls: identical repeated blocks shown once with "x N"; sorted by module path
    sch.data_parallel(axis='dp', shard=False)
    # model.layers.0 .. model.layers.31: x 32 identical blocks (model.layers.0 shown)
    sch['model.layers.0.self_attn.q_proj'].shard('weight', dim=0, axis='tp')
    ...

A line's module path is the ``sch['...']`` it starts with; its block is the path up to its first integer
component (``model.layers.`` and 3 in ``model.layers.3.mlp``). Two instances of a block are identical when
their lines are the same with the index written as ``{i}``. Lines without a path (``sch.data_parallel``) come
first, in their order; every other line, single or block, by the natural order of its path.
"""

from __future__ import annotations

import re

_PATH = re.compile(r"""sch\[(['"])(.*?)\1\]""")
_INDEX = re.compile(r"^(.*?\.)(\d+)(?=\.|$)")


def natural_key(text: str) -> list:
    """Sort key ordering the integer runs of `text` by value: 'layers.2' < 'layers.10'."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text) if t]


def _path(line: str) -> str | None:
    m = _PATH.match(line)
    return m.group(2) if m else None


def _ranges(ix: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out: list[str] = []
    start = prev = ix[0]
    for i in ix[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out)


def collapse_schedule(lines: list[str]) -> list[str]:
    """`lines` (schedule calls, e.g. `Plan.python_lines()`) collapsed and sorted as the module doc says, with one
    heading comment, and one comment before each group of identical block instances naming them ("x N")."""
    plain: list[str] = []
    singles: list[tuple[list, list[str]]] = []
    blocks: dict[str, dict[int, list[str]]] = {}
    for line in lines:
        path = _path(line)
        m = _INDEX.match(path) if path else None
        if path is None:
            plain.append(line)
        elif m is None:
            singles.append((natural_key(path), [line]))
        else:
            pre, i = m.group(1), int(m.group(2))
            templ = re.sub(re.escape(pre) + str(i) + r"""(?=[.'"]|$)""", pre.replace("\\", "\\\\") + "{i}", line)
            blocks.setdefault(pre, {}).setdefault(i, []).append(templ)
    groups: list[tuple[list, list[str]]] = []
    for pre, by_index in blocks.items():
        same: dict[tuple[str, ...], list[int]] = {}
        for i in sorted(by_index):
            key = tuple(sorted(by_index[i], key=lambda t: natural_key(_path(t) or "")))
            same.setdefault(key, []).append(i)
        for templs, ix in same.items():
            body = [t.replace(pre + "{i}", f"{pre}{ix[0]}") for t in templs]
            if len(ix) > 1:
                what = (f"{pre}{ix[0]} .. {pre}{ix[-1]}" if ix == list(range(ix[0], ix[-1] + 1))
                        else f"{pre}{{{_ranges(ix)}}}")
                body.insert(0, f"# {what}: x {len(ix)} identical blocks ({pre}{ix[0]} shown)")
            groups.append((natural_key(f"{pre}{ix[0]}"), body))
    ordered = sorted(singles + groups, key=lambda kv: kv[0])
    head = (f"# {len(lines)} call{'' if len(lines) == 1 else 's'}: identical repeated blocks shown once with \"x N\"; "
            f"sorted by module path")
    return [head] + plain + [line for _, body in ordered for line in body]


__all__ = ["collapse_schedule", "natural_key"]
