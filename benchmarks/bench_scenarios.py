"""Milliseconds per 8x8 scenario with the hardness filter, mean over 200 seeds; prints a table.

Run: .venv/bin/python benchmarks/bench_scenarios.py [--seeds 200] [--n 8]
Target (issue 2): <= 20 ms per scenario; the DialOp reference takes about 800 ms here.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from selfplay.game import generate_scenario


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()
    generate_scenario(10_000_000, args.n)  # warm caches (DP plan) outside the timing
    times, tried, passed, best = [], [], [], []
    for seed in range(args.seeds):
        t = time.perf_counter()
        s = generate_scenario(seed, args.n)
        times.append((time.perf_counter() - t) * 1000)
        tried.append(s.tables_tried)
        passed.append(s.passed_filter)
        best.append(s.best)
    table = Table(title=f"scenario generation, {args.n}x{args.n}, {args.seeds} seeds")
    for col in ("metric", "value"):
        table.add_column(col)
    table.add_row("ms per scenario (mean)", f"{np.mean(times):.2f}")
    table.add_row(
        "ms per scenario (p50 / p95)", f"{np.median(times):.2f} / {np.percentile(times, 95):.2f}"
    )
    table.add_row("tables tried per scenario (mean)", f"{np.mean(tried):.0f}")
    table.add_row("us per table tried", f"{1000 * np.sum(times) / np.sum(tried):.2f}")
    table.add_row("passed hardness filter", f"{np.mean(passed):.3f}")
    table.add_row("mean best reward", f"{np.mean(best):.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
