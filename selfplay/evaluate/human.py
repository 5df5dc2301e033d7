"""The human reference row: the 134 DialOp human games, or the stored constant."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from selfplay.evaluate.config import EvalError, EvalRow
from selfplay.game import MATCHING
from selfplay.metrics import mean_ci

HUMAN_REFERENCE = 0.921  # mean normalised reward of the 134 DialOp human games (shared/dialop-data)


HUMAN_DATA_ENV = "SELFPLAY_HUMAN_DATA"


# ../shared/dialop-data beside the repository (where tests/conftest.py finds the human games too)
DEFAULT_HUMAN_DATA = (
    Path(__file__).resolve().parents[3] / "shared" / "dialop-data" / "optimization.jsonl"
)


HUMAN_SOURCE = (
    "mean normalised reward (score / best assignment) of the 134 human games of DialOp "
    "(Lin et al., 'Decision-Oriented Dialogue for Human-AI Collaboration', "
    "dialop-data/optimization.jsonl)"
)


def human_reference(path: str | Path | None = None) -> EvalRow:
    """The human row: computed from the DialOp human games when found, else the stored constant.

    ``path`` None: $SELFPLAY_HUMAN_DATA, else ../shared/dialop-data/optimization.jsonl beside the
    repository. Reward is score / best assignment (the dataset's result.norm).
    """
    file = Path(path or os.environ.get(HUMAN_DATA_ENV) or DEFAULT_HUMAN_DATA)
    base = {"name": "human", "kind": "human", "seat1": "human", "seat2": "human"}
    if not file.is_file():
        return EvalRow(
            **base,
            games=134,
            reward_mean=HUMAN_REFERENCE,
            agreement_rate=1.0,
            source=f"stored constant selfplay.evaluate.HUMAN_REFERENCE: {HUMAN_SOURCE}; "
            f"{file} was not found",
        )
    games = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    if not games:
        raise EvalError(f"{file} holds no human games; point --human-data at optimization.jsonl")
    rewards, actions, words, agreed = [], [], [], 0
    direct, general = [], []
    for g in games:
        rewards.append(g["result"]["score"] / g["best_assignment_reward"])
        log_ = g["action_log"]
        messages = [a["message"]["data"] for a in log_ if a["type"] == "message"]
        actions.append(len(log_))
        words.append(sum(len(m.split()) for m in messages))
        kinds = [MATCHING.classify_question(m) for m in messages]  # the human games are matching
        direct.append(kinds.count("direct"))
        general.append(kinds.count("general"))
        agreed += any(a["type"] == "proposal_response" and a["response"]["accept"] for a in log_)
    mean, lo, hi = mean_ci(rewards)
    return EvalRow(
        **base,
        games=len(games),
        reward_mean=mean,
        reward_ci_low=lo,
        reward_ci_high=hi,
        reward_std=float(np.std(rewards, ddof=1)),
        agreement_rate=agreed / len(games),
        mean_actions=float(np.mean(actions)),
        mean_words=float(np.mean(words)),
        questions_per_game=float(np.mean(direct) + np.mean(general)),
        direct_questions_per_game=float(np.mean(direct)),
        general_questions_per_game=float(np.mean(general)),
        optimal_rate=float(np.mean([r >= 1.0 for r in rewards])),
        source=f"computed from {len(games)} human games in {file} ({HUMAN_SOURCE}); "
        "8x8 tables, actions count messages, proposals and responses",
    )
