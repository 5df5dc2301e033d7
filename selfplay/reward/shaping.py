"""A row's reward: the game's task reward, the invalid-action penalty, then the named shaping.

``row_reward(game, seat, invalid_penalty=..., shaping=...)`` is the one function both convert
readers (the fast JSON one and the typed one) call, from a ``GameResult``: the few fields of a
finished game the reward reads, which each reader takes from its own form of the record
(``GameResult.of_json`` and ``GameResult.of_record`` read them the same way).

A shaping is one function ``(game, seat, reward) -> reward`` and one registration::

    @shaping("brevity")
    def brevity(game: GameResult, seat: int, reward: float) -> float:
        \"\"\"A hundredth off for every action the game took.\"\"\"
        return reward - 0.01 * game.actions

after which ``--reward-shaping brevity`` (the ``reward_shaping`` option of convert and iterate)
applies it to every row. ``none``, the default, leaves the reward as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = [
    "SHAPINGS",
    "GameResult",
    "Shaping",
    "check_shaping",
    "row_reward",
    "shaping",
]


class GameResult(NamedTuple):
    """What a row's reward reads of a finished game."""

    reward: float  # the task reward the game's rules gave (GameRecord.reward), shared by the seats
    outcome: str  # GameRecord.outcome: accepted, max_actions, invalid, error
    last_seat: int | None  # the seat of the game's last action (None: no action, or not a seat)
    actions: int = 0  # how many actions the game took

    @property
    def offender(self) -> int | None:
        """The seat whose consecutive invalid actions ended a game with outcome "invalid": the
        seat of its last action (None for any other outcome)."""
        return self.last_seat if self.outcome == "invalid" else None

    @classmethod
    def of_json(cls, obj: dict, reward: float) -> GameResult:
        """From a record as orjson parsed it (``reward`` already checked finite)."""
        actions = obj.get("actions")
        actions = actions if isinstance(actions, list) else []
        last = actions[-1].get("seat") if actions and isinstance(actions[-1], dict) else None
        return cls(reward, str(obj.get("outcome")), _seat(last), len(actions))

    @classmethod
    def of_record(cls, record: Any, reward: float) -> GameResult:
        """From a ``GameRecord`` (``reward`` already checked finite)."""
        last = record.actions[-1].seat if record.actions else None
        return cls(reward, str(record.outcome), _seat(last), len(record.actions))


def _seat(value: Any) -> int | None:
    return value if value in (0, 1) and not isinstance(value, bool) else None


Shaping = Callable[[GameResult, int, float], float]
SHAPINGS: dict[str, Shaping] = {}


def shaping(name: str) -> Callable[[Shaping], Shaping]:
    """Register ``fn`` as the shaping ``name`` (the value of ``--reward-shaping``)."""

    def register(fn: Shaping) -> Shaping:
        if name in SHAPINGS and SHAPINGS[name] is not fn:
            raise ValueError(f"reward shaping {name!r} is already registered")
        SHAPINGS[name] = fn
        return fn

    return register


@shaping("none")
def _none(game: GameResult, seat: int, reward: float) -> float:
    """The reward as the game and the penalty made it."""
    return reward


def check_shaping(name: str) -> str:
    """``name`` if it is a registered shaping, else a ValueError that lists the known ones."""
    if name not in SHAPINGS:
        raise ValueError(
            f"unknown reward shaping {name!r}; known shapings: {', '.join(sorted(SHAPINGS))} "
            "(a new one is a function registered with selfplay.reward.shaping)"
        )
    return name


def row_reward(game: GameResult, seat: int, *, invalid_penalty: float, shaping: str) -> float:
    """The reward of ``seat``'s row: the game's shared reward, or ``-invalid_penalty`` for the
    seat whose invalid actions ended it (its partner keeps the shared reward: a per-seat format
    penalty, as in SPIRAL), then the shaping."""
    reward = game.reward
    if invalid_penalty and seat == game.offender:
        reward = -invalid_penalty
    return float(SHAPINGS[shaping](game, seat, reward))
