"""The benchmarks run (so they cannot rot between the sessions that read their tables)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_memory_prints_rss_every_100_games_and_the_halves():
    cmd = [sys.executable, "benchmarks/bench_memory.py", "--games", "200", "--concurrency", "16"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = " ".join(res.stdout.split())
    assert "generate RSS: 200 tiny-model games, 16 in flight" in out
    assert "│ 100 │" in res.stdout.replace("  ", " ") or " 100 " in out
    assert "mean RSS, first half" in out and "ratio" in out
