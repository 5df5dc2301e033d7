"""The package's import graph: no cycles, counting imports inside functions too, and the game,
engines and train packages import only what their layer allows.

Run it as a script to print the graph in layers (each module imports only modules of lower
layers): ``.venv/bin/python tests/test_import_graph.py``.
"""

from __future__ import annotations

import ast
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "selfplay"

# What each self-contained package may import besides its own modules.
ALLOWED = {
    "selfplay.game": {"selfplay.errors", "selfplay.seats"},
    "selfplay.engines": {"selfplay.errors", "selfplay.hardware"},
    "selfplay.train": {
        "selfplay.errors",
        "selfplay.hardware",
        "selfplay.training_schema",
        "selfplay.models",
        "selfplay.model_card",
        "selfplay.train.compat",
    },
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The package module that ``import name`` (or ``from a import b`` as a.b) loads."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> set[str]:
    """Package modules ``module`` imports, at the top or inside functions; not those imported
    only for type checking, not its own submodules (a package's factory importing its parts)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("selfplay"):
                found.update(_resolve(f"{child.module}.{a.name}") for a in child.names)
            elif isinstance(child, ast.Import):
                found.update(_resolve(a.name) for a in child.names if a.name.startswith("selfplay"))
            visit(child)

    visit(ast.parse(MODULES[module].read_text()))
    own = module + "."
    return {m for m in found if m and m != module and not m.startswith(own)}


def graph() -> dict[str, set[str]]:
    return {m: imports(m) for m in MODULES}


def layers(g: dict[str, set[str]]) -> list[list[str]]:
    """Modules by layer: layer 0 imports nothing of the package, layer k only layers below k."""
    sorter = TopologicalSorter(g)
    sorter.prepare()  # raises CycleError naming a cycle
    out = []
    while sorter.is_active():
        ready = sorted(sorter.get_ready())
        out.append(ready)
        sorter.done(*ready)
    return out


def test_the_import_graph_has_no_cycles():
    try:
        found = layers(graph())
    except CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None
    assert sum(map(len, found)) == len(MODULES)


def test_self_contained_packages_import_only_their_layer():
    g = graph()
    for package, allowed in ALLOWED.items():
        for module, targets in g.items():
            if module == package or module.startswith(package + "."):
                bad = {t for t in targets if not t.startswith(package)} - allowed
                assert not bad, f"{module} imports {sorted(bad)}"


def test_the_graph_sees_imports_inside_functions():
    """The checks above would pass vacuously if lazy imports were missed."""
    assert "selfplay.train" in imports("selfplay.iterate.stages")  # inside a function
    assert "selfplay.players" not in imports("selfplay.game.api")  # only under TYPE_CHECKING


if __name__ == "__main__":
    g = graph()
    for i, layer in enumerate(layers(g)):
        print(f"layer {i}:")
        for module in layer:
            targets = ", ".join(sorted(t.removeprefix("selfplay.") for t in g[module]))
            print(f"  {module.removeprefix('selfplay.') or 'selfplay'} <- {targets or '-'}")
    sys.exit(0)
