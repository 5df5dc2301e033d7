"""iterate's stages report progress: a line about every tenth of the games, one per update."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from selfplay.iterate import _LogProgress, _step_logger
from selfplay.runner import RunStats


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


def test_train_and_sft_updates_are_logged(caplog):
    grpo = SimpleNamespace(step=3, pg_loss=-0.0123, grad_norm=0.5, tokens_per_s=120.0)
    sft = SimpleNamespace(step=1, loss=1.25, grad_norm=2.0, tokens_per_s=90.0)
    with caplog.at_level(logging.INFO, logger="selfplay.iterate"):
        _step_logger("round_0 train")(grpo, 4)
        _step_logger("warm start")(sft, 12)
    assert [r.getMessage() for r in caplog.records] == [
        "round_0 train: update 3/4, pg_loss -0.0123, grad norm 0.500, 120 tokens/s",
        "warm start: update 1/12, loss 1.2500, grad norm 2.000, 90 tokens/s",
    ]
