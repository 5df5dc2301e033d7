"""iterate's generate stage reports progress: a line about every tenth of the games (train and
the warm start log a line per optimizer update themselves)."""

from __future__ import annotations

import logging

from selfplay.generate.runner import LogProgress, RunStats


def test_generate_progress_is_a_line_per_tenth_and_the_last(caplog):
    progress = LogProgress("round 2 generate")
    stats = RunStats(total=37)
    with caplog.at_level(logging.INFO, logger="selfplay.generate"):
        progress.start(stats)
        for _ in range(37):
            stats.played += 1
            stats.reward_sum += 0.5
            progress.update(stats)
        progress.stop(stats)
    lines = [r.getMessage() for r in caplog.records]
    assert 9 <= len(lines) <= 11
    assert lines[-1].startswith("round 2 generate: 37/37 games")
    assert "reward 0.500" in lines[-1]


def test_resumed_generate_counts_from_the_kept_games(caplog):
    progress = LogProgress("g")
    stats = RunStats(total=10, resumed=8)
    with caplog.at_level(logging.INFO, logger="selfplay.generate"):
        progress.start(stats)
        for _ in range(2):
            stats.played += 1
            progress.update(stats)
        progress.stop(stats)
    assert [r.getMessage().split(",")[0] for r in caplog.records] == [
        "g: 9/10 games",
        "g: 10/10 games",
    ]


def test_generate_into_a_pipe_counts_its_games_while_they_play(tiny_model, tmp_path):
    """`selfplay generate` whose output is not a terminal (a pipe, a log file, CI) logs its
    progress about every tenth of the games, not only the table at the end."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "selfplay", "generate", "--model", str(tiny_model),
           "--out", str(tmp_path / "g"), "--num-games", "20", "--table-size", "3",
           "--max-new-tokens", "8", "--max-actions", "4"]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [x for x in res.stderr.splitlines() if "generate: " in x and "/20 games" in x]
    assert 5 <= len(lines) <= 11 and lines[-1].split("generate: ")[1].startswith("20/20 games")
