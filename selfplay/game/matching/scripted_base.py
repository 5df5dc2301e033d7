"""What the scripted players share: the base class, reading the partner's turns, and the text
forms of values and picks they state and parse.

The players themselves, a module per family: ``scripted_share`` (the players that state their
values: cooperative, explainer; and no-talk, random), ``scripted_shy`` (shy, shy-strict: answer
direct questions only), ``scripted_ask`` (the players that ask: inquisitive, asker, picker,
late-asker, advised, advised-asker, advised-late-asker, proposer); ``scripted`` names them all.
"""

from __future__ import annotations

import re

import numpy as np

from selfplay.game.matching.prompts import ADVICE_HEADER, LEFT_HEADER, NOTES_HEADER, ranked_cells
from selfplay.game.matching.rules import (
    PAPERS_SHORT,
    REVIEWERS,
    Pairs,
    ProposalError,
    Scenario,
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


def expected_table(view: list[list[int | None]]) -> np.ndarray:
    """Own-view value table with unknown cells at the mean known value (the game's 50, scaled)."""
    arr = np.array([[np.nan if v is None else v for v in row] for row in view], dtype=float)
    fill = np.nanmean(arr) if np.isfinite(arr).any() else 0.0
    return np.where(np.isnan(arr), fill, arr)


def assignment_value(table: np.ndarray, pairs: Pairs) -> float:
    """The sum of ``table`` over the cells of ``pairs``."""
    return float(sum(table[r, p] for r, p in pairs))


def index_of(names, text: str) -> int | None:
    """The index of the name ``text`` is (case and spaces around ignored), None if none."""
    folded = text.strip().casefold()
    return next((i for i, name in enumerate(names) if name.casefold() == folded), None)


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
        p = index_of(PAPERS_SHORT[:n], paper)
        r = index_of(REVIEWERS[:n], name)
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
