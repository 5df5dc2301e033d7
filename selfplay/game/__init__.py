"""Dialogue games: the interface every game satisfies, and the DialOp paper-reviewer matching game.

Pure rules: no I/O, no engines, no torch. ``api.DialogueGame`` is the interface;
``conformance.check_game(game)`` is the check every game must pass; ``GAMES`` names the games
there are and ``get_game(name)`` picks one. The matching game's own names stay exported here.
"""

from typing import Annotated

from pydantic import AfterValidator, ValidationInfo

from selfplay.errors import UserError
from selfplay.game.api import DialogueGame, GameOverError, Outcome
from selfplay.game.matching import (
    MATCHING,
    MATCHING_ADVICE,
    MATCHING_ADVICE_CAP2,
    MATCHING_CAP2,
    MATCHING_GAPS,
    MATCHING_LINES,
    MATCHING_NOTES,
    MATCHING_RANKED,
    MATCHING_SHORT,
)
from selfplay.game.matching.rules import (
    PAPERS,
    PAPERS_SHORT,
    REVIEWERS,
    ProposalError,
    Scenario,
    best_assignment,
    generate_scenario,
    parse_proposal,
    scenario_from_arrays,
    score_assignment,
)
from selfplay.game.matching.turns import Action, Game, StepResult

# Adding a game: a module with its DialogueGame (see api.py) that passes check_game, one line here.
GAMES: dict[str, DialogueGame] = {
    game.name: game
    for game in (
        MATCHING,
        MATCHING_LINES,
        MATCHING_RANKED,
        MATCHING_SHORT,
        MATCHING_GAPS,
        MATCHING_NOTES,
        MATCHING_ADVICE,
        MATCHING_CAP2,
        MATCHING_ADVICE_CAP2,
    )
}
DEFAULT_GAME = MATCHING.name  # what records written before GameRecord.game (schema 1) hold


class UnknownGameError(UserError, ValueError):
    """A game name that is not in ``GAMES``; the message lists the known ones."""


def get_game(name: str) -> DialogueGame:
    """The game called ``name``; ``UnknownGameError`` naming the known games otherwise."""
    try:
        return GAMES[name]
    except KeyError:
        known = ", ".join(sorted(GAMES))
        raise UnknownGameError(f"unknown game {name!r}; known games: {known}") from None


def _known(name: str) -> str:
    get_game(name)  # UnknownGameError is a ValueError: pydantic reports it on the field
    return name


GameName = Annotated[str, AfterValidator(_known)]  # a config or record field naming a game


def game_of(info: ValidationInfo) -> DialogueGame | None:
    """In a field validator: the game named by the model's ``game`` field (declared, so validated,
    before the field at hand); None when the model has no such field or refused its value."""
    name = info.data.get("game")
    return None if name is None else GAMES.get(name)


__all__ = [
    "DEFAULT_GAME",
    "GAMES",
    "MATCHING",
    "MATCHING_ADVICE",
    "MATCHING_ADVICE_CAP2",
    "MATCHING_CAP2",
    "MATCHING_GAPS",
    "MATCHING_LINES",
    "MATCHING_NOTES",
    "MATCHING_RANKED",
    "MATCHING_SHORT",
    "PAPERS",
    "PAPERS_SHORT",
    "REVIEWERS",
    "Action",
    "DialogueGame",
    "Game",
    "GameName",
    "GameOverError",
    "Outcome",
    "ProposalError",
    "Scenario",
    "StepResult",
    "UnknownGameError",
    "best_assignment",
    "game_of",
    "generate_scenario",
    "get_game",
    "parse_proposal",
    "scenario_from_arrays",
    "score_assignment",
]
