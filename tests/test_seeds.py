"""`selfplay iterate --seeds` and `--test-scenarios`: one run per training seed, the test split
played once at the end of each, and the report over the seeds (real verl trainer, tiny model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from selfplay.records import iter_game_records
from selfplay.seeds import heldout_scenario_seed

pytestmark = pytest.mark.slow

PUBLISH = Path(__file__).resolve().parents[1] / "scripts" / "publish_run.py"


def _cmd(root, model, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "selfplay", "iterate", "--name", "multi",
        "--data-root", str(root / "data"), "--checkpoint-root", str(root / "checkpoints"),
        "--model", str(model), "--iterations", "1", "--games-per-iter", "8",
        "--games-per-scenario", "4", "--table-size", "3",
        "--max-new-tokens", "32", "--max-actions", "8", "--lr", "1e-4", "--temperature", "1.0",
        "--micro-batch-size", "4", "--eval-scenarios", "2", "--test-scenarios", "3",
        "--old-log-probs", "rollout", *extra,
    ]  # fmt: skip


def test_seeds_run_one_after_another_each_with_its_test_split_and_a_report_over_them(
    primed_model, tmp_path
):
    """Two seeds: data/multi/seed-0 and seed-1, each a run with its own seed and checkpoints,
    each with test rows (initial, final, every baseline incl. proposer) whose games are the test
    split's scenarios (not the dev split's); SEEDS.md / seeds.json with a row per seed and the
    pooled differences; the report's headline is the test split with the panel; a re-run finds
    every seed done and does not play the test split again."""
    run = subprocess.run(
        _cmd(tmp_path, primed_model, "--seeds", "0,1"), capture_output=True, text=True, timeout=1500
    )
    assert run.returncode == 0, run.stderr[-3000:]
    parent = tmp_path / "data" / "multi"
    for s in (0, 1):
        run_dir = parent / f"seed-{s}"
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["config"]["seed"] == s
        assert (tmp_path / "checkpoints" / "multi" / f"seed-{s}" / "round_0").is_dir()
        test = manifest["test"]
        assert {"initial", "final", "proposer", "no-talk", "inquisitive"} <= set(test)
        games = list(iter_game_records(run_dir / "test" / "games" / "model-final.jsonl"))
        seeds = [heldout_scenario_seed("test", 7, i) for i in range(3)]
        assert sorted(g.scenario.seed for g in games) == sorted(seeds)
        assert all(g.game_id.startswith("test-") for g in games)
        dev = {g.scenario.seed for g in iter_game_records(next(run_dir.glob("**/eval/**/*.jsonl")))}
        assert not dev & set(seeds)
        report = (run_dir / "REPORT.md").read_text()
        assert report.index("## Test split (the headline)") < report.index("(dev split)")
        assert "What the model learned (test split)" in report and "plays like it" in report
    data = json.loads((parent / "seeds.json").read_text())
    assert data["split"] == "test" and [r["seed"] for r in data["seeds"]] == [0, 1]
    assert set(data["pooled"]) == {"start", "proposer"}
    assert data["pooled"]["start"]["scenarios"] == 3
    assert "| 0 |" in (parent / "SEEDS.md").read_text()
    published = subprocess.run(
        [sys.executable, str(PUBLISH), str(parent), str(tmp_path / "docs" / "multi")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert published.returncode == 0, published.stderr[-2000:]
    for s in (0, 1):
        test = tmp_path / "docs" / "multi" / f"seed-{s}" / "test"
        assert {p.name for p in test.iterdir()} >= {
            "initial.jsonl.gz", "final.jsonl.gz", "proposer.jsonl.gz"
        }  # fmt: skip
    assert (tmp_path / "docs" / "multi" / "SEEDS.md").is_file()
    stamp = (parent / "seed-0" / "test" / "games" / "model-final.jsonl").stat().st_mtime_ns
    again = subprocess.run(
        _cmd(tmp_path, primed_model, "--seeds", "0,1"), capture_output=True, text=True, timeout=900
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (parent / "seed-0" / "test" / "games" / "model-final.jsonl").stat().st_mtime_ns == stamp


def test_bad_seeds_are_refused_before_anything_runs(tmp_path, primed_model):
    for bad in ("0,0", "a,b", "-1"):
        res = subprocess.run(
            _cmd(tmp_path, primed_model, "--seeds", bad), capture_output=True, text=True
        )
        assert res.returncode != 0 and "--seeds" in res.stderr + res.stdout
        assert not (tmp_path / "data" / "multi").exists()
