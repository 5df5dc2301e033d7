"""A second game in one module, to show (and test) what adding a game takes: this file plus one
line in ``selfplay.game.GAMES`` (the tests patch the registry instead).

The sum game: each seat holds a secret number; they must agree on the sum of the two. Actions are
``[message] TEXT``, ``[propose] N``, and ``[accept]`` / ``[reject]`` of the partner's pending
proposal. An accepted proposal N scores ``100 - |N - sum|`` (at least 0); reward is score / 100.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from selfplay.game.api import GameOverError, Outcome, QuestionKind
from selfplay.records import SeatConfig, SeatTokens

_ACTION = re.compile(r"^\s*\[(message|propose|accept|reject)\](.*)$", re.IGNORECASE | re.DOTALL)
_NUMBER = re.compile(r"Partner: \[message\].*?number is (\d+)")


class SumScenario(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    size: int
    secrets: tuple[int, int]

    @property
    def total(self) -> int:
        return sum(self.secrets)


@dataclass(frozen=True)
class SumAction:
    seat: int
    text: str
    kind: str
    valid: bool
    error: str | None = None
    proposal: list[tuple[int, int]] | None = None  # the interface's field; unused here


@dataclass(frozen=True)
class SumStep:
    observations: tuple[list[str], list[str]]
    done: bool
    outcome: Outcome | None
    action: SumAction


@dataclass
class SumRules:
    scenario: SumScenario
    max_actions: int = 30
    max_invalid: int = 3
    turn: int = 0
    outcome: Outcome | None = None
    score: int = 0
    actions: list[SumAction] = field(default_factory=list)
    pending: int | None = None  # the proposal the seat to move must answer
    invalid_run: int = 0

    def __post_init__(self) -> None:
        if self.max_actions < 1 or self.max_invalid < 1:
            raise ValueError("max_actions and max_invalid must be at least 1")

    @property
    def done(self) -> bool:
        return self.outcome is not None

    @property
    def reward(self) -> float:
        return self.score / 100 if self.outcome is Outcome.ACCEPTED else 0.0

    def step(self, seat: int, text: str) -> SumStep:
        if self.done or seat != self.turn:
            raise GameOverError(f"seat {seat} cannot move now")
        kind, error, arg = self._parse(text)
        action = SumAction(seat, text, kind if error is None else "invalid", error is None, error)
        self.actions.append(action)
        obs: tuple[list[str], list[str]] = ([], [])
        if error is not None:
            self.invalid_run += 1
            obs[seat].append(f"Error: {error}")
            if self.invalid_run >= self.max_invalid:
                self.outcome = Outcome.INVALID
        else:
            self.invalid_run = 0
            obs[1 - seat].append(f"Partner: {text.strip()}")
            if kind == "propose":
                self.pending = arg
            elif kind == "accept":
                assert self.pending is not None
                self.score = max(0, 100 - abs(self.pending - self.scenario.total))
                self.outcome = Outcome.ACCEPTED
            elif kind == "reject":
                self.pending = None
            self.turn = 1 - seat
        if not self.done and len(self.actions) >= self.max_actions:
            self.outcome = Outcome.MAX_ACTIONS
        return SumStep(obs, self.done, self.outcome, action)

    def _parse(self, text: str) -> tuple[str, str | None, int | None]:
        m = _ACTION.match(text)
        if m is None:
            return "invalid", "start with [message], [propose], [accept] or [reject]", None
        kind, rest = m.group(1).lower(), m.group(2).strip()
        if (kind in ("accept", "reject")) != (self.pending is not None):
            return kind, "answer a pending proposal with [accept] or [reject], only then", None
        if kind == "message" and not rest:
            return kind, "an empty message", None
        if kind == "propose":
            if not rest.isdigit():
                return kind, "propose a whole number: [propose] N", None
            return kind, None, int(rest)
        return kind, None, None

    def fail(self, reason: Outcome = Outcome.ERROR) -> None:
        if not self.done:
            self.outcome, self.score = reason, 0


class SumPlayer:
    """``teller``: asks and tells its number, proposes the sum once it knows it. ``guesser``:
    proposes twice its own number. Both accept any proposal."""

    def __init__(self, name: str, scenario: SumScenario, seat: int, seed: int) -> None:
        self.config = SeatConfig(kind="scripted", name=name)
        self.name, self.own = name, scenario.secrets[seat]
        self.partner: int | None = None
        self.rng = random.Random(seed)

    async def act(self, observation: str) -> str:
        if (m := _NUMBER.search(observation)) is not None:
            self.partner = int(m.group(1))
        if "Partner: [propose]" in observation.rsplit("\n", 1)[-1]:
            return "[accept]"
        if self.name == "guesser":
            return f"[propose] {2 * self.own}"
        if self.partner is not None:
            return f"[propose] {self.own + self.partner}"
        return f"[message] My number is {self.own}. What is your number?"

    def tokens(self) -> SeatTokens | None:
        return None


class SumGame:
    name = "sum"
    min_size = 1
    max_size = 5
    scenario_type = SumScenario
    scripted_names = ("teller", "guesser")
    baselines = heldout_baselines = scripted_names
    partner_persona = None  # no API partner
    human = None  # no recorded human games

    def new_scenario(self, seed: int, size: int) -> SumScenario:
        rng = random.Random(f"sum/{seed}/{size}")
        secrets = (rng.randrange(10**size), rng.randrange(10**size))
        return SumScenario(id=f"sum-{seed}-{size}", size=size, secrets=secrets)

    def new_game(self, scenario: SumScenario, *, max_actions: int = 30, max_invalid: int = 3):
        return SumRules(scenario, max_actions=max_actions, max_invalid=max_invalid)

    def intro(self, scenario: SumScenario, seat: int) -> str:
        return (
            f"You are player {seat + 1}. Your secret number is {scenario.secrets[seat]}. "
            "Agree with your partner on the sum of your two numbers."
        )

    def scripted(self, name: str, scenario: SumScenario, seat: int, *, seed: int = 0):
        if name not in self.scripted_names:
            raise ValueError(f"no scripted player {name!r}")
        return SumPlayer(name, scenario, seat, seed)

    def classify_question(self, text: str, scenario: SumScenario | None = None) -> QuestionKind:
        text = re.sub(r"^\s*\[message\]", "", text, flags=re.IGNORECASE)
        if "?" not in text:
            return "none"
        return "direct" if re.search(r"\byour (secret )?number\b", text, re.I) else "general"

    def check_statements(self, text: str, scenario: SumScenario, seat: int) -> tuple[int, int]:
        said = [int(n) for n in re.findall(r"\bmy (?:secret )?number is (\d+)", text, re.I)]
        return len(said), sum(n == scenario.secrets[seat] for n in said)

    def direct_question(self, scenario: SumScenario) -> str:
        return "What is your number?"


SUM = SumGame()
