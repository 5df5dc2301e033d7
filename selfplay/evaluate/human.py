"""The human reference row: a game's recorded human games (``DialogueGame.human``), or their stored
mean when the file is not found."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from selfplay.evaluate.config import EvalError, EvalRow
from selfplay.game.api import DialogueGame
from selfplay.metrics import mean_ci

HUMAN_DATA_ENV = "SELFPLAY_HUMAN_DATA"


def human_reference(game: DialogueGame, path: str | Path | None = None) -> EvalRow | None:
    """The human row of ``game`` (None when it has no human games): computed from its recorded
    human games when found, else their stored mean.

    ``path`` None: $SELFPLAY_HUMAN_DATA, else the game's default (matching: DialOp's
    optimization.jsonl, shipped in selfplay/game/matching/data). The row is named with the size
    of the tables the humans played (``humans (8x8)``): it compares with results of that size
    only (``comparable``).
    """
    human = game.human
    if human is None:
        return None
    file = Path(path or os.environ.get(HUMAN_DATA_ENV) or human.default_path)
    base = {"name": human_label(game), "kind": "human", "seat0": "human", "seat1": "human"}
    if not file.is_file():
        return EvalRow(
            **base,
            games=human.reference_games,
            reward_mean=human.reference,
            agreement_rate=1.0,
            source=f"stored constant {game.name}.human.reference: {human.source}; "
            f"{file} was not found",
        )
    games = human.outcomes(file)
    if not games:
        raise EvalError(f"{file} holds no human games; point --human-data at the game's file")
    rewards = [g.reward for g in games]
    kinds = [[game.classify_question(m) for m in g.messages] for g in games]
    direct = [k.count("direct") for k in kinds]
    general = [k.count("general") for k in kinds]
    mean, lo, hi = mean_ci(rewards)
    return EvalRow(
        **base,
        games=len(games),
        reward_mean=mean,
        reward_ci_low=lo,
        reward_ci_high=hi,
        reward_std=float(np.std(rewards, ddof=1)),
        agreement_rate=float(np.mean([g.agreed for g in games])),
        mean_actions=float(np.mean([g.actions for g in games])),
        mean_words=float(np.mean([sum(len(m.split()) for m in g.messages) for g in games])),
        questions_per_game=float(np.mean(direct) + np.mean(general)),
        direct_questions_per_game=float(np.mean(direct)),
        general_questions_per_game=float(np.mean(general)),
        optimal_rate=float(np.mean([r >= 1.0 for r in rewards])),
        source=f"computed from {len(games)} human games in {file} ({human.source}); "
        "actions count messages, proposals and responses",
    )


def human_label(game: DialogueGame) -> str:
    """The human row's name, with the size of the tables they played: ``humans (8x8)``."""
    n = game.human.table_size if game.human is not None else 0
    return f"humans ({n}x{n})"


def comparable(game: DialogueGame, table_size: int) -> bool:
    """Whether the game's human games were played on tables of this size (their row is shown
    beside results of that size only)."""
    return game.human is not None and game.human.table_size == table_size
