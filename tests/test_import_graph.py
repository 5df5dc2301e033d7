"""The package's import graph, every import counted (at the top, inside functions, and under
``TYPE_CHECKING``, since a type is a dependency of meaning too):

- modules: no cycle;
- packages (``selfplay.X``, a folder or a top-level module): no cycle, and every arrow points to a
  lower floor of ``FLOORS``, the design's picture of the tree (a new package must be placed);
- the self-contained packages (game, engines, train) import only what their layer allows.

Run it as a script to print both graphs in layers: ``.venv/bin/python tests/test_import_graph.py``.
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
    "selfplay.engines": {"selfplay.errors", "selfplay.fileio", "selfplay.hardware"},
    "selfplay.train": {
        "selfplay.environ",
        "selfplay.errors",
        "selfplay.fileio",
        "selfplay.hardware",
        "selfplay.training_schema",
        "selfplay.models",
        "selfplay.reward",
    },
}

# The tree as floors, lowest first: a package imports only packages of lower floors.
FLOORS = (
    ("environ", "errors", "hardware", "seats", "seeds", "training_schema"),  # shared vocabulary
    ("fileio",),  # writes that lose nothing and never follow a link
    ("engines", "game", "models", "reward", "tracking"),  # plug-ins and leaf helpers
    ("records", "train"),  # games.jsonl; the verl update (no game)
    ("convert", "metrics", "players"),
    ("generate", "manifest"),
    ("evaluate",),
    ("iterate",),
    ("options",),  # the face: which config fields each command takes
    ("recipe",),  # a command's options read from a file (--config)
    ("commands",),  # the commands, a module per group
    ("cli",),  # the app: registers the commands
    ("__main__",),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The package module that ``import name`` (or ``from a import b`` as a.b) loads."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def source_imports(text: str) -> set[str]:
    """Package modules a source imports: at the top, inside functions, under TYPE_CHECKING."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("selfplay"):
            found.update(_resolve(f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(_resolve(a.name) for a in node.names if a.name.startswith("selfplay"))
    return {m for m in found if m}


def imports(module: str) -> set[str]:
    """Package modules ``module`` imports, not its own submodules (a package's factory importing
    its parts)."""
    own = module + "."
    found = source_imports(MODULES[module].read_text())
    return {m for m in found if m != module and not m.startswith(own)}


def graph() -> dict[str, set[str]]:
    return {m: imports(m) for m in MODULES}


def package_of(module: str) -> str:
    """``selfplay.generate.rollout`` -> ``generate``; the root package is ``selfplay``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "selfplay"


def package_graph() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, targets in graph().items():
        unit = package_of(module)
        out.setdefault(unit, set()).update(
            t for t in map(package_of, targets) if t not in (unit, "selfplay")
        )
    out.pop("selfplay", None)  # the root holds only __version__
    return out


def layers(g: dict[str, set[str]]) -> list[list[str]]:
    """Nodes by layer: layer 0 imports nothing of the package, layer k only layers below k."""
    sorter = TopologicalSorter(g)
    sorter.prepare()  # raises CycleError naming a cycle
    out = []
    while sorter.is_active():
        ready = sorted(sorter.get_ready())
        out.append(ready)
        sorter.done(*ready)
    return out


def test_the_module_graph_has_no_cycles():
    try:
        found = layers(graph())
    except CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None
    assert sum(map(len, found)) == len(MODULES)


def test_the_package_graph_has_no_cycles():
    try:
        layers(package_graph())
    except CycleError as e:
        raise AssertionError(f"package cycle: {' -> '.join(e.args[1])}") from None


def test_every_package_imports_only_lower_floors():
    floor = {name: i for i, names in enumerate(FLOORS) for name in names}
    g = package_graph()
    unplaced = sorted(set(g) - set(floor))
    assert not unplaced, f"place these packages on a floor of FLOORS: {unplaced}"
    upward = sorted(
        f"{a} (floor {floor[a]}) -> {b} (floor {floor[b]})"
        for a, targets in g.items()
        for b in targets
        if floor[b] >= floor[a]
    )
    assert not upward, "arrows that do not point down:\n" + "\n".join(upward)


def test_self_contained_packages_import_only_their_layer():
    g = graph()
    for package, allowed in ALLOWED.items():
        for module, targets in g.items():
            if module == package or module.startswith(package + "."):
                outside = {t for t in targets if not t.startswith(package) and t != "selfplay"}
                bad = outside - allowed  # (the root package holds only __version__)
                assert not bad, f"{module} imports {sorted(bad)}"


def test_the_graph_sees_every_kind_of_import():
    """The checks above would pass vacuously if lazy or type-only imports were missed."""
    assert "selfplay.train" in imports("selfplay.iterate.stages")  # inside a function
    type_only = "if TYPE_CHECKING:\n    from selfplay.seats import Player\n"
    assert source_imports(type_only) == {"selfplay.seats"}
    assert "selfplay.seats" in imports("selfplay.game.api")  # Player: the seat floor, not players/
    assert not any(m.startswith("selfplay.game.") for m in imports("selfplay.models"))


if __name__ == "__main__":
    for title, g in (("packages", package_graph()), ("modules", graph())):
        print(f"{title}:")
        for i, layer in enumerate(layers(g)):
            print(f"  layer {i}:")
            for node in layer:
                targets = ", ".join(sorted(t.removeprefix("selfplay.") for t in g[node]))
                print(f"    {node.removeprefix('selfplay.') or 'selfplay'} <- {targets or '-'}")
    sys.exit(0)
