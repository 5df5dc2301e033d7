"""Evaluation of scripted player pairs on fresh scenarios: one summary per pair of policies.

Scenario seeds for evaluation come from their own seed space (``eval_scenario_seed``), so an
evaluation never replays a training scenario.
"""

from __future__ import annotations

import asyncio

import numpy as np

from selfplay.game.matching import generate_scenario
from selfplay.metrics import summarize
from selfplay.play import play_game
from selfplay.players.scripted import make_scripted
from selfplay.records import GameRecord

EVAL_SPACE = 0x5E1F_E7A1  # a fixed first word of every evaluation seed sequence


def eval_scenario_seed(seed: int, index: int) -> int:
    """Scenario seed of evaluation game ``index`` under run seed ``seed`` (eval seed space)."""
    return int(np.random.SeedSequence([EVAL_SPACE, seed, index]).generate_state(1, np.uint64)[0])


def play_scripted(
    players: tuple[str, str],
    *,
    num_games: int,
    seed: int,
    n: int = 8,
    max_actions: int = 30,
    max_invalid: int = 3,
) -> list[GameRecord]:
    """Play ``num_games`` games of two scripted policies, one fresh scenario each."""

    async def run() -> list[GameRecord]:
        records = []
        for i in range(num_games):
            sseed = eval_scenario_seed(seed, i)
            scenario = generate_scenario(sseed, n)
            seats = (
                make_scripted(players[0], scenario, 0, seed=sseed + 1),
                make_scripted(players[1], scenario, 1, seed=sseed + 2),
            )
            records.append(
                await play_game(
                    scenario,
                    seats,
                    game_id=f"eval-{i}",
                    seed=sseed,
                    max_actions=max_actions,
                    max_invalid=max_invalid,
                )
            )
        return records

    return asyncio.run(run())


def evaluate_scripted(players: tuple[str, str], **kwargs) -> dict:
    """Summary (see metrics.summarize) of scripted games plus the pair that played them."""
    summary = summarize(play_scripted(players, **kwargs))
    return {"players": list(players), **kwargs, **summary}
