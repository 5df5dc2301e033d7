"""The game interface: what the rest of selfplay may assume about a two-seat dialogue game.

A game is an object satisfying ``DialogueGame``; the matching game is
``selfplay.game.matching.MATCHING`` and ``selfplay.game.get_game(name)`` looks games up by name.
``selfplay.game.conformance.check_game(game)`` checks a game against the contract below; every
game must pass it.

Contract (one line each):

- Scenarios are values drawn deterministically from ``(seed, size)``: the same pair gives an
  equal scenario, different seeds give different ones; each has a string ``id``. They are
  instances of ``scenario_type``, a pydantic model: a game record stores the scenario as its JSON
  (``model_dump(mode="json")``) and reads it back with ``scenario_type.model_validate``, equal.
- ``new_game`` builds fresh ``Rules`` (no randomness inside) and raises ``ValueError`` for limits
  below 1. A new game is not done and seat 0 or 1 is to move.
- ``Rules.step(seat, text)`` never raises on bad text: an invalid action is reported to the acting
  seat only, keeps the turn, and ``max_invalid`` of them in a row end the game with
  ``Outcome.INVALID``; a valid action is shown to the partner. After ``max_actions`` actions the
  game is over. A step by the seat not to move, or after the end, raises ``GameOverError``.
- ``done`` is ``outcome is not None``. ``reward`` is in [0, 1]; without agreement (any outcome but
  ``ACCEPTED``) score and reward are 0; with agreement reward is 0 exactly when score is 0.
  ``Outcome.ERROR`` is set only from outside the rules, by ``fail``.
- ``intro(scenario, seat)`` is the first text a seat is shown: deterministic, different per seat.
- ``scripted(name, scenario, seat, seed=...)`` builds a fixed-policy player for each name in
  ``scripted_names``; any two of them finish a game within ``max_actions``.
- ``classify_question(text, scenario)`` labels a message ``direct`` (asks about a specific item
  of the scenario), ``general`` (any other question) or ``none``; ``direct_question(scenario)`` is
  one obvious direct question, for checks and documentation.
- ``baselines`` (eval's default scripted rows) and ``heldout_baselines`` (iterate's held-out
  rows) name scripted players of the game; ``partner_persona`` is the system prompt of an API
  model playing the partner who only answers direct questions (None: the game has none);
  ``human`` is the game's recorded human games (None: it has none), for the human reference row
  and ``selfplay sft --human-data``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

from selfplay.seats import Player

# The default limits of a game, declared once: every config, player and check takes these.
MAX_ACTIONS = 30  # actions per game; a game that reaches it ends unagreed (Outcome.MAX_ACTIONS)
MAX_INVALID = 3  # consecutive invalid actions of one seat that end a game (Outcome.INVALID)
TABLE_SIZE = 8  # the table a game is played at unless one is given (matching's largest, 8x8)

QuestionKind = Literal["direct", "general", "none"]
QUESTION_KINDS: tuple[QuestionKind, ...] = ("direct", "general", "none")


class Outcome(StrEnum):
    ACCEPTED = "accepted"  # the seats agreed: shared reward in [0, 1] (matching: score / best)
    MAX_ACTIONS = "max_actions"  # action budget spent without agreement: reward 0
    INVALID = "invalid"  # too many consecutive invalid actions by one seat: reward 0
    NO_DEAL = "no_deal"  # the game's last allowed proposal was rejected: reward 0
    ERROR = "error"  # a player or engine failed (set by the runner, never by the rules): reward 0


class GameOverError(RuntimeError):
    """step() was called on a finished game or by the seat whose turn it is not (a caller bug)."""


class GameScenario(Protocol):
    """What every scenario offers; the rest is the game's own business."""

    @property
    def id(self) -> str: ...


S = TypeVar("S", bound=GameScenario)  # one game's scenario type


class GameAction(Protocol):
    """One attempted action as it goes into the game record."""

    @property
    def seat(self) -> int: ...
    @property
    def text(self) -> str: ...
    @property
    def kind(self) -> str: ...  # the game's action kinds, or "invalid"
    @property
    def valid(self) -> bool: ...
    @property
    def error(self) -> str | None: ...  # why an invalid action is invalid
    @property
    def proposal(self) -> list[tuple[int, int]] | None: ...  # a parsed proposal, if any


class GameStep(Protocol):
    """What each seat observes after one step, as text lines, and whether the game ended."""

    @property
    def observations(self) -> tuple[list[str], list[str]]: ...
    @property
    def done(self) -> bool: ...
    @property
    def outcome(self) -> Outcome | None: ...
    @property
    def action(self) -> GameAction: ...


class Rules(Protocol, Generic[S]):
    """The state of one game on one scenario and its turn-taking rules."""

    @property
    def scenario(self) -> S: ...
    @property
    def turn(self) -> int: ...
    @property
    def done(self) -> bool: ...
    @property
    def outcome(self) -> Outcome | None: ...
    @property
    def score(self) -> int: ...
    @property
    def reward(self) -> float: ...
    @property
    def actions(self) -> Sequence[GameAction]: ...

    def step(self, seat: int, text: str) -> GameStep: ...

    def fail(self, reason: Outcome = Outcome.ERROR) -> None:
        """End the game from outside the rules (a player failed): reward 0."""
        ...


class DialogueGame(Protocol, Generic[S]):
    """A two-seat cooperative dialogue game; see the module docstring for the contract."""

    name: str
    min_size: int
    max_size: int
    scenario_type: type[S]  # a pydantic model; records store scenarios as its JSON

    def new_scenario(self, seed: int, size: int) -> S: ...

    def new_game(
        self, scenario: S, *, max_actions: int = MAX_ACTIONS, max_invalid: int = MAX_INVALID
    ) -> Rules[S]: ...

    def intro(self, scenario: S, seat: int) -> str: ...

    @property
    def scripted_names(self) -> tuple[str, ...]: ...

    def scripted(self, name: str, scenario: S, seat: int, *, seed: int = 0) -> Player: ...

    def classify_question(self, text: str, scenario: S | None = None) -> QuestionKind:
        """None: judge the text against everything any scenario of the game can name."""
        ...

    def direct_question(self, scenario: S) -> str: ...

    def check_statements(self, text: str, scenario: S, seat: int) -> tuple[int, int]:
        """(stated, true): how many values of the speaker's own view a message states, and how
        many of them match that view (does a model read its table?); (0, 0) where it states none."""
        ...

    baselines: tuple[str, ...]  # eval's scripted rows when none are named
    heldout_baselines: tuple[str, ...]  # iterate's held-out scripted rows
    partner_persona: str | None  # the API partner's system prompt; None: no API partner
    human: HumanData | None  # the recorded human games; None: the game has none


@dataclass(frozen=True)
class HumanOutcome:
    """One recorded human game, as the human reference row counts it."""

    reward: float  # normalised like the game's own reward
    actions: int
    messages: tuple[str, ...]  # the players' messages, in order
    agreed: bool


@dataclass(frozen=True)
class HumanGame:
    """One recorded human game replayed through the game's rules: its scenario and the turns each
    seat plays (a replay that stops early says why in ``stopped``)."""

    scenario: Any
    turns: tuple[tuple[int, str], ...]  # (seat, text) in playing order
    stopped: str | None
    dropped_messages: int  # logged messages the rendering policy could not keep


class HumanData(Protocol):
    """A game's recorded human games: read for the human reference row (``outcomes``) and replayed
    as behaviour-cloning rows (``replays``)."""

    default_path: Path  # where they are looked for when no path is given (shipped with the game)
    table_size: int  # the size of the tables they were played on: comparable with that size only
    reference: float  # their mean reward, stored for when the file is missing
    reference_games: int  # how many games that mean is over
    source: str  # what the reference is, with its citation

    def outcomes(self, path: Path) -> list[HumanOutcome]: ...

    def replays(self, path: Path) -> Iterator[HumanGame]: ...
