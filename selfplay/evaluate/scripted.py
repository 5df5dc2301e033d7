"""Scripted pairs (``selfplay eval --players``): two scripted policies on fresh scenarios."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from selfplay.evaluate.config import EvalError
from selfplay.game.matching.scripted import make_scripted
from selfplay.generate.rollout import (
    GameSpec,
    Scenarios,
    SeatFactory,
    Seating,
    play_plan,
)
from selfplay.metrics import summarize
from selfplay.records import GameRecord
from selfplay.seeds import eval_scenario_seed


def play_scripted(
    players: tuple[str, str],
    *,
    num_games: int,
    seed: int,
    n: int = 8,
    max_actions: int = 30,
    max_invalid: int = 3,
) -> list[GameRecord]:
    """Play ``num_games`` games of two scripted policies, one fresh held-out scenario each.

    Game ``i`` has id ``eval-{i}`` and seed ``eval_scenario_seed(seed, i)``; seat ``s`` plays with
    seed + 1 + s (the seeds these games always had, kept so that stored baselines still hold).
    """

    def seat(name: str) -> SeatFactory:
        return lambda scenario, s, gseed: make_scripted(name, scenario, s, seed=gseed + 1 + s)

    plan = []
    for i in range(num_games):
        sseed = eval_scenario_seed(seed, i)
        plan.append(GameSpec(i, i, sseed, 0, f"eval-{i}", sseed))

    async def run() -> list[GameRecord]:
        scenarios = Scenarios(n)
        try:
            pair = Seating(seat(players[0]), seat(players[1]))
            limits = dict(max_actions=max_actions, max_invalid=max_invalid)
            return await play_plan(plan, pair, scenarios, **limits)
        finally:
            scenarios.close()

    return asyncio.run(run())


def evaluate_scripted(players: tuple[str, str], **kwargs) -> dict:
    """Summary (see metrics.summarize) of scripted games plus the pair that played them."""
    summary = summarize(play_scripted(players, **kwargs))
    return {"players": list(players), **kwargs, **summary.model_dump(exclude={"partner"})}


def scripted_pair(text: str, names: Sequence[str]) -> tuple[str, str]:
    """``"cooperative,shy"`` -> the pair, seat 1 first; an ``EvalError`` naming ``names``."""
    pair = tuple(p.strip() for p in text.split(","))
    if len(pair) != 2 or any(n not in names for n in pair):
        raise EvalError(
            f"--players must be two of {', '.join(names)} separated by a comma, got {text!r}"
        )
    return pair[0], pair[1]


def scripted_table(names: tuple[str, str], num_games: int, summary: dict):
    """A scripted pair's summary as a rich table (what ``selfplay eval --players`` prints)."""
    import json

    from rich.table import Table

    table = Table(title=f"{names[0]} (seat 1) + {names[1]} (seat 2), {num_games} games")
    for key in (
        "reward_mean",
        "reward_ci_low",
        "reward_ci_high",
        "agreement_rate",
        "mean_actions",
        "mean_words",
        "invalid_action_rate",
        "optimal_rate",
        "questions_per_game",
    ):
        table.add_row(key, f"{summary[key]:.4f}")
    table.add_row("outcomes", json.dumps(summary["outcomes"]))
    return table
