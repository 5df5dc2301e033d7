"""Dialogue games: the interface every game satisfies, and the DialOp paper-reviewer matching game.

Pure rules: no I/O, no engines, no torch. ``api.DialogueGame`` is the interface;
``conformance.check_game(game)`` is the check every game must pass; ``GAMES`` names the games
there are and ``get_game(name)`` picks one. This package exports the registry only: the
interface is ``selfplay.game.api``'s, the matching game's own names ``selfplay.game.matching``'s.

A name becomes a game in one place: ``GameField``, the type of every config's and record's
``game`` field, validates a name into the game object once and serialises it back to the name, so
a config sent to a child process as JSON, or stored in a manifest, reads back equal. Code past
the CLI and the configs uses ``config.game`` as the object and never looks a name up again.
"""

from typing import Annotated

from pydantic import PlainSerializer, PlainValidator, ValidationInfo, WithJsonSchema

from selfplay.errors import UserError
from selfplay.game.api import DialogueGame
from selfplay.game.matching import MATCHING, VIEWS

# Adding a game: a module with its DialogueGame (see api.py) that passes check_game, one line here.
GAMES: dict[str, DialogueGame] = {game.name: game for game in (*VIEWS,)}  # matching's views
DEFAULT_GAME = MATCHING.name  # what records written before GameRecord.game (schema 1) hold


class UnknownGameError(UserError, ValueError):
    """A game name that is not in ``GAMES``; the message lists the known ones."""


# The one plug-in door (DESIGN.md, house style 5): an installed package adds a game by declaring
# an entry point in this group, ``NAME = package.module:GAME_OBJECT``; the game is loaded the
# first time its name is asked for, checked with ``check_game`` and then registered in GAMES.
ENTRY_POINT_GROUP = "selfplay.games"


class BrokenGameError(UserError, ValueError):
    """An installed game that could not be loaded or failed ``check_game``; the message names
    the package's entry point and the property it broke."""


def _installed(name: str) -> DialogueGame | None:
    """The game an installed package declares under ``name`` (``ENTRY_POINT_GROUP``), loaded,
    checked and registered; None when no package declares one."""
    from importlib.metadata import entry_points

    from selfplay.game.conformance import ConformanceError, check_game

    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        return None
    ep = found[0]
    where = f"game {name!r} (entry point {ep.value} in group {ENTRY_POINT_GROUP})"
    try:
        game = ep.load()
    except Exception as e:  # a package's import error, whatever it is, is the package's
        raise BrokenGameError(f"{where} could not be loaded: {type(e).__name__}: {e}") from None
    if getattr(game, "name", None) != name:
        raise BrokenGameError(f"{where}: its name is {getattr(game, 'name', None)!r}, not {name!r}")
    try:
        check_game(game)
    except ConformanceError as e:
        raise BrokenGameError(f"{where} fails the game contract: {e}") from None
    GAMES[name] = game
    return game


def lookup_game(name: str) -> DialogueGame | None:
    """The game called ``name`` (a built-in one, or an installed package's), or None."""
    return GAMES.get(name) or _installed(name)


def get_game(name: str) -> DialogueGame:
    """The game called ``name``; ``UnknownGameError`` naming the known games otherwise."""
    game = lookup_game(name)
    if game is None:
        known = ", ".join(sorted(GAMES))
        raise UnknownGameError(f"unknown game {name!r}; known games: {known}")
    return game


def _resolve(value: object) -> DialogueGame:
    """A game field's validator: a name -> its game (``UnknownGameError``, a ValueError, so
    pydantic reports it on the field), a registered game -> itself (a config built from another
    config's values)."""
    if isinstance(value, str):
        return get_game(value)
    name = getattr(value, "name", None)
    if isinstance(name, str) and lookup_game(name) is value:
        return value  # type: ignore[return-value]  # registered under its name: a game
    known = ", ".join(sorted(GAMES))
    raise UnknownGameError(f"a game is named by a string ({known}), not {value!r}")


def _name(game: DialogueGame) -> str:
    return game.name


# A config or record field holding a game: given its name (or the game), holds the game, stored
# as the name (model_dump in both modes, JSON schema: a string).
GameField = Annotated[
    DialogueGame,
    PlainValidator(_resolve),
    PlainSerializer(_name, return_type=str),
    WithJsonSchema({"type": "string"}),
]


def game_of(info: ValidationInfo) -> DialogueGame | None:
    """In a field validator: the game of the model's ``game`` field (declared, so validated,
    before the field at hand); None when the model has no such field or refused its value."""
    return info.data.get("game")


__all__ = [  # the registry only
    "DEFAULT_GAME",
    "ENTRY_POINT_GROUP",
    "GAMES",
    "BrokenGameError",
    "GameField",
    "UnknownGameError",
    "game_of",
    "get_game",
    "lookup_game",
]
