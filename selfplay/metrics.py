"""Per-game and per-set statistics: reward with a confidence interval, agreement, length, errors.

``summarize(records)`` works on GameRecords from any stage (generate, eval, iterate) so every
table in the project reports the same numbers the same way.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator

from selfplay.game.api import Outcome
from selfplay.records import GameRecord


def mean_ci(values: Iterable[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Mean and a two-sided Student-t confidence interval (lo, hi); (nan, nan, nan) when empty."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(arr.mean())
    if arr.size == 1:
        return mean, mean, mean
    from scipy import stats  # imported here: scipy.stats costs half a second at CLI start

    sem = float(arr.std(ddof=1) / math.sqrt(arr.size))
    half = float(stats.t.ppf(0.5 + confidence / 2, arr.size - 1) * sem)
    return mean, mean - half, mean + half


NAN = math.nan


class GameSummary(BaseModel):
    """The statistics of a set of games (``summarize``): what generate prints, every eval row and
    every metrics.jsonl line carry. NaN where a statistic is undefined (no games; a constant)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    games: int = 0
    reward_mean: float = NAN
    reward_ci_low: float = NAN  # 95% Student-t interval of the mean
    reward_ci_high: float = NAN
    reward_std: float = NAN
    agreement_rate: float = NAN
    mean_actions: float = NAN
    mean_words: float = NAN  # words of valid [message] turns per game
    invalid_action_rate: float = NAN  # invalid actions / all actions
    optimal_rate: float = NAN  # accepted at reward 1 (matching: the best assignment's score)
    # of the games with a valid proposal, the share whose first one is the most common first one:
    # over distinct scenarios near 1 means a proposal that ignores the scenario (a fixed answer)
    same_proposal_share: float = NAN
    # of the values the seats' messages state about their own views, the share that match them
    # (matching: "Ava Li: BLEU 116" items against the speaker's table): does the model read it?
    stated_value_accuracy: float = NAN
    questions_per_game: float = NAN  # both seats, direct and general
    direct_questions_per_game: float = NAN  # about one item (matching: a reviewer and a paper)
    general_questions_per_game: float = NAN
    questions_per_game_seat0: float = NAN
    questions_per_game_seat1: float = NAN
    question_reward_corr: float = NAN  # Pearson r of a game's questions and its reward
    outcomes: dict[str, int] = {}
    partner: dict[str, int | float] | None = None  # generate with an API partner: its usage


def summarize(records: Iterable[GameRecord]) -> GameSummary:
    """Summary of a set of games (``GameSummary``, documented in README)."""
    summary = Summary()
    for r in records:
        summary.add(r)
    return summary.result()


class Summary:
    """``summarize`` one game at a time: a runner adds each game as it finishes, so the summary
    at the end needs no second read of the games file. Keeps a few numbers per game."""

    def __init__(self) -> None:
        self._rewards: list[float] = []
        self._actions: list[int] = []
        self._words: list[int] = []
        self._invalid: list[int] = []
        self._optimal: list[bool] = []
        self._first_proposals: Counter[str] = Counter()
        self._stated = [0, 0]  # values stated about the speaker's own view, and how many are true
        self._qcounts: list[dict[str, int]] = []
        self._outcomes: Counter[str] = Counter()

    def add(self, r: GameRecord) -> None:
        self._qcounts.append(question_counts(r))
        self._rewards.append(r.reward)
        self._actions.append(r.counts.get("actions", len(r.actions)))
        self._words.append(r.counts.get("words", 0))
        self._invalid.append(r.counts.get("invalid", sum(not a.valid for a in r.actions)))
        self._optimal.append(r.outcome == Outcome.ACCEPTED and r.reward >= 1.0)  # the best there is
        self._outcomes[str(r.outcome)] += 1
        game = r.game
        for a in r.actions:
            if a.valid and a.kind == "message":
                stated, true = game.check_statements(a.text, r.scenario, a.seat)
                self._stated[0] += stated
                self._stated[1] += true
        first = next((a.proposal for a in r.actions if a.valid and a.proposal), None)
        if first is not None:
            self._first_proposals[repr(sorted(first))] += 1

    def result(self) -> GameSummary:
        rewards, actions, outcomes = self._rewards, self._actions, self._outcomes
        n = len(rewards)
        mean, lo, hi = mean_ci(rewards)
        total_actions = sum(actions)
        return GameSummary(
            games=n,
            reward_mean=mean,
            reward_ci_low=lo,
            reward_ci_high=hi,
            reward_std=float(np.std(rewards, ddof=1)) if n > 1 else 0.0,
            agreement_rate=outcomes[Outcome.ACCEPTED.value] / n if n else math.nan,
            mean_actions=float(np.mean(actions)) if n else math.nan,
            mean_words=float(np.mean(self._words)) if n else math.nan,
            invalid_action_rate=sum(self._invalid) / total_actions if total_actions else 0.0,
            optimal_rate=float(np.mean(self._optimal)) if n else math.nan,
            same_proposal_share=_modal_share(self._first_proposals),
            stated_value_accuracy=self._stated[1] / self._stated[0] if self._stated[0] else NAN,
            **_question_summary(self._qcounts, rewards),
            outcomes=dict(outcomes),
        )


def _modal_share(counts: Counter[str]) -> float:
    total = sum(counts.values())
    return max(counts.values()) / total if total else math.nan


def question_counts(record: GameRecord) -> dict[str, int]:
    """Questions in valid [message] turns, per seat and kind: seat0_direct, seat0_general, ..."""
    counts = {f"seat{s}_{k}": 0 for s in (0, 1) for k in ("direct", "general")}
    game = record.game
    for a in record.actions:
        if a.valid and a.kind == "message":
            kind = game.classify_question(a.text, record.scenario)
            if kind != "none":
                counts[f"seat{a.seat}_{kind}"] += 1
    return counts


def questions_by_seat(record: GameRecord) -> tuple[int, int]:
    """Questions asked by each seat (direct and general)."""
    c = question_counts(record)
    return (c["seat0_direct"] + c["seat0_general"], c["seat1_direct"] + c["seat1_general"])


def _question_summary(qcounts: list[dict[str, int]], rewards: list[float]) -> dict:
    """questions_per_game (both seats), direct_/general_questions_per_game, questions_per_game_seat0
    and _seat1, and question_reward_corr (Pearson r of a game's questions and its reward; nan when
    either is constant)."""
    if not qcounts:
        keys = (
            "questions_per_game",
            "direct_questions_per_game",
            "general_questions_per_game",
            "questions_per_game_seat0",
            "questions_per_game_seat1",
            "question_reward_corr",
        )
        return dict.fromkeys(keys, math.nan)
    direct = np.array([c["seat0_direct"] + c["seat1_direct"] for c in qcounts], float)
    general = np.array([c["seat0_general"] + c["seat1_general"] for c in qcounts], float)
    total = direct + general
    seat = [
        np.array([c[f"seat{s}_direct"] + c[f"seat{s}_general"] for c in qcounts]) for s in (0, 1)
    ]
    r = np.asarray(rewards, float)
    corr = math.nan
    if len(r) > 1 and total.std() > 0 and r.std() > 0:
        corr = float(np.corrcoef(total, r)[0, 1])
    return {
        "questions_per_game": float(total.mean()),
        "direct_questions_per_game": float(direct.mean()),
        "general_questions_per_game": float(general.mean()),
        "questions_per_game_seat0": float(seat[0].mean()),
        "questions_per_game_seat1": float(seat[1].mean()),
        "question_reward_corr": corr,
    }


class HeldOut(BaseModel):
    """A model's greedy games on the run's fixed held-out scenarios (never training scenarios)."""

    model: str
    games: int
    reward_mean: float | None
    reward_ci_low: float | None
    reward_ci_high: float | None
    agreement_rate: float | None
    invalid_action_rate: float | None
    questions_per_game: float | None
    direct_questions_per_game: float | None
    general_questions_per_game: float | None
    mean_actions: float | None
    same_proposal_share: float | None = None  # (GameSummary); None in runs from before it
    stated_value_accuracy: float | None = None  # (GameSummary); None in runs from before it
    outcomes: dict[str, int] = {}
    seconds: float = 0.0
    path: str | None = None  # the evaluation's folder (games/model-model.jsonl, baselines)


class RoundMetrics(GameSummary):
    """One line of a run's metrics.jsonl: the round's training games (``GameSummary``), its
    training, stage times and memory, and the held-out results of the model it started from
    (``heldout``) and of the one it produced (``heldout_after``). Written by iterate, read by the
    report; a statistic JSON holds as null reads back as NaN."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    round: int
    model: str | None = None
    train: dict[str, Any] | None = None  # means over the round's optimizer steps, updates, rss
    convert: dict[str, Any] | None = None  # rows, groups; expert iteration's kept games; guides
    skip_reason: str | None = None
    seconds: dict[str, float] = {}  # per stage
    rss_mb: dict[str, float | None] = {}  # the loop's own and each stage's peak
    heldout: HeldOut | None = None
    heldout_after: HeldOut | None = None

    @field_validator(
        *[k for k, f in GameSummary.model_fields.items() if f.annotation is float], mode="before"
    )
    @classmethod
    def _null_is_nan(cls, v):
        return NAN if v is None else v
