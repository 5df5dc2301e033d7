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
