"""The DialOp matching game behind the ``DialogueGame`` interface: ``MATCHING`` and its views.

A thin adapter: every member delegates to the folder's modules: the rules (``rules``, ``turns``),
the texts (``prompts``, the API partner's persona too), ``questions``, the scripted players
(``scripted``) and the DialOp human games (``human``).

A view is the same game with other options (how a table is shown, what a seat is told after an
answer, a proposal cap): the same scenarios, scripted decisions and rewards. ``VIEWS`` is their
table, each under its own name; ``selfplay.game.GAMES`` registers them.
"""

from __future__ import annotations

import re
from typing import Any

from selfplay.game.api import MAX_ACTIONS, MAX_INVALID, QuestionKind
from selfplay.game.matching import prompts, questions
from selfplay.game.matching.human import HUMAN
from selfplay.game.matching.rules import MAX_N, MIN_N, PAPERS_SHORT, REVIEWERS, Scenario
from selfplay.game.matching.rules import generate_scenario as _generate_scenario
from selfplay.game.matching.scripted import SCRIPTED_NAMES, make_scripted, parse_values
from selfplay.game.matching.turns import Game
from selfplay.seats import Player

_MESSAGE_TAG = re.compile(r"^\s*\[message\]", re.IGNORECASE)


class MatchingGame:
    """Assign n reviewers to n papers from two partial, differently scaled views (n = size).

    The options (keyword arguments; the class attributes are their defaults, the plain game's):
    ``table_format`` is how a seat's table is shown (``prompts.TABLE_FORMATS``), ``instructions``
    the rules' wording (``prompts.INSTRUCTIONS_BY_STYLE``), ``notes`` / ``advice`` what a seat is
    also shown after an answer (``turns.Game``), ``max_proposals`` a cap on the proposals of both
    seats (``turns.Game``), ``heldout_baselines`` iterate's held-out scripted rows."""

    name = "matching"
    table_format = "csv"
    instructions = "full"
    notes = False
    advice = False
    max_proposals: int | None = None
    min_size = MIN_N
    max_size = MAX_N
    scenario_type = Scenario
    # proposer: the strongest policy that never asks (no repeat of a rejected proposal)
    baselines = ("cooperative", "no-talk", "proposer", "random")
    # inquisitive: the asking reference, the upper bound beside a shy partner
    heldout_baselines = (*baselines, "inquisitive")
    partner_persona = prompts.SHY_PERSONA
    human = HUMAN

    OPTIONS = ("name", "table_format", "instructions", "notes", "advice", "max_proposals")

    def __init__(self, **options: Any) -> None:
        unknown = sorted(options.keys() - {*self.OPTIONS, "heldout_baselines"})
        if unknown:
            raise TypeError(f"not an option of the matching game: {', '.join(unknown)}")
        for key, value in options.items():
            setattr(self, key, value)

    def new_scenario(self, seed: int, size: int) -> Scenario:
        return _generate_scenario(seed, size)

    def new_game(
        self, scenario: Scenario, *, max_actions: int = MAX_ACTIONS, max_invalid: int = MAX_INVALID
    ) -> Game:
        return Game(
            scenario,
            max_actions=max_actions,
            max_invalid=max_invalid,
            notes=self.notes,
            advice=self.advice,
            max_proposals=self.max_proposals,
        )

    def intro(self, scenario: Scenario, seat: int) -> str:
        text = prompts.intro(scenario, seat, self.table_format, self.instructions)
        if self.max_proposals is None:
            return text
        rules, sep, rest = text.partition("\n\n" + prompts.TABLE_HEADER)
        return rules + " " + prompts.CAP_RULE.format(k=self.max_proposals) + sep + rest

    @property
    def scripted_names(self) -> tuple[str, ...]:
        return SCRIPTED_NAMES

    def scripted(self, name: str, scenario: Scenario, seat: int, *, seed: int = 0) -> Player:
        ranked = self.table_format in ("ranked", "gaps", "advice")
        return make_scripted(name, scenario, seat, seed=seed, ranked=ranked)

    def classify_question(self, text: str, scenario: Scenario | None = None) -> QuestionKind:
        text = _MESSAGE_TAG.sub("", text, count=1)  # a recorded action keeps its tag
        return questions.classify_question(text, MAX_N if scenario is None else scenario.n)

    def check_statements(self, text: str, scenario: Scenario, seat: int) -> tuple[int, int]:
        stated = parse_values(_MESSAGE_TAG.sub("", text, count=1), scenario.n)
        view = scenario.view(seat)
        return len(stated), sum(view[r][p] == v for (r, p), v in stated.items())

    def direct_question(self, scenario: Scenario) -> str:
        return f"What is the score for {REVIEWERS[0]} on {PAPERS_SHORT[scenario.n - 1]}?"


MATCHING = MatchingGame()
# one line per reviewer naming its known cells ("Ava Li: BLEU 116, GloVe 79"), the form the
# scripted players' messages use
MATCHING_LINES = MatchingGame(name="matching-lines", table_format="lines")
# matching-lines with the rules in five sentences (``prompts.SHORT_INSTRUCTIONS``): a 3x3 seat's
# prompt about 130 tokens shorter than the csv game's (SmolLM2 warm-start row: 311 tokens, not 442)
MATCHING_SHORT = MatchingGame(name="matching-short", table_format="lines", instructions="short")
# known cells one a line, highest first ("Ava Li: GloVe 968"), the scripted players' messages in
# the same order: the largest known value is a first line, not the result of comparisons
MATCHING_RANKED = MatchingGame(name="matching-ranked", table_format="ranked")
# matching-ranked with the cells a seat does not know listed after its known ones, in a direct
# question's words; ``scripted:asker`` asks them in that order (docs/experiments/asking.md)
MATCHING_GAPS = MatchingGame(name="matching-gaps", table_format="gaps")
# matching-gaps where, after each answer about cells a seat does not know, it is also shown its
# known cells merged with every answer so far, highest first (``prompts.NOTES_HEADER``)
MATCHING_NOTES = MatchingGame(name="matching-notes", table_format="gaps", notes=True)
# matching-gaps where each seat is also shown the best proposal by what it knows, not yet rejected
# (``prompts.ADVICE_HEADER``), again after each new value, reply or rejection, and the cells left
# to ask (``prompts.LEFT_HEADER``): what is left to the model is to ask or to propose the advice.
# ``scripted:advised`` never asks and proposes the advice, ``scripted:advised-asker`` asks first
# (the panel's value of asking, ``evaluate.learned``, is advised-asker's reward minus proposer's)
ADVISED_BASELINES = (*MatchingGame.heldout_baselines, "advised", "advised-asker")
MATCHING_ADVICE = MatchingGame(
    name="matching-advice", table_format="advice", advice=True, heldout_baselines=ADVISED_BASELINES
)
# at most 2 proposals between the seats: the second's rejection ends the game with no deal
# (``Outcome.NO_DEAL``, reward 0), so a seat has a reason to ask first
# (docs/experiments/asking-again.md)
MATCHING_CAP2 = MatchingGame(name="matching-cap2", max_proposals=2)
# matching-advice with matching-cap2's rule: whether a question is worth asking before proposing
# (docs/experiments/asking-again.md: the setting chosen on design seed 101 before training)
MATCHING_ADVICE_CAP2 = MatchingGame(
    name="matching-advice-cap2",
    table_format="advice",
    advice=True,
    max_proposals=2,
    heldout_baselines=ADVISED_BASELINES,
)

# the views of the game, the plain one first: selfplay.game registers each under its name
VIEWS: tuple[MatchingGame, ...] = (
    MATCHING,
    MATCHING_LINES,
    MATCHING_RANKED,
    MATCHING_SHORT,
    MATCHING_GAPS,
    MATCHING_NOTES,
    MATCHING_ADVICE,
    MATCHING_CAP2,
    MATCHING_ADVICE_CAP2,
)
