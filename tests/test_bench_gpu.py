"""benchmarks/bench_gpu.py runs a whole round on the CPU with the tiny model, so that the GPU
benchmark cannot rot on machines without a GPU: every stage has a positive rate and the round
its games per hour, in the printed table and in --json; the train rows split into --steps
updates (the warm ones' MFU apart) and --profile writes the profiled stages' operator tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["generate 3x3", "generate 8x8", "convert", "train", "reload"]


def test_bench_gpu_on_cpu_prints_every_stage_and_games_per_hour(tmp_path):
    out, prof = tmp_path / "bench.json", tmp_path / "prof"
    cmd = [
        sys.executable, "benchmarks/bench_gpu.py", "--device", "cpu", "--sizes", "tiny",
        "--games", "2", "--max-new-tokens", "8", "--budget", "420", "--json", str(out),
        "--steps", "4", "--micro", "1", "--profile", str(prof),
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200"}
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["stage"]: r for r in data["rows"] if r["size"] == "tiny"}
    assert list(rows) == [*STAGES, "round"], res.stdout
    for stage in STAGES:
        assert rows[stage]["tokens_per_s"] > 0, rows[stage]
        assert rows[stage]["peak_gib"] > 0, rows[stage]
    assert rows["train"]["mfu"] > 0 and rows["convert"]["mfu"] is None
    # 4 rows in 4 updates of 1: the second is profiled, the third and fourth give the warm rate
    assert "4 update(s) of 1 rows" in rows["train"]["note"], rows["train"]["note"]
    assert rows["train"]["mfu_warm"] > 0
    assert "timed under the profiler" in rows["generate 8x8"]["note"]
    assert "decoding steps of" in rows["generate 8x8"]["note"]
    generate = (prof / "profile_tiny_generate.txt").read_text()
    assert generate.startswith("stage: wall") and "aten::" in generate, generate[:500]
    # over several updates, the second alone is traced
    train = (prof / "profile_tiny_train.txt").read_text()
    assert train.startswith("the second update: wall") and "aten::" in train, train[:500]
    assert rows["round"]["status"] == "ok" and rows["round"]["games"] == 4
    assert rows["round"]["games_per_gpu_hour"] > 0
    assert data["peak_flops"] > 0
    lines = {
        line.split("│")[2].strip(): line for line in res.stdout.splitlines() if "│ tiny" in line
    }
    for stage in STAGES:
        assert stage in lines, res.stdout
        assert float(lines[stage].split("│")[5].replace(",", "")) > 0, lines[stage]
    assert float(lines["round"].split("│")[8].replace(",", "")) > 0, lines["round"]


def test_a_size_over_its_budget_is_a_row_not_a_crash(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "benchmarks/bench_gpu.py", "--device", "cpu", "--sizes", "tiny",
        "--budget", "1", "--json", str(out),
    ]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["stage"] == "round" and "did not fit" in row["status"], row
    assert row["games_per_gpu_hour"] is None
