"""The serving core holds what serving uses, and imports neither the lab nor the doors.

``model/`` is what a request touches; ``lab/`` (training, evaluation, data, geometry, tasks)
and ``interop/`` (Hugging Face and GGUF) import the core, never the other way. Checked on the
sources' runtime imports (those under ``if TYPE_CHECKING`` are annotations only)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path) -> set[str]:
    """The modules ``path`` imports when it runs (``from X import Y``: X and X.Y)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def test_the_core_imports_neither_the_lab_nor_the_doors() -> None:
    for path in sources("model"):
        outside = {
            name for name in runtime_imports(path) if name.split(".")[0] in ("lab", "interop")
        }
        assert not outside, f"{path.relative_to(REPO)} imports {sorted(outside)}"


def test_every_module_of_the_core_is_used_in_serving() -> None:
    """``ls model/`` lists only what a request touches: every module is reached from the
    server's imports (the registry's schemes and the kernels' modules by name, as they load)."""
    known = {module_name(path) for path in sources("model")}
    reached: set[str] = set()
    todo = [name for path in sources("server") for name in runtime_imports(path)]
    todo += [name for name in known if name.startswith(("model.positional.", "model.kernels."))]
    while todo:
        name = todo.pop()
        if name in reached or name not in known:
            continue
        reached.add(name)
        path = REPO / Path(*name.split("."))
        file = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        todo += runtime_imports(file)
        todo += [parent for parent in (name.rsplit(".", 1)[0],) if "." in name]
    assert known - reached == set(), "in model/ but never used in serving"
