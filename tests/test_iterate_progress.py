"""iterate's generate stage reports progress: a line about every tenth of the games (train and
the warm start log a line per optimizer update themselves)."""

from __future__ import annotations

import logging

from selfplay.generate.runner import RunStats
from selfplay.iterate.child import _LogProgress


def test_generate_progress_is_a_line_per_tenth_and_the_last(caplog):
    progress = _LogProgress("round 2 generate")
    stats = RunStats(total=37)
    with caplog.at_level(logging.INFO, logger="selfplay.iterate"):
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
    progress = _LogProgress("g")
    stats = RunStats(total=10, resumed=8)
    with caplog.at_level(logging.INFO, logger="selfplay.iterate"):
        progress.start(stats)
        for _ in range(2):
            stats.played += 1
            progress.update(stats)
        progress.stop(stats)
    assert [r.getMessage().split(",")[0] for r in caplog.records] == [
        "g: 9/10 games",
        "g: 10/10 games",
    ]
