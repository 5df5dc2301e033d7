"""Scripted players that ask their partner about cells they do not know (inquisitive, asker,
late-asker, advised-asker, advised-late-asker) and their counterparts that never ask (picker,
advised, proposer); their policies are listed in ``scripted``."""

from __future__ import annotations

import re

import numpy as np

from selfplay.game.matching.prompts import unknown_cells
from selfplay.game.matching.questions import parse_answers
from selfplay.game.matching.rules import (
    PAPERS_SHORT,
    REVIEWERS,
    Pairs,
    Scenario,
    best_assignment,
    best_untried,
)
from selfplay.game.matching.scripted_base import (
    NOTHING_LEFT,
    format_picks,
    greedy_picks,
    index_of,
    parse_values,
)
from selfplay.game.matching.scripted_share import Cooperative

# a direct question about one cell, as these players ask it
QUESTION = re.compile(r"score for ([A-Za-z]+(?: [A-Za-z]+)?) on ([A-Za-z0-9-]+)\?")


class Inquisitive(Cooperative):
    """Asks about the cells that could change the best assignment, then proposes.

    Each question is worth it only if the cell could enter the best assignment: with the unknown
    cell at a high plausible value (the 90th percentile of the seat's known values) the best
    assignment must change and gain. Cells are asked in order of that gain, re-ranked after
    every answer, at most ``max_questions`` (two actions each: question and answer). Answers
    come in the partner's scale; the first question is about a cell this seat knows (its largest)
    so the ratio of the scales can be estimated, as ``Cooperative.merged`` does.
    """

    name = "inquisitive"

    def __init__(self, scenario: Scenario, seat: int, seed: int = 0, *, max_questions=None, **kw):
        super().__init__(scenario, seat, seed, **kw)
        # 30 actions per game: keep room for proposing and answering a proposal or two
        self.max_questions = max_questions if max_questions is not None else min(12, 2 * self.n)
        self.asked: set[tuple[int, int]] = set()
        self.next_row = self.n  # never volunteers its table
        self.questions: list[tuple[int, int]] = []  # the partner's, to answer in our next message
        self.proposed: Pairs | None = None
        self.rejected: list[Pairs] = []

    def observe(self, kind: str, body: str) -> None:
        if kind == "reject" and self.proposed is not None:
            self.rejected.append(self.proposed)
        if kind != "message":
            return
        self.partner_spoke = True
        self.partner_values.update(parse_answers(body, self.n))
        for name, paper in QUESTION.findall(body):
            cell = self._cell(name, paper)
            if cell is not None:
                self.questions.append(cell)

    def _cell(self, name: str, paper: str) -> tuple[int, int] | None:
        r, p = index_of(REVIEWERS[: self.n], name), index_of(PAPERS_SHORT[: self.n], paper)
        return None if r is None or p is None else (r, p)

    def _answers(self) -> str:
        """Honest answers to the partner's direct questions, in the form it parses."""
        parts = []
        for r, p in self.questions:
            value = self.view[r][p]
            cell = f"{REVIEWERS[r]} on {PAPERS_SHORT[p]}"
            parts.append(f"I don't know {cell}." if value is None else f"{cell}: {value}.")
        self.questions = []
        return " ".join(parts)

    def _calibrated(self) -> bool:
        return any(self.view[r][p] is not None for r, p in self.partner_values)

    def question(self) -> tuple[int, int] | None:
        """The next cell to ask about, or None when nothing worth asking is left."""
        if len(self.asked) >= self.max_questions:
            return None
        own = [(r, p) for r in range(self.n) for p in range(self.n) if self.view[r][p] is not None]
        if own and not self._calibrated() and len(self.asked) < 3:
            # a cell both may know, to relate the partner's numbers to ours: the largest first
            order = sorted(own, key=lambda c: -self.view[c[0]][c[1]])
            tries = [c for c in order if c not in self.asked]
            if tries:
                return tries[0]
        estimate = self.merged()
        known = np.array([v for row in self.view for v in row if v is not None], dtype=float)
        high = float(np.percentile(known, 90)) if known.size else float(np.nanmax(estimate))
        base = best_assignment(estimate)[1]
        best_gain, best_cell = 0.0, None
        for r in range(self.n):
            for p in range(self.n):
                cell = (r, p)
                if self.view[r][p] is not None or cell in self.partner_values or cell in self.asked:
                    continue
                trial = estimate.copy()
                trial[r, p] = max(high, trial[r, p])
                pairs, value = best_assignment(trial)
                if cell in pairs and value - base > best_gain:
                    best_gain, best_cell = value - base, cell
        return best_cell

    def best_untried(self, estimate: np.ndarray) -> Pairs | None:
        """The best assignment the partner has not rejected (``rules.best_untried``); None once
        it rejected every one."""
        return best_untried(estimate, self.rejected)

    def propose_untried(self, estimate: np.ndarray) -> str:
        """Propose the best assignment not yet rejected; once every one was rejected, say so
        instead of proposing a rejected one again."""
        self.proposed = self.best_untried(estimate)
        if self.proposed is None:
            return "[message] " + NOTHING_LEFT
        return self.propose(self.proposed)

    def decide(self) -> str:
        if self.pending is not None:
            return super().decide()
        answers = self._answers()
        cell = self.question()
        if cell is not None:
            self.asked.add(cell)
            r, p = cell
            ask = f"What is the score for {REVIEWERS[r]} on {PAPERS_SHORT[p]}?"
            return f"[message] {answers} {ask}".replace("  ", " ").replace("] ", "] ", 1)
        if answers:
            return f"[message] {answers}"
        return self.conclude()

    def conclude(self) -> str:
        """The move once nothing is left to ask or answer: the best assignment not yet rejected."""
        return self.propose_untried(self.merged())


class Asker(Inquisitive):
    name = "asker"

    def __init__(self, scenario: Scenario, seat: int, seed: int = 0, *, max_questions=None, **kw):
        limit = 2 * (scenario.n - 1) if max_questions is None else max_questions
        super().__init__(scenario, seat, seed, max_questions=limit, **kw)
        self.picked = False

    def question(self) -> tuple[int, int] | None:
        """The next cell this seat does not know and has not asked about, in table order (the
        order matching-gaps lists them in)."""
        if len(self.asked) >= self.max_questions:
            return None
        left = (c for c in unknown_cells(self.view) if c not in self.asked)
        return next((c for c in left if c not in self.partner_values), None)

    def conclude(self) -> str:
        """Say the picks over its values and the answers once, then propose them (after a
        rejection, the best assignment not yet rejected)."""
        steps = greedy_picks(self.view, self.partner_values)
        if not self.picked:
            self.picked = True
            return "[message] " + format_picks(steps)
        picks = sorted((r, p) for r, p, _ in steps)
        if picks in self.rejected:
            return self.propose_untried(self.merged())
        self.proposed = picks
        return self.propose(picks)


class Picker(Asker):
    name = "picker"

    def __init__(self, scenario: Scenario, seat: int, seed: int = 0, **kw) -> None:
        super().__init__(scenario, seat, seed, max_questions=0, **kw)


class LateAsker(Asker):
    name = "late-asker"

    def __init__(self, scenario: Scenario, seat: int, seed: int = 0, **kw) -> None:
        super().__init__(scenario, seat, seed, **kw)
        self.picked_over: frozenset | None = None  # the answers its last picks were said over

    def question(self) -> tuple[int, int] | None:
        """None until a proposal of its own was rejected; then ``asker``'s questions."""
        return super().question() if self.rejected else None

    def conclude(self) -> str:
        """Say the picks over its values and the answers so far whenever the answers changed
        them into an assignment not yet rejected, then propose them; otherwise propose the best
        assignment not yet rejected (no picks message that the proposal would not copy)."""
        steps = greedy_picks(self.view, self.partner_values)
        picks = sorted((r, p) for r, p, _ in steps)
        if picks in self.rejected:
            return self.propose_untried(self.merged())
        answered = frozenset(self.partner_values)
        if self.picked_over != answered:
            self.picked_over = answered
            return "[message] " + format_picks(steps)
        self.proposed = picks
        return self.propose(picks)


class Advised(Inquisitive):
    """Never asks: proposes the best assignment by what it knows that the partner has not
    rejected (``Inquisitive.conclude``): exactly the proposal matching-advice shows the seat
    (``prompts.view_advice``), so that cloning it is copying the advice."""

    name = "advised"

    def __init__(self, scenario: Scenario, seat: int, seed: int = 0, **kw) -> None:
        super().__init__(scenario, seat, seed, max_questions=0, **kw)


class AdvisedAsker(Inquisitive):
    """``asker``'s questions (the unknown cells in table order, at most 2(n-1)), then the advice:
    the best assignment by its values and the answers that is not yet rejected."""

    name = "advised-asker"
    question = Asker.question

    def __init__(self, scenario: Scenario, seat: int, seed: int = 0, **kw) -> None:
        super().__init__(scenario, seat, seed, max_questions=2 * (scenario.n - 1), **kw)


class AdvisedLateAsker(AdvisedAsker):
    """``advised`` until its first proposal is rejected, then ``advised-asker``."""

    name = "advised-late-asker"

    def question(self) -> tuple[int, int] | None:
        return AdvisedAsker.question(self) if self.rejected else None


class Proposer(Inquisitive):
    """The strongest simple policy that never asks: proposes the best assignment by its own
    estimate (its known values, anything the partner states or answers converted to its scale,
    the mean elsewhere) that the partner has not rejected, so its proposals run down its
    estimate's ranking without a repeat; judges proposals like ``cooperative``; never asks,
    never answers, never shares its table. Once every assignment was rejected it says so."""

    name = "proposer"

    def __init__(self, scenario: Scenario, seat: int, seed: int = 0, **kw) -> None:
        super().__init__(scenario, seat, seed, max_questions=0, **kw)

    def observe(self, kind: str, body: str) -> None:
        super().observe(kind, body)
        if kind == "message":  # values a cooperative partner volunteers count too
            self.partner_values.update(parse_values(body, self.n))
        self.questions = []  # never answers

    def decide(self) -> str:
        if self.pending is not None:
            return Cooperative.decide(self)
        return self.conclude()
