"""Per-game and per-set statistics: reward with a confidence interval, agreement, length, errors.

``summarize(records)`` works on GameRecords from any stage (generate, eval, iterate) so every
table in the project reports the same numbers the same way.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

import numpy as np
from scipy import stats

from selfplay.game.protocol import Outcome
from selfplay.records import GameRecord


def mean_ci(values: Iterable[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Mean and a two-sided Student-t confidence interval (lo, hi); (nan, nan, nan) when empty."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(arr.mean())
    if arr.size == 1:
        return mean, mean, mean
    sem = float(arr.std(ddof=1) / math.sqrt(arr.size))
    half = float(stats.t.ppf(0.5 + confidence / 2, arr.size - 1) * sem)
    return mean, mean - half, mean + half


def summarize(records: Iterable[GameRecord]) -> dict:
    """Summary of a set of games. Keys (documented in README):

    games, reward_mean, reward_ci_low, reward_ci_high, reward_std, agreement_rate,
    mean_actions, mean_words, invalid_action_rate, optimal_rate, questions_per_game,
    outcomes {outcome: count}.
    """
    rewards, actions, words, invalid, optimal, questions = [], [], [], [], [], []
    outcomes: Counter[str] = Counter()
    for r in records:
        questions.append(sum(questions_by_seat(r)))
        rewards.append(r.reward)
        actions.append(r.counts.get("actions", len(r.actions)))
        words.append(r.counts.get("words", 0))
        invalid.append(r.counts.get("invalid", sum(not a.valid for a in r.actions)))
        optimal.append(r.outcome == Outcome.ACCEPTED and r.score == r.scenario.best)
        outcomes[str(r.outcome)] += 1
    n = len(rewards)
    mean, lo, hi = mean_ci(rewards)
    total_actions = sum(actions)
    return {
        "games": n,
        "reward_mean": mean,
        "reward_ci_low": lo,
        "reward_ci_high": hi,
        "reward_std": float(np.std(rewards, ddof=1)) if n > 1 else 0.0,
        "agreement_rate": outcomes[Outcome.ACCEPTED.value] / n if n else math.nan,
        "mean_actions": float(np.mean(actions)) if n else math.nan,
        "mean_words": float(np.mean(words)) if n else math.nan,
        "invalid_action_rate": sum(invalid) / total_actions if total_actions else 0.0,
        "optimal_rate": float(np.mean(optimal)) if n else math.nan,
        "questions_per_game": float(np.mean(questions)) if n else math.nan,
        "outcomes": dict(outcomes),
    }


_QUESTION_WORDS = (
    "what",
    "which",
    "who",
    "whom",
    "whose",
    "how",
    "why",
    "where",
    "when",
    "do",
    "does",
    "did",
    "can",
    "could",
    "would",
    "will",
    "is",
    "are",
    "should",
    "any",
)


def is_question(text: str) -> bool:
    """A simple question detector: a '?' or a sentence opening with a question word."""
    if "?" in text:
        return True
    for sentence in text.replace("!", ".").split("."):
        words = sentence.strip().lower().split()
        if words and words[0] in _QUESTION_WORDS:
            return True
    return False


def questions_by_seat(record: GameRecord) -> tuple[int, int]:
    """Valid [message] turns that ask a question, per seat."""
    counts = [0, 0]
    for a in record.actions:
        if a.valid and a.kind == "message" and is_question(a.text.split("]", 1)[-1]):
            counts[a.seat] += 1
    return counts[0], counts[1]
