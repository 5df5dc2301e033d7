"""The user's guide: README stays a front door, the docs site builds with no warning (no broken
link, no missing page), and the results page is what scripts/runs_index.py writes from the runs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail into docs/"


def test_readme_links_reach_files():
    """README is not part of the site, so mkdocs does not check its links: this does."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert targets and not missing, missing


def test_docs_build_strictly(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "s")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner about its successor
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = res.stdout + res.stderr
    assert res.returncode == 0, log
    assert "WARNING" not in log, log
    assert (tmp_path / "s" / "runs" / "index.html").is_file()


def _runs_index():
    spec = importlib.util.spec_from_file_location("runs_index", ROOT / "scripts" / "runs_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_page_is_written_from_the_runs():
    index = _runs_index()
    page = ROOT / "docs" / "runs" / "README.md"
    text = index.render()
    assert page.read_text() == text, "run: python scripts/runs_index.py"
    for run in (ROOT / "docs" / "runs").iterdir():
        if run.is_dir():
            # a run's report, or a multi-seed run's SEEDS.md (each seed's report beside it)
            linked = "SEEDS.md" if (run / "seeds.json").is_file() else "REPORT.md"
            assert f"| [{run.name}]({run.name}/{linked}) |" in text, run.name


def test_results_page_recomputes_the_paired_difference():
    """ask-advice's headline, from its published held-out games, as the audit recomputed it."""
    index = _runs_index()
    diff, n = index.paired_difference(ROOT / "docs" / "runs" / "ask-advice")
    assert (diff, n) == ("+0.096 [+0.038, +0.153]", "96")
