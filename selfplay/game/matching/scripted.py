"""Scripted players: baselines for evaluation and fixed partners for training.

Each sees exactly what an LLM seat sees (its own scaled table and the partner's turns as text) and
plays a fixed policy:

- ``cooperative``: shares all its known values in [message] turns, then proposes the best
  assignment under the merged knowledge; accepts a proposal worth at least ``accept_fraction`` of
  its own best estimate, a bar that drops by 0.1 with each proposal it has rejected.
- ``no-talk``: immediately proposes its own solo optimum; accepts anything.
- ``shy``: never volunteers; answers only a direct question naming one reviewer and one paper with
  its own scaled value; judges proposals honestly by its own view: accepts one worth at least 0.8
  of the best it can see (unknown cells at its mean known value), rejects the others.
- ``shy-strict``: ``shy`` whose bar is 0.9, so that proposing until it accepts pays less and
  asking more (docs/experiments/asking.md: where asking pays against shy).
- ``random``: proposes a random valid assignment; accepts or rejects at random.
- ``inquisitive``: asks its partner direct questions (one reviewer, one paper) about the cells it
  does not know that could change the best assignment (after one question on a cell it knows, to
  learn the ratio of the two scales), then proposes the best assignment under what it learned, and
  judges proposals honestly like ``cooperative``. The upper reference against ``shy``, which
  answers only such questions.
- ``explainer``: ``cooperative``'s messages, then a teacher a small model can copy: the first seat
  to know both views says how it picks, highest known value first ("Highest first: BLEU: Ava Li
  (116), Electra: Sofia Patel (90), GloVe: Daniel Nguyen": each step the largest value, own or
  the partner's as stated, whose reviewer and paper are still free; the rest in order), and the
  other seat proposes exactly those pairs; it accepts its own picks, otherwise judges like
  ``cooperative``. Greedy on the raw values, so weaker than ``cooperative``, but each step is a
  comparison of numbers in the dialogue and the proposal a copy of the message.
- ``asker``: the explainer's plan against a partner who only answers direct questions: never
  volunteers its table; asks about the cells it does not know, in table order, at most 2(n - 1)
  ("What is the score for Ava Li on BLEU?"); then says its picks over its own values and the
  answers, highest first, as the explainer does; proposes them, and after a rejection the best
  assignment not yet rejected (as ``inquisitive``). Answers the partner's questions honestly.
- ``picker``: ``asker`` without the questions: its picks come from its own values alone. The pair
  isolates what asking adds (against ``shy``, 3x3: about 0.84 against 0.76).
- ``late-asker``: ``picker`` until its first proposal is rejected, then ``asker``: it asks about
  the cells it does not know (table order, at most 2(n - 1)), says its picks over its values and
  the answers, and proposes them (or, when they were rejected already, the best assignment not yet
  rejected, without saying picks). Asking is its answer to a rejection, so a model cloned from a
  mix of it and ``picker`` meets the choice, ask or propose again, in every rejected game.

Partner values come in the partner's scale: the cooperative player estimates the ratio of the
two scales from cells both know (or from the means when none overlap) before merging.
"""

from __future__ import annotations

import re

import numpy as np

from selfplay.game.matching.prompts import (
    ADVICE_HEADER,
    LEFT_HEADER,
    NOTES_HEADER,
    ranked_cells,
    unknown_cells,
)
from selfplay.game.matching.questions import asked_cell, is_question, parse_answers
from selfplay.game.matching.rules import (
    PAPERS_SHORT,
    REVIEWERS,
    Pairs,
    ProposalError,
    Scenario,
    best_assignment,
    best_untried,
    estimate_table,
    format_proposal,
    parse_proposal,
)
from selfplay.seats import SeatConfig, SeatTokens

NOTHING_LEFT = "I have no proposal left that you have not rejected."
_PARTNER = re.compile(r"Partner: \[(message|propose|accept|reject)\]", re.IGNORECASE)
_CHOICES = "You can output one of these choices"
_VALUE_ITEM = re.compile(r"(\w+) (\d+)")


def partner_events(observation: str) -> list[tuple[str, str]]:
    """The partner's actions in an observation, as (kind, body) in order."""
    marks = list(_PARTNER.finditer(observation))
    events = []
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(observation)
        body = observation[m.end() : end]
        if _CHOICES in body:
            body = body[: body.index(_CHOICES)]
        # the game's lines (matching-notes, matching-advice), not the partner's words
        for header in (NOTES_HEADER, LEFT_HEADER, ADVICE_HEADER):
            if header in body:
                body = body[: body.index(header)]
        events.append((m.group(1).lower(), body.strip()))
    return events


def format_values(view: list[list[int | None]], rows: range, *, ranked: bool = False) -> str:
    """'Ava Li: BLEU 320, GloVe 122; Daniel Nguyen: Electra 45' for the known cells of ``rows``;
    ``ranked``: one cell an item, highest value first ('Ava Li: BLEU 320; Daniel Nguyen: Electra
    45; Ava Li: GloVe 122'), which ``parse_values`` reads the same."""
    if ranked:
        cells = [c for c in ranked_cells(view) if c[0] in rows]
        return "; ".join(f"{REVIEWERS[r]}: {PAPERS_SHORT[p]} {v}" for r, p, v in cells)
    parts = []
    for r in rows:
        items = [f"{PAPERS_SHORT[p]} {v}" for p, v in enumerate(view[r]) if v is not None]
        if items:
            parts.append(f"{REVIEWERS[r]}: {', '.join(items)}")
    return "; ".join(parts)


def parse_values(text: str, n: int) -> dict[tuple[int, int], int]:
    """Inverse of format_values: {(reviewer, paper): value} for every item found in ``text``."""
    short = {s.casefold(): i for i, s in enumerate(PAPERS_SHORT[:n])}
    found: dict[tuple[int, int], int] = {}
    for segment in text.split(";"):
        # "My known scores: Ava Li: BLEU 320, ..." -- the name is what stands before the last colon
        head, _, items = segment.rpartition(":")
        name = head.rpartition(":")[2].strip()
        if name not in REVIEWERS[:n]:
            continue
        r = REVIEWERS.index(name)
        for paper, value in _VALUE_ITEM.findall(items):
            p = short.get(paper.casefold())
            if p is not None:
                found[(r, p)] = int(value)
    return found


def _expected(view: list[list[int | None]]) -> np.ndarray:
    """Own-view value table with unknown cells at the mean known value (the game's 50, scaled)."""
    arr = np.array([[np.nan if v is None else v for v in row] for row in view], dtype=float)
    fill = np.nanmean(arr) if np.isfinite(arr).any() else 0.0
    return np.where(np.isnan(arr), fill, arr)


def _value(table: np.ndarray, pairs: Pairs) -> float:
    return float(sum(table[r, p] for r, p in pairs))


class ScriptedPlayer:
    """Shared bookkeeping: the seat's view, its RNG, the partner's pending proposal."""

    name: str = "scripted"

    def __init__(self, scenario: Scenario, seat: int, seed: int = 0) -> None:
        self.scenario = scenario
        self.seat = seat
        self.n = scenario.n
        self.view = scenario.view(seat)
        self.rng = np.random.default_rng(seed)
        self.config = SeatConfig(kind="scripted", name=self.name)
        self.pending: Pairs | None = None

    def tokens(self) -> SeatTokens | None:
        return None

    async def act(self, observation: str) -> str:
        events = partner_events(observation)
        self.pending = None
        for kind, body in events:
            if kind == "propose":
                try:
                    self.pending = parse_proposal(body, self.n)
                except ProposalError:
                    self.pending = None
            self.observe(kind, body)
        return self.decide()

    def observe(self, kind: str, body: str) -> None:
        """Hook: a partner action seen this turn."""

    def decide(self) -> str:
        raise NotImplementedError

    def propose(self, pairs: Pairs) -> str:
        return "[propose] " + format_proposal(pairs, self.n)


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
            if _value(estimate, self.pending) >= bar * best_value:
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
        return self.propose(best_assignment(_expected(self.view))[0])


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
            own = _expected(self.view)
            best_value = best_assignment(own)[1]
            ok = _value(own, self.pending) >= self.accept_fraction * best_value
            return "[accept]" if ok else "[reject]"
        if self.last_message:
            return "[message] " + self.answer(self.last_message)
        return "[message] Hello."


class ShyStrict(Shy):
    name = "shy-strict"

    def __init__(self, scenario: Scenario, seat: int, seed: int = 0) -> None:
        super().__init__(scenario, seat, seed, accept_fraction=0.9)


class RandomPlayer(ScriptedPlayer):
    name = "random"

    def decide(self) -> str:
        if self.pending is not None:
            return "[accept]" if self.rng.random() < 0.5 else "[reject]"
        perm = self.rng.permutation(self.n)
        return self.propose([(int(r), p) for p, r in enumerate(perm)])


_QUESTION = re.compile(r"score for ([A-Za-z]+(?: [A-Za-z]+)?) on ([A-Za-z0-9-]+)\?")


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
        for name, paper in _QUESTION.findall(body):
            cell = self._cell(name, paper)
            if cell is not None:
                self.questions.append(cell)

    def _cell(self, name: str, paper: str) -> tuple[int, int] | None:
        r, p = _index(REVIEWERS[: self.n], name), _index(PAPERS_SHORT[: self.n], paper)
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


PICKS = "Highest first: "
_PICK = re.compile(r"(\w+): ([A-Z][a-z]+ [A-Z][a-z]+)")


def format_picks(steps: list[tuple[int, int, int | None]]) -> str:
    """'Highest first: BLEU: Ava Li (116), ..., GloVe: Daniel Nguyen' for (reviewer, paper, value)
    steps in the order picked; a step without a known value has none."""
    items = [
        f"{PAPERS_SHORT[p]}: {REVIEWERS[r]}" + ("" if v is None else f" ({v})") for r, p, v in steps
    ]
    return PICKS + ", ".join(items)


def parse_picks(text: str, n: int) -> Pairs | None:
    """The pairs of a format_picks message (sorted by reviewer), None unless they assign every
    reviewer and paper once."""
    if PICKS not in text:
        return None
    pairs = set()
    for paper, name in _PICK.findall(text.split(PICKS, 1)[1]):
        p = _index(PAPERS_SHORT[:n], paper)
        r = _index(REVIEWERS[:n], name)
        if p is None or r is None:
            return None
        pairs.add((r, p))
    if len(pairs) != n or len({r for r, _ in pairs}) != n or len({p for _, p in pairs}) != n:
        return None
    return sorted(pairs)


def greedy_picks(
    view: list[list[int | None]], stated: dict[tuple[int, int], int]
) -> list[tuple[int, int, int | None]]:
    """Largest known value first (the seat's own value wins a cell both know), skipping used
    reviewers and papers; then the reviewers and papers left, in order, without a value."""
    known = dict(stated)
    known.update(
        {(r, p): v for r, row in enumerate(view) for p, v in enumerate(row) if v is not None}
    )
    steps: list[tuple[int, int, int | None]] = []
    rows: set[int] = set()
    cols: set[int] = set()
    for (r, p), v in sorted(known.items(), key=lambda kv: (-kv[1], kv[0])):
        if r not in rows and p not in cols:
            steps.append((r, p, v))
            rows.add(r)
            cols.add(p)
    n = len(view)
    left = zip((r for r in range(n) if r not in rows), (p for p in range(n) if p not in cols))
    return steps + [(r, p, None) for r, p in left]


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


def _index(names, text: str) -> int | None:
    folded = text.strip().casefold()
    return next((i for i, name in enumerate(names) if name.casefold() == folded), None)


_PLAYERS: dict[str, type[ScriptedPlayer]] = {
    cls.name: cls
    for cls in (
        Cooperative,
        NoTalk,
        Shy,
        ShyStrict,
        RandomPlayer,
        Inquisitive,
        Explainer,
        Asker,
        Picker,
        LateAsker,
        Advised,
        AdvisedAsker,
        AdvisedLateAsker,
        Proposer,
    )
}
SCRIPTED_NAMES: tuple[str, ...] = tuple(_PLAYERS)


def make_scripted(
    name: str, scenario: Scenario, seat: int, seed: int = 0, *, ranked: bool = False
) -> ScriptedPlayer:
    """Build a scripted player by name (one of SCRIPTED_NAMES); ``ranked``: the players that
    share their table state it highest value first (the matching-ranked game)."""
    cls = _PLAYERS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown scripted player {name!r}; choose one of {', '.join(SCRIPTED_NAMES)}"
        )
    if issubclass(cls, Cooperative):  # the players that state values (or may)
        return cls(scenario, seat, seed, ranked=ranked)
    return cls(scenario, seat, seed)
