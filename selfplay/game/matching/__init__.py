"""The DialOp matching game behind the ``DialogueGame`` interface: ``MATCHING``.

A thin adapter: every member delegates to the folder's modules: the rules (``rules``, ``turns``),
the texts (``prompts``, the API partner's persona too), ``questions``, the scripted players
(``scripted``) and the DialOp human games (``human``).
"""

from __future__ import annotations

import re

from selfplay.game.api import QuestionKind
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

    ``table_format`` is how a seat's table is shown (``prompts.TABLE_FORMATS``): the reference's
    CSV here, one line per reviewer in ``MatchingLinesGame``, one known cell a line, highest
    first, in ``MatchingRankedGame``."""

    name = "matching"
    table_format = "csv"
    instructions = "full"  # prompts.INSTRUCTIONS_BY_STYLE
    notes = False  # turns.Game.notes: the merged list after each answer (matching-notes)
    advice = False  # turns.Game.advice: the best proposal after each answer (matching-advice)
    max_proposals: int | None = None  # turns.Game.max_proposals (matching-cap2)
    min_size = MIN_N
    max_size = MAX_N
    scenario_type = Scenario
    # proposer: the strongest policy that never asks (no repeat of a rejected proposal)
    baselines = ("cooperative", "no-talk", "proposer", "random")
    # inquisitive: the asking reference, the upper bound beside a shy partner
    heldout_baselines = (*baselines, "inquisitive")
    partner_persona = prompts.SHY_PERSONA
    human = HUMAN

    def new_scenario(self, seed: int, size: int) -> Scenario:
        return _generate_scenario(seed, size)

    def new_game(self, scenario: Scenario, *, max_actions: int = 30, max_invalid: int = 3) -> Game:
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


class MatchingLinesGame(MatchingGame):
    """The matching game with each seat's table shown as one line per reviewer naming its known
    cells ("Ava Li: BLEU 116, GloVe 79"), the form the scripted players' messages use: the same
    rules, scenarios, scripted players and rewards; only the prompt's table differs."""

    name = "matching-lines"
    table_format = "lines"


MATCHING_LINES = MatchingLinesGame()


class MatchingShortGame(MatchingLinesGame):
    """matching-lines with the rules in five sentences (``prompts.SHORT_INSTRUCTIONS``): the same
    rules, scenarios, scripted players and rewards; a 3x3 seat's prompt is about 130 tokens
    shorter than the csv game's (SmolLM2: a warm-start row of ``make demo`` 311 tokens instead of
    442), where the prompt is three quarters of a row."""

    name = "matching-short"
    instructions = "short"


MATCHING_SHORT = MatchingShortGame()


class MatchingRankedGame(MatchingGame):
    """The matching game with each seat's known cells listed one a line, highest value first
    ("Ava Li: GloVe 968"), and the scripted players' messages stating their values in the same
    order ("My known scores, highest first: Ava Li: GloVe 968; Sofia Patel: BLEU 156"). The same
    rules, scenarios, rewards and scripted decisions; only the order of the values in the texts
    differs, so that the largest known value is a first line, not the result of comparisons."""

    name = "matching-ranked"
    table_format = "ranked"


MATCHING_RANKED = MatchingRankedGame()


class MatchingGapsGame(MatchingRankedGame):
    """matching-ranked with the cells a seat does not know listed after its known ones, one a line
    in table order, in a direct question's words ("Not known to you:" / "Ava Li on GloVe"). The
    same rules, scenarios, rewards and scripted players; ``scripted:asker`` asks about those cells
    in that order, so each of its questions copies the next line of the list
    (docs/experiments/asking.md)."""

    name = "matching-gaps"
    table_format = "gaps"


MATCHING_GAPS = MatchingGapsGame()


class MatchingNotesGame(MatchingGapsGame):
    """matching-gaps where, after each partner message that answers about cells a seat does not
    know ("Ava Li on GloVe: 375."), that seat is also shown its known cells merged with every such
    answer so far, one a line, highest first (``prompts.NOTES_HEADER``). The picks after asking
    are then read off a list, as the first picks are read off the table, instead of merged in the
    model's head. Same rules, scenarios, rewards and scripted decisions
    (docs/experiments/asking.md)."""

    name = "matching-notes"
    notes = True


MATCHING_NOTES = MatchingNotesGame()


class MatchingAdviceGame(MatchingGapsGame):
    """matching-gaps where each seat is also shown the best proposal by what it knows, not yet
    rejected (``prompts.ADVICE_HEADER`` and the proposal's text): in its table, and again after
    each partner message that states a value new to it or replies to its question and after each
    rejection of its proposal; once it has asked, the cells left to ask come first
    (``prompts.LEFT_HEADER``). Proposing well and the next question are then copies; what is left
    to the model is the choice this game is for: ask about an unknown cell or propose the advice.
    ``scripted:advised`` never asks and proposes the advice, ``scripted:advised-asker`` asks
    first (beside shy-strict, 3x3, 20 actions: 0.651 against 0.741). Same rules, scenarios and
    rewards (docs/experiments/asking.md)."""

    name = "matching-advice"
    table_format = "advice"
    advice = True
    # the scripted players that copy the advice, never asking and asking first (the panel's
    # value of asking, ``evaluate.learned``, is advised-asker's reward minus proposer's)
    heldout_baselines = (*MatchingGame.heldout_baselines, "advised", "advised-asker")


MATCHING_ADVICE = MatchingAdviceGame()


class MatchingCap2Game(MatchingGame):
    """The matching game where the two seats may make at most 2 proposals in all: the rejection
    of the second ends the game with no deal (``Outcome.NO_DEAL``, reward 0), and the rules say
    so. Proposing down one's own estimate until the partner accepts stops paying, so a seat that
    does not know the cells its best assignment rests on has a reason to ask first
    (docs/experiments/asking-again.md)."""

    name = "matching-cap2"
    max_proposals = 2


MATCHING_CAP2 = MatchingCap2Game()


class MatchingAdviceCap2Game(MatchingAdviceGame):
    """matching-advice with matching-cap2's rule (at most 2 proposals between the seats): the
    advice makes a good proposal a copy, the cap makes a bad one costly, and what is left to the
    seat is whether a question is worth asking before it proposes (docs/experiments/
    asking-again.md: the setting chosen on design seed 101 before training)."""

    name = "matching-advice-cap2"
    max_proposals = 2


MATCHING_ADVICE_CAP2 = MatchingAdviceCap2Game()
