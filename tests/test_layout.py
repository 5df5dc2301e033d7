"""The tree's shape (house style): no file of the package over 500 lines; a file that grows past
it does two jobs, and is two files."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "selfplay"
MAX_LINES = 500


def test_no_file_of_the_package_is_over_500_lines():
    lengths = {p: len(p.read_text().splitlines()) for p in sorted(PACKAGE.rglob("*.py"))}
    assert lengths, f"no Python files found under {PACKAGE}"
    over = [
        f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p, n in lengths.items() if n > MAX_LINES
    ]
    assert not over, f"files over {MAX_LINES} lines (split each by job):\n" + "\n".join(over)


def test_no_underscore_name_is_imported_from_another_module():
    """A leading underscore says "this file's own": a name another module imports is API and is
    named without one (``from x import _y as _z``, a local alias of a public name, is fine)."""
    import ast

    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("selfplay"):
                offenders += [
                    f"{path.relative_to(PACKAGE.parent)}: {alias.name} from {node.module}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    assert not offenders, "private names imported across files:\n" + "\n".join(offenders)
