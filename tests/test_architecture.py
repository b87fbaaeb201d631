"""The shape of the source tree (docs/architecture.md): the import graph has no cycle between files or packages and
every arrow points down the layer picture; no package reads the schedule's private state; files stay small.

The import graph is read with `ast` from every file under src/treadle, function-level imports included. Imports
under ``if TYPE_CHECKING:`` are not arrows: they never run (annotations only). The package ``treadle`` itself (its
``__init__``: the public facade that imports every layer) is not a layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "treadle"

# The layer picture of docs/architecture.md, bottom first: a package may import its own layer and those below.
LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("units", "placement", "mesh", "loss", "form", "sharding_rules", "testing", "emulated_nodes", "lazy", "quiet",
     "transport"),
    ("schedule",),
    ("graph", "profile", "viz"),
    ("cost",),
    ("runtime",),
    ("pricing",),
    ("planner",),
    ("forms",),
    ("models",),
    ("verify",),
    ("run",),
    ("cli",),
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                out.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return out


def _resolve(name: str, is_pkg: bool, node: ast.AST, mods: dict[str, Path]) -> list[str]:
    """The treadle modules one import statement reaches (a name imported from a package that is a submodule
    counts as that submodule)."""
    if isinstance(node, ast.Import):
        wanted = [a.name for a in node.names]
    else:
        if node.level:
            base = name.split(".") if is_pkg else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        # ``from M import a``: the submodule M.a when there is one (``from . import x``), else M itself
        wanted = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names]
    out = []
    for t in wanted:
        while t and t not in mods:
            t = t.rpartition(".")[0]
        if t.startswith("treadle"):
            out.append(t)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        is_pkg = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in skip:
                edges.update(_resolve(name, is_pkg, node, mods))
        edges.discard(name)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # "treadle" itself: the facade, no layer


def test_no_import_cycle_between_files():
    assert _cycles(import_graph()) == []


def test_no_import_cycle_between_packages_and_every_arrow_points_down():
    graph = import_graph()
    wrong = []
    pkg_graph: dict[str, set[str]] = {}
    for a, targets in graph.items():
        pa = _package(a)
        if pa is None:
            continue
        assert pa in LAYER_OF, f"{a}: package {pa!r} is in no layer of LAYERS (docs/architecture.md)"
        for b in targets:
            pb = _package(b)
            if pb is None or pb == pa:
                continue
            pkg_graph.setdefault(pa, set()).add(pb)
            if LAYER_OF[pb] > LAYER_OF[pa]:
                wrong.append(f"{a} -> {b} ({pa}: layer {LAYER_OF[pa]}, {pb}: layer {LAYER_OF[pb]})")
    assert wrong == [], "imports pointing up the layer picture:\n" + "\n".join(sorted(wrong))
    assert _cycles(pkg_graph) == []


def test_only_the_schedule_layer_touches_its_private_state():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).parts[0] == "schedule":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "_state":
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert offenders == [], "read the schedule through Schedule.view():\n" + "\n".join(offenders)


def test_every_source_file_stays_small():
    long = {str(p.relative_to(SRC)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"files over {MAX_LINES} lines (a file that long is usually two ideas)"


def test_plan_model_reads_as_a_short_sequence_of_steps():
    tree = ast.parse((ROOT / "planner" / "search.py").read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "plan_model"]
    assert fn.end_lineno - fn.lineno + 1 < 50


def test_the_checks_see_a_cycle_and_an_upward_arrow():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    node = ast.parse("from ..planner.plan import Plan").body[0]
    mods = {"treadle.planner.plan": Path("x"), "treadle.planner": Path("y"), "treadle.pricing.step": Path("z")}
    assert _resolve("treadle.pricing.step", False, node, mods) == ["treadle.planner.plan"]
    node = ast.parse("from . import step").body[0]
    assert _resolve("treadle.pricing", True, node, mods) == ["treadle.pricing.step"]
    assert LAYER_OF["planner"] > LAYER_OF["pricing"]


@pytest.mark.parametrize("form", ["tensor", "sequence", "vocab", "data", "pipeline", "expert"])
def test_every_parallel_form_is_one_package_registered_in_one_place(form):
    import treadle  # noqa: F401  (registers the forms)
    from treadle.form import forms

    assert form in [f.name for f in forms()]
    assert (ROOT / "forms" / form / "__init__.py").is_file()
    registered_in = [p for p in ROOT.rglob("*.py") if "register_form(" in p.read_text()]
    assert [str(p.relative_to(ROOT)) for p in registered_in if "def register_form" not in p.read_text()] == [
        "forms/__init__.py"]
