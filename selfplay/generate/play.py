"""Play one game between two players on one scenario and turn it into a GameRecord.

The loop is the only place where the rules meet the players: it hands each seat what it was shown
since its last turn and feeds the seat's answer back into the rules. It knows games only through
the ``DialogueGame`` interface (``game=``). A player that raises
ends the game with outcome ``error`` (reward 0) and the message kept in the record; an
``EngineFailure`` (defined in ``selfplay.errors``, re-exported here) propagates.
"""

from __future__ import annotations

import logging
import time

from selfplay.errors import EngineFailure
from selfplay.game.api import MAX_ACTIONS, MAX_INVALID, DialogueGame, Outcome, Rules
from selfplay.players import Player
from selfplay.records import ActionRecord, GameRecord

log = logging.getLogger(__name__)

__all__ = ["EngineFailure", "build_record", "play_game"]


async def play_game(
    scenario: object,
    players: tuple[Player, Player],
    *,
    game_id: str,
    seed: int,
    round: int = 0,
    max_actions: int = MAX_ACTIONS,
    max_invalid: int = MAX_INVALID,
    game: DialogueGame,
) -> GameRecord:
    """Run one game of ``game`` on ``scenario`` (one of its scenarios) to its end and return its
    record. Engine failures propagate (EngineFailure)."""
    rules = game.new_game(scenario, max_actions=max_actions, max_invalid=max_invalid)
    shown: list[list[str]] = [[game.intro(scenario, 0)], [game.intro(scenario, 1)]]
    start = time.perf_counter()
    error: str | None = None
    while not rules.done:
        seat = rules.turn
        observation, shown[seat] = "\n\n".join(shown[seat]), []
        try:
            text = await players[seat].act(observation)
        except EngineFailure:
            raise
        except Exception as e:  # a player's own failure is a game outcome, not a crash
            log.warning("game %s: seat %d failed: %s", game_id, seat, e)
            error = f"seat {seat}: {type(e).__name__}: {e}"
            rules.fail(Outcome.ERROR)
            break
        result = rules.step(seat, text)
        for s in (0, 1):
            shown[s].extend(result.observations[s])
    return build_record(
        rules,
        players,
        game_id=game_id,
        seed=seed,
        round=round,
        error=error,
        seconds=time.perf_counter() - start,
        game=game.name,  # the record holds the registered game of that name
    )


def build_record(
    rules: Rules,
    players: tuple[Player, Player],
    *,
    game_id: str,
    seed: int,
    round: int,
    error: str | None,
    seconds: float,
    game: str,
) -> GameRecord:
    """The record of finished ``rules`` of the game called ``game`` (a name in ``GAMES``)."""
    actions = [
        ActionRecord(
            seat=a.seat, text=a.text, kind=a.kind, valid=a.valid, error=a.error, proposal=a.proposal
        )
        for a in rules.actions
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
        game=game,
        game_id=game_id,
        scenario_id=rules.scenario.id,
        round=round,
        seed=seed,
        scenario=rules.scenario,
        seats=(players[0].config, players[1].config),
        actions=actions,
        tokens=tokens,
        outcome=rules.outcome or Outcome.ERROR,
        error=error,
        score=rules.score,
        reward=rules.reward,
        counts=counts,
        timings={"seconds": seconds},
    )
