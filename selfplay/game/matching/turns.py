"""Turn-taking state machine of the matching game: message / propose / accept / reject.

``Game.step(seat, text)`` never raises on bad text: an invalid action is reported back to the
acting seat as an error observation, does not consume the turn, and is counted; too many actions
or too many consecutive invalid actions end the game with reward 0 and their own outcome.
Seats are 0 (player-1, moves first) and 1 (player-2). ``Game`` satisfies ``api.Rules``;
``Outcome`` and ``GameOverError`` live in ``api`` (shared by all games) and are re-exported here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from selfplay.game.api import MAX_ACTIONS, MAX_INVALID, GameOverError, Outcome
from selfplay.game.matching.prompts import view_advice, view_left, view_notes
from selfplay.game.matching.questions import asked_cell, parse_answers
from selfplay.game.matching.rules import Pairs, ProposalError, Scenario, parse_proposal

ERR_EMPTY = "Cannot send empty message."
ERR_PENDING = "A proposal was made. You must first accept or reject it."
ERR_NOTHING_PENDING = (
    "You can only [accept] or [reject] when your partner sends a full proposal. "
    "Send a [message] or a [propose] instead."
)
ERR_FORMAT = (
    "Your output must start with one of the tags [message], [propose], [accept] or [reject]."
)
REJECTED_YOUR_TURN = "You rejected the proposal. It is still your turn."
LAST_PROPOSAL = "This is the last proposal allowed: if you reject it, the game ends with no deal."
PROPOSAL_CHOICES = "You can output one of these choices: [accept] or [reject]"

_TAG = re.compile(r"^\s*\[(message|propose|accept|reject)\]", re.IGNORECASE)


@dataclass(frozen=True)
class Action:
    """One attempted action, valid or not, as it goes into the game record."""

    seat: int
    text: str
    kind: str  # message | propose | accept | reject | invalid
    valid: bool
    error: str | None = None
    proposal: Pairs | None = None


@dataclass(frozen=True)
class StepResult:
    """What each seat observes after one step (as plain text lines), and whether the game ended."""

    observations: tuple[list[str], list[str]]
    done: bool
    outcome: Outcome | None
    action: Action


@dataclass
class Game:
    """Rules and state of one game on one scenario. Deterministic: no randomness inside."""

    scenario: Scenario
    max_actions: int = MAX_ACTIONS
    max_invalid: int = MAX_INVALID
    # a cap on proposals (matching-cap2): the partner's rejection of the last allowed one ends
    # the game with no deal, so a proposal is worth making only when it is likely accepted
    max_proposals: int | None = None
    turn: int = 0
    pending: Pairs | None = None
    pending_from: int | None = None
    actions: list[Action] = field(default_factory=list)
    consecutive_invalid: int = 0
    outcome: Outcome | None = None
    final_proposal: Pairs | None = None
    # matching-notes: after a message that answers about cells the receiving seat does not know,
    # that seat is also shown its values merged with every such answer so far (``view_notes``)
    notes: bool = False
    answers: tuple[dict, dict] = field(default_factory=lambda: ({}, {}))
    # matching-advice: after a partner message that states a value (``parse_answers``) new to a
    # seat or replies to its direct question, and after the partner rejects its proposal, that
    # seat is shown, once it has asked, what is left to ask (``view_left``), then the best
    # proposal by what it knows that is not yet rejected (``view_advice``)
    advice: bool = False
    stated: tuple[dict, dict] = field(default_factory=lambda: ({}, {}))
    rejected: tuple[list, list] = field(default_factory=lambda: ([], []))
    asked: tuple[set, set] = field(default_factory=lambda: (set(), set()))

    def __post_init__(self) -> None:
        if self.max_actions < 1:
            raise ValueError(f"max_actions must be at least 1, got {self.max_actions}")
        if self.max_invalid < 1:
            raise ValueError(f"max_invalid must be at least 1, got {self.max_invalid}")
        if self.max_proposals is not None and self.max_proposals < 1:
            raise ValueError(f"max_proposals must be at least 1, got {self.max_proposals}")

    @property
    def done(self) -> bool:
        return self.outcome is not None

    @property
    def score(self) -> int:
        if self.outcome is Outcome.ACCEPTED and self.final_proposal is not None:
            return self.scenario.score(self.final_proposal)
        return 0

    @property
    def reward(self) -> float:
        """Shared normalised reward score / best, in [0, 1]; 0 without agreement."""
        return self.score / self.scenario.best if self.scenario.best > 0 else 0.0

    @property
    def proposals_left(self) -> int | None:
        """Proposals the seats may still make (None: no cap)."""
        if self.max_proposals is None:
            return None
        made = sum(a.kind == "propose" and a.valid for a in self.actions)
        return max(0, self.max_proposals - made)

    def fail(self, reason: Outcome = Outcome.ERROR) -> None:
        """End the game from outside the rules (engine failure, timeout): reward 0."""
        if not self.done:
            self.outcome = reason

    def step(self, seat: int, text: str) -> StepResult:
        if self.done:
            raise GameOverError(f"game already over ({self.outcome})")
        if seat != self.turn:
            raise GameOverError(f"seat {seat} moved but it is seat {self.turn}'s turn")
        action = self._interpret(seat, text)
        self.actions.append(action)
        obs: tuple[list[str], list[str]] = ([], [])
        partner = 1 - seat
        if not action.valid:
            self.consecutive_invalid += 1
            obs[seat].append(f"Error: {action.error}")
            if self.consecutive_invalid >= self.max_invalid:
                self.outcome = Outcome.INVALID
        else:
            self.consecutive_invalid = 0
            body = action.text.strip()
            match action.kind:
                case "message":
                    obs[partner].append(f"Partner: {body}")
                    if self.notes and self._note_answers(partner, body):
                        obs[partner].append(
                            view_notes(self.scenario, partner, self.answers[partner])
                        )
                    if self.advice:
                        cell = asked_cell(body, self.scenario.n)
                        if cell is not None:
                            self.asked[seat].add(cell)
                        new = self._note_stated(partner, body)
                        if new or self._last_asked(partner):
                            obs[partner].append(self._advice(partner))
                    self.turn = partner
                case "propose":
                    self.pending, self.pending_from = action.proposal, seat
                    obs[partner].append(f"Partner: {body}\n{PROPOSAL_CHOICES}")
                    if self.proposals_left == 0:
                        obs[partner].append(LAST_PROPOSAL)
                    self.turn = partner
                case "accept":
                    obs[partner].append("Partner: [accept]")
                    self.final_proposal = self.pending
                    self.outcome = Outcome.ACCEPTED
                case "reject":
                    obs[partner].append("Partner: [reject]")
                    if self.advice and self.pending_from == partner:
                        self.rejected[partner].append(self.pending)
                        obs[partner].append(self._advice(partner))
                    self.pending = self.pending_from = None
                    obs[seat].append(REJECTED_YOUR_TURN)  # the rejecting seat keeps the turn
                    if self.proposals_left == 0:
                        self.outcome = Outcome.NO_DEAL
        if not self.done and len(self.actions) >= self.max_actions:
            self.outcome = Outcome.MAX_ACTIONS
        return StepResult(obs, self.done, self.outcome, action)

    def _note_answers(self, seat: int, body: str) -> bool:
        """Keep the values ``body`` states about cells ``seat`` does not know; whether any is
        new (a value restated unchanged is not)."""
        view, kept = self.scenario.view(seat), self.answers[seat]
        new = {
            (r, p): v
            for (r, p), v in parse_answers(body, self.scenario.n).items()
            if view[r][p] is None and kept.get((r, p)) != v
        }
        kept.update(new)
        return bool(new)

    def _note_stated(self, seat: int, body: str) -> bool:
        """Keep every value ``body`` states (``parse_answers``: known cells too, they relate the
        two scales); whether any is new to ``seat``."""
        kept = self.stated[seat]
        new = {c: v for c, v in parse_answers(body, self.scenario.n).items() if kept.get(c) != v}
        kept.update(new)
        return bool(new)

    def _last_asked(self, seat: int) -> bool:
        """Whether ``seat``'s last valid action (before the one just taken) was a message asking
        about one cell (``asked_cell``)."""
        before = reversed(self.actions[:-1])
        last = next((a for a in before if a.seat == seat and a.valid), None)
        return (
            last is not None
            and last.kind == "message"
            and (asked_cell(last.text, self.scenario.n) is not None)
        )

    def _advice(self, seat: int) -> str:
        advice = view_advice(self.scenario, seat, self.stated[seat], self.rejected[seat])
        if not self.asked[seat]:
            return advice
        left = view_left(self.scenario, seat, self.asked[seat], self.stated[seat])
        return left + "\n\n" + advice

    def _interpret(self, seat: int, text: str) -> Action:
        def invalid(kind: str, error: str) -> Action:
            return Action(seat, text, kind, False, error)

        m = _TAG.match(text)
        if m is None:
            return invalid("invalid", ERR_FORMAT)
        kind = m.group(1).lower()
        rest = text[m.end() :].strip()
        if self.pending is not None and kind not in ("accept", "reject"):
            return invalid(kind, ERR_PENDING)
        match kind:
            case "message":
                if not rest:
                    return invalid(kind, ERR_EMPTY)
                return Action(seat, text, kind, True)
            case "propose":
                try:
                    pairs = parse_proposal(rest, self.scenario.n)
                except ProposalError as e:
                    return invalid(kind, str(e))
                return Action(seat, text, kind, True, proposal=pairs)
            case _:  # accept / reject
                if self.pending is None:
                    return invalid(kind, ERR_NOTHING_PENDING)
                return Action(seat, text, kind, True)
