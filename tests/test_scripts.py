"""The wrappers compatible with the original shell scripts honour their environment variables."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from selfplay.records import iter_game_records

ROOT = Path(__file__).resolve().parents[1]


def test_generation_wrapper_honours_the_original_variables(tiny_model):
    name = f"pytest-wrapper-{os.getpid()}"
    out = ROOT / "data" / name
    env = {
        **os.environ,
        "EXP_NAME": name,
        "NUM_GAMES": "2",
        "MAX_LENGTH": "2",
        "TEMPERATURE": "0.9",
        "MODEL_NAME": str(tiny_model),
    }
    try:
        res = subprocess.run(
            ["bash", "scripts/run_selfplay_generation.sh", "--table-size", "3",
             "--games-per-scenario", "2", "--max-new-tokens", "8"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr[-2000:]
        games = list(iter_game_records(out / "games.jsonl"))
        assert len(games) == 2
        assert all(g.counts["actions"] <= 2 for g in games)
        assert {g.seats[0].name for g in games} == {str(tiny_model)}
        assert {g.seats[0].sampling.temperature for g in games} == {0.9}
    finally:
        shutil.rmtree(out, ignore_errors=True)
