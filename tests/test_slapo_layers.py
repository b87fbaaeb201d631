"""The layers are a one-way street (DESIGN.md, "Layers"): `schedule/` records data and imports neither the graph
nor the runtime layer (nor anything above it); `graph/` does not import the runtime. Checked on the source with
`ast`, every import statement counted, including those inside functions."""

import ast
from pathlib import Path

import treadle

SRC = Path(treadle.__file__).parent
FORBIDDEN = {
    "schedule": {"graph", "runtime", "models", "planner", "profile", "cost", "verify", "cli", "testing"},
    "graph": {"runtime", "models", "planner", "verify", "cli", "testing"},
}


def _imported_layers(path: Path, package: str) -> set[tuple[str, int]]:
    """(top-level treadle sub-package, line) for each import in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] == "treadle" and len(parts) > 1:
                    out.add((parts[1], node.lineno))
            elif node.level == 1:
                out.add((package, node.lineno))
            else:  # from ..x import y  /  from .. import x
                if node.module:
                    out.add((node.module.split(".")[0], node.lineno))
                else:
                    out |= {(a.name.split(".")[0], node.lineno) for a in node.names}
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "treadle" and len(parts) > 1:
                    out.add((parts[1], node.lineno))
    return out


def test_lower_layers_do_not_import_upper_layers():
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((SRC / package).glob("*.py")):
            for layer, line in sorted(_imported_layers(path, package)):
                if layer in forbidden:
                    bad.append(f"{path.relative_to(SRC)}:{line} imports treadle.{layer}")
    assert not bad, "\n".join(bad)


def test_the_scan_sees_relative_and_absolute_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from ..graph.capture import x\ndef g():\n    from ..runtime import build\nimport treadle.cost.x\n"
                 "from .. import planner\n")
    assert {layer for layer, _ in _imported_layers(f, "schedule")} == {"graph", "runtime", "cost", "planner"}
