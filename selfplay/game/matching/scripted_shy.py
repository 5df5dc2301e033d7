"""Scripted players that only answer (shy, shy-strict): never volunteer, answer a direct
question about one cell with their own value, judge proposals by their own view; their policies
are listed in ``scripted``."""

from __future__ import annotations

from selfplay.game.matching.questions import asked_cell, is_question
from selfplay.game.matching.rules import PAPERS_SHORT, REVIEWERS, Scenario, best_assignment
from selfplay.game.matching.scripted_base import ScriptedPlayer, assignment_value, expected_table


class Shy(ScriptedPlayer):
    name = "shy"

    def __init__(self, scenario: Scenario, seat: int, seed: int = 0, *, accept_fraction=0.8):
        super().__init__(scenario, seat, seed)
        self.accept_fraction = accept_fraction
        self.last_message: str | None = None

    def observe(self, kind: str, body: str) -> None:
        self.last_message = body if kind == "message" else None

    def answer(self, message: str) -> str:
        cell = asked_cell(message, self.n)
        if cell is not None:
            r, p = cell
            value = self.view[r][p]
            if value is None:
                return f"I don't know the score for {REVIEWERS[r]} on {PAPERS_SHORT[p]}."
            return f"{REVIEWERS[r]} on {PAPERS_SHORT[p]}: {value}."
        if is_question(message):
            return "Hard to say in general. Some of them look fine to me."
        return "Okay."

    def decide(self) -> str:
        if self.pending is not None:
            own = expected_table(self.view)
            best_value = best_assignment(own)[1]
            ok = assignment_value(own, self.pending) >= self.accept_fraction * best_value
            return "[accept]" if ok else "[reject]"
        if self.last_message:
            return "[message] " + self.answer(self.last_message)
        return "[message] Hello."


class ShyStrict(Shy):
    name = "shy-strict"

    def __init__(self, scenario: Scenario, seat: int, seed: int = 0) -> None:
        super().__init__(scenario, seat, seed, accept_fraction=0.9)
