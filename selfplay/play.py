"""Play one game between two players on one scenario and turn it into a GameRecord.

The loop is the only place where the rules (``Game``) meet the players: it hands each seat what it
was shown since its last turn and feeds the seat's answer back into the rules. A player that raises
ends the game with outcome ``error`` (reward 0) and the message kept in the record.
"""

from __future__ import annotations

import logging
import time

from selfplay.errors import UserError
from selfplay.game.matching import Scenario
from selfplay.game.prompts import intro
from selfplay.game.protocol import Game, Outcome
from selfplay.players import Player
from selfplay.records import ActionRecord, GameRecord

log = logging.getLogger(__name__)


class EngineFailure(UserError, RuntimeError):
    """An engine could not serve a request after its retries (dead server, timeout).

    Raised by players; fatal for the run, not just for the game, so the runner stops cleanly.
    """


async def play_game(
    scenario: Scenario,
    players: tuple[Player, Player],
    *,
    game_id: str,
    seed: int,
    round: int = 0,
    max_actions: int = 30,
    max_invalid: int = 3,
) -> GameRecord:
    """Run one game to its end and return its record. Engine failures propagate (EngineFailure)."""
    game = Game(scenario, max_actions=max_actions, max_invalid=max_invalid)
    shown: list[list[str]] = [[intro(scenario, 0)], [intro(scenario, 1)]]
    start = time.perf_counter()
    error: str | None = None
    while not game.done:
        seat = game.turn
        observation, shown[seat] = "\n\n".join(shown[seat]), []
        try:
            text = await players[seat].act(observation)
        except EngineFailure:
            raise
        except Exception as e:  # a player's own failure is a game outcome, not a crash
            log.warning("game %s: seat %d failed: %s", game_id, seat, e)
            error = f"seat {seat}: {type(e).__name__}: {e}"
            game.fail(Outcome.ERROR)
            break
        result = game.step(seat, text)
        for s in (0, 1):
            shown[s].extend(result.observations[s])
    return build_record(
        game,
        players,
        game_id=game_id,
        seed=seed,
        round=round,
        error=error,
        seconds=time.perf_counter() - start,
    )


def build_record(
    game: Game,
    players: tuple[Player, Player],
    *,
    game_id: str,
    seed: int,
    round: int,
    error: str | None,
    seconds: float,
) -> GameRecord:
    actions = [
        ActionRecord(
            seat=a.seat, text=a.text, kind=a.kind, valid=a.valid, error=a.error, proposal=a.proposal
        )
        for a in game.actions
    ]
    counts = {
        "actions": len(actions),
        "invalid": sum(not a.valid for a in actions),
        "messages": sum(a.valid and a.kind == "message" for a in actions),
        "proposals": sum(a.valid and a.kind == "propose" for a in actions),
        "words": sum(len(a.text.split()) for a in actions if a.valid and a.kind == "message"),
    }
    tokens = (players[0].tokens(), players[1].tokens())
    for s, t in enumerate(tokens):
        if t is not None:
            counts[f"tokens_seat{s}"] = len(t.token_ids)
            counts[f"generated_seat{s}"] = sum(t.mask)
    return GameRecord(
        game_id=game_id,
        scenario_id=game.scenario.id,
        round=round,
        seed=seed,
        scenario=game.scenario,
        seats=(players[0].config, players[1].config),
        actions=actions,
        tokens=tokens,
        outcome=game.outcome or Outcome.ERROR,
        error=error,
        score=game.score,
        reward=game.reward,
        counts=counts,
        timings={"seconds": seconds},
    )
