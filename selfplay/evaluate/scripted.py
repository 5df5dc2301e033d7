"""Scripted pairs (``selfplay eval --players``): two scripted policies on fresh scenarios."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from selfplay.evaluate.config import EvalError
from selfplay.fileio import atomic_write
from selfplay.game.api import MAX_ACTIONS, MAX_INVALID, DialogueGame
from selfplay.generate.rollout import (
    GameSpec,
    Scenarios,
    SeatFactory,
    Seating,
    play_plan,
)
from selfplay.metrics import GameSummary, summarize
from selfplay.records import GameRecord
from selfplay.seeds import heldout_scenario_seed


def play_scripted(
    game: DialogueGame,
    players: tuple[str, str],
    *,
    num_games: int,
    seed: int,
    n: int = 8,
    max_actions: int = MAX_ACTIONS,
    max_invalid: int = MAX_INVALID,
    split: str = "dev",
) -> list[GameRecord]:
    """Play ``num_games`` games of two of ``game``'s scripted policies, one fresh held-out scenario
    each.

    Game ``i`` has id ``eval-{i}`` (``test-{i}`` on the test split) and seed
    ``heldout_scenario_seed(split, seed, i)``; seat ``s`` plays with
    seed + 1 + s (the seeds these games always had, kept so that stored baselines still hold).
    """

    def seat(name: str) -> SeatFactory:
        return lambda scenario, s, gseed: game.scripted(name, scenario, s, seed=gseed + 1 + s)

    plan = []
    for i in range(num_games):
        sseed = heldout_scenario_seed(split, seed, i)
        prefix = "eval" if split == "dev" else split
        plan.append(GameSpec(i, i, sseed, 0, f"{prefix}-{i}", sseed))

    async def run() -> list[GameRecord]:
        scenarios = Scenarios(n, game=game)
        try:
            pair = Seating(seat(players[0]), seat(players[1]))
            limits = dict(max_actions=max_actions, max_invalid=max_invalid)
            return await play_plan(plan, pair, scenarios, **limits)
        finally:
            scenarios.close()

    return asyncio.run(run())


@dataclass(frozen=True)
class ScriptedPair:
    """A scripted pair's games, summarised (what ``selfplay eval --players`` prints and writes)."""

    players: tuple[str, str]
    num_games: int
    seed: int
    n: int
    max_actions: int
    summary: GameSummary
    split: str = "dev"

    def as_dict(self) -> dict:
        """The JSON ``eval --players --out`` writes: the pair, its settings and its summary."""
        settings = {"players": list(self.players), "num_games": self.num_games, "seed": self.seed}
        settings |= {"split": self.split}
        settings |= {"n": self.n, "max_actions": self.max_actions}
        return {**settings, **self.summary.model_dump(exclude={"partner"})}


def evaluate_scripted(
    game: DialogueGame,
    players: tuple[str, str],
    *,
    num_games: int,
    seed: int,
    n: int = 8,
    max_actions: int = MAX_ACTIONS,
    max_invalid: int = MAX_INVALID,
    split: str = "dev",
) -> ScriptedPair:
    """The summary (see metrics.summarize) of ``play_scripted``'s games, with the pair."""
    limits = {"max_actions": max_actions, "max_invalid": max_invalid, "split": split}
    games = play_scripted(game, players, num_games=num_games, seed=seed, n=n, **limits)
    return ScriptedPair(players, num_games, seed, n, max_actions, summarize(games), split)


def scripted_pair(text: str, names: Sequence[str]) -> tuple[str, str]:
    """``"cooperative,shy"`` -> the pair, seat 1 first; an ``EvalError`` naming ``names``."""
    pair = tuple(p.strip() for p in text.split(","))
    if len(pair) != 2 or any(n not in names for n in pair):
        raise EvalError(
            f"--players must be two of {', '.join(names)} separated by a comma, got {text!r}"
        )
    return pair[0], pair[1]


def run_scripted_pair(
    game: DialogueGame, players: str, *, out: Path | None = None, **options
) -> ScriptedPair:
    """``selfplay eval --players A,B``: the pair's games summarised (``evaluate_scripted``'s
    options), its JSON written to ``out`` when given."""
    pair = evaluate_scripted(game, scripted_pair(players, game.scripted_names), **options)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, json.dumps(pair.as_dict(), indent=2) + "\n")
    return pair


def scripted_table(pair: ScriptedPair):
    """A scripted pair's summary as a rich table (what ``selfplay eval --players`` prints)."""
    from rich.table import Table

    names, summary = pair.players, pair.summary
    title = f"{names[0]} (seat 1) + {names[1]} (seat 2), {pair.num_games} games"
    table = Table(title=f"{title}, {pair.n}x{pair.n}, {pair.split} split (eval seed {pair.seed})")
    for key in (
        "reward_mean",
        "reward_ci_low",
        "reward_ci_high",
        "agreement_rate",
        "mean_actions",
        "mean_words",
        "invalid_action_rate",
        "optimal_rate",
        "same_proposal_share",
        "stated_value_accuracy",
        "questions_per_game",
    ):
        table.add_row(key, f"{getattr(summary, key):.4f}")
    table.add_row("outcomes", json.dumps(summary.outcomes))
    return table
