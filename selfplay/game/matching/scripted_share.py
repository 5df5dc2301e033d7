"""Scripted players that state their values (cooperative, explainer) and the two that never
talk (no-talk, random); their policies are listed in ``scripted``."""

from __future__ import annotations

import numpy as np

from selfplay.game.matching.rules import Pairs, Scenario, best_assignment, estimate_table
from selfplay.game.matching.scripted_base import (
    PICKS,
    ScriptedPlayer,
    assignment_value,
    expected_table,
    format_picks,
    format_values,
    greedy_picks,
    parse_picks,
    parse_values,
)


class Cooperative(ScriptedPlayer):
    name = "cooperative"

    def __init__(
        self,
        scenario: Scenario,
        seat: int,
        seed: int = 0,
        *,
        accept_fraction: float = 0.9,
        rows_per_message: int = 8,
        ranked: bool = False,
    ) -> None:
        super().__init__(scenario, seat, seed)
        self.accept_fraction = accept_fraction
        self.ranked = ranked  # its values stated highest first (the matching-ranked game)
        self.rows_per_message = rows_per_message
        self.next_row = 0
        self.partner_values: dict[tuple[int, int], int] = {}
        self.partner_spoke = False
        self.rejections = 0

    def observe(self, kind: str, body: str) -> None:
        if kind == "message":
            self.partner_spoke = True
            self.partner_values.update(parse_values(body, self.n))

    def merged(self) -> np.ndarray:
        """Own view plus the partner's values converted to this seat's scale."""
        return estimate_table(self.view, self.partner_values)

    def decide(self) -> str:
        # a pending proposal must be answered first (the rules allow nothing else), even before
        # this seat has shared its values: it is judged on what the seat knows so far
        if self.next_row < self.n and self.pending is None:
            rows = range(self.next_row, min(self.n, self.next_row + self.rows_per_message))
            self.next_row = rows.stop
            text = format_values(self.view, rows, ranked=self.ranked)
            head = "My known scores, highest first: " if self.ranked else "My known scores: "
            return "[message] " + (head + text if text else "I know no scores here.")
        estimate = self.merged()
        best, best_value = best_assignment(estimate)
        if self.pending is not None:
            # Scale-ratio estimates differ between the seats, so two honest players can disagree
            # forever; each rejection lowers the bar by 0.1 (never below 0.5) to settle.
            bar = max(0.5, self.accept_fraction - 0.1 * self.rejections)
            if assignment_value(estimate, self.pending) >= bar * best_value:
                return "[accept]"
            self.rejections += 1
            return "[reject]"
        if not self.partner_spoke:
            return "[message] Please share the scores you know."
        return self.propose(best)


class NoTalk(ScriptedPlayer):
    name = "no-talk"

    def decide(self) -> str:
        if self.pending is not None:
            return "[accept]"
        return self.propose(best_assignment(expected_table(self.view))[0])


class RandomPlayer(ScriptedPlayer):
    name = "random"

    def decide(self) -> str:
        if self.pending is not None:
            return "[accept]" if self.rng.random() < 0.5 else "[reject]"
        perm = self.rng.permutation(self.n)
        return self.propose([(int(r), p) for p, r in enumerate(perm)])


class Explainer(Cooperative):
    name = "explainer"

    def __init__(self, scenario: Scenario, seat: int, seed: int = 0, **kw) -> None:
        super().__init__(scenario, seat, seed, **kw)
        self.stated: dict[tuple[int, int], int] = {}  # the partner's values, as stated
        self.suggested: Pairs | None = None  # the partner's picks
        self.picked = False

    def observe(self, kind: str, body: str) -> None:
        super().observe(kind, body)
        if kind == "message":
            self.stated.update(parse_values(body.split(PICKS, 1)[0], self.n))
            self.suggested = parse_picks(body, self.n) or self.suggested

    def greedy(self) -> list[tuple[int, int, int | None]]:
        return greedy_picks(self.view, self.stated)

    def decide(self) -> str:
        steps = self.greedy()
        mine = sorted((r, p) for r, p, _ in steps)
        if self.pending is not None and sorted(self.pending) == mine:
            return "[accept]"
        if self.pending is not None or self.next_row < self.n or not self.partner_spoke:
            return super().decide()  # answer, share values, or ask for the partner's
        if self.suggested is not None:
            return self.propose(self.suggested)
        if not self.picked:
            self.picked = True
            return "[message] " + format_picks(steps)
        return self.propose(mine)
