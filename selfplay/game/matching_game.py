"""The DialOp matching game behind the ``DialogueGame`` interface: ``MATCHING``.

A thin adapter: every member delegates to the rules in ``matching``, ``protocol``, ``prompts`` and
``questions`` and to the scripted players in ``selfplay.players.scripted``. Those players import
this package, so they are imported when first asked for, not at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from selfplay.game import prompts, questions
from selfplay.game.api import QuestionKind
from selfplay.game.matching import MAX_N, MIN_N, PAPERS_SHORT, REVIEWERS, Scenario
from selfplay.game.matching import generate_scenario as _generate_scenario
from selfplay.game.protocol import Game

if TYPE_CHECKING:
    from selfplay.players import Player


class MatchingGame:
    """Assign n reviewers to n papers from two partial, differently scaled views (n = size)."""

    name = "matching"
    min_size = MIN_N
    max_size = MAX_N

    def new_scenario(self, seed: int, size: int) -> Scenario:
        return _generate_scenario(seed, size)

    def new_game(self, scenario: Scenario, *, max_actions: int = 30, max_invalid: int = 3) -> Game:
        return Game(scenario, max_actions=max_actions, max_invalid=max_invalid)

    def intro(self, scenario: Scenario, seat: int) -> str:
        return prompts.intro(scenario, seat)

    @property
    def scripted_names(self) -> tuple[str, ...]:
        from selfplay.players.scripted import SCRIPTED_NAMES

        return SCRIPTED_NAMES

    def scripted(self, name: str, scenario: Scenario, seat: int, *, seed: int = 0) -> Player:
        from selfplay.players.scripted import make_scripted

        return make_scripted(name, scenario, seat, seed=seed)

    def classify_question(self, text: str, scenario: Scenario | None = None) -> QuestionKind:
        return questions.classify_question(text, MAX_N if scenario is None else scenario.n)

    def direct_question(self, scenario: Scenario) -> str:
        return f"What is the score for {REVIEWERS[0]} on {PAPERS_SHORT[scenario.n - 1]}?"


MATCHING = MatchingGame()
