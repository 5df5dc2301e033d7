"""What a seat sees: the instructions, its own scaled table, and the events of the dialogue as text.

Players turn these strings into chat turns; the game itself only produces plain text lines.
"""

from __future__ import annotations

from selfplay.game.matching.rules import (
    PAPERS,
    PAPERS_SHORT,
    REVIEWERS,
    Pairs,
    Scenario,
    best_untried,
    estimate_table,
    format_proposal,
)

INSTRUCTIONS = """\
You and your partner are area chairs for a conference. Together you must assign {n} reviewers to \
{n} papers, one reviewer per paper, so that the total reviewer-paper similarity is as high as \
possible.

Each of you sees a different, partial view of the similarity table below; {unknown} are unknown \
to you. Your partner's numbers are scaled by a different factor than yours, so compare them by \
their relative size, not their absolute value. Neither of you knows the other's view.

Talk with your partner to share what you know, then propose a full assignment. Every turn starts \
with exactly one tag: "[message] your text" to talk, "[propose] Proposal:" followed by one line \
"Paper: Reviewer" for each of the {n} papers, "[accept]" or "[reject]" to answer your partner's \
proposal. The game ends when a proposal is accepted; your shared score is its total similarity \
divided by the best possible, out of 1.0."""

# The same rules in five sentences (the matching-short game): about 100 tokens instead of 205 with
# SmolLM2's tokenizer, for runs where the prompt is most of what the model reads and trains on
# (three quarters of a 3x3 row's tokens with the full text).
SHORT_INSTRUCTIONS = """\
Assign {n} reviewers to {n} papers, one reviewer per paper, for the highest total similarity. \
You and your partner each see part of the table, in different scales; {unknown} are unknown to \
you. Share what you know, then propose. Start every turn with one tag: "[message] text", \
"[propose] Proposal:" then one "Paper: Reviewer" line per paper, "[accept]" or "[reject]". \
Your shared score: the accepted proposal's total over the best possible."""
# A proposal cap (``turns.Game.max_proposals``), added to the rules' last paragraph.
CAP_RULE = (
    "You may make at most {k} proposals between you: if the last one is rejected, the game ends "
    "with no deal and a score of 0."
)
INSTRUCTIONS_BY_STYLE = {"full": INSTRUCTIONS, "short": SHORT_INSTRUCTIONS}

TABLE_HEADER = "Reviewer Paper Similarity Scores:"
# How a seat's table is shown: "csv", the reference's rendering (paper titles as column headers,
# empty unknown cells), or "lines", one line per reviewer naming each known cell
# ("Ava Li: BLEU 116, GloVe 79"), the form the scripted players' messages use, so that reading a
# cell is a copy rather than a column lookup (the matching-lines game), or "ranked", one known
# cell a line, highest value first ("Ava Li: GloVe 968"), so that the largest known value is the
# first line rather than the result of comparisons (the matching-ranked game), or "gaps", the
# ranked lines and then the cells the seat does not know, one a line in table order, in the words
# of a direct question ("Ava Li on GloVe"), so that asking about an unknown cell is a copy of a
# line rather than the result of checking the table (the matching-gaps game), or "advice", the
# gaps view and then the best proposal by what the seat knows (``view_advice``), shown again
# after a new answer, a reply to its question or a rejection, with what is left to ask
# (``view_left``) once it has asked (the matching-advice game).
TABLE_FORMATS = ("csv", "lines", "ranked", "gaps", "advice")
GAPS_HEADER = "Not known to you:"
# matching-notes: shown to a seat after each partner message that answers about cells it does
# not know, then its known cells and the answers so far, one a line, highest first.
NOTES_HEADER = "Your values and the answers so far, highest first:"
# matching-advice: the best assignment by the seat's values and the partner's answers (in the
# seat's scale) among those the partner has not rejected, as a proposal to copy.
ADVICE_HEADER = "Best proposal by what you know, not yet rejected:"
# matching-advice: shown before the advice once the seat has asked: the cells it does not know,
# has not asked about and was not told, in table order, at most 2(n - 1) minus its questions so
# far (``scripted:advised-asker``'s budget), so that its next question is a copy of a line too.
LEFT_HEADER = "Left to ask:"
ADVICE_NONE = "none: your partner rejected every assignment"
_UNKNOWN = {
    "csv": "empty cells",
    "lines": "cells not listed",
    "ranked": "cells not listed",
    "gaps": f'the cells under "{GAPS_HEADER}"',
    "advice": f'the cells under "{GAPS_HEADER}"',
}
YOU_START = "You start the conversation."


def tokenizer_corpus() -> list[str]:
    """Texts of this game for a test tokenizer (``models.build_tiny_model``): moves, rosters and
    the instructions, so that the game's prompts take few tokens."""
    return [
        "[message] Hello partner, what do you know about Ava Li and BLEU?",
        "[propose] Proposal:\nBLEU: Ava Li\nElectra: Daniel Nguyen\nGloVe: Sofia Patel",
        "[accept] [reject] Partner: Error: Your proposal must start with 'Proposal:'",
        "Reviewer Paper Similarity Scores: 0,1,2,3,4,5,6,7,8,9,10,120,345,,,",
        *REVIEWERS,
        *PAPERS,
        *(INSTRUCTIONS.format(n=n, unknown=_UNKNOWN["csv"]) for n in range(3, 9)),
    ]


def view_lines(scenario: Scenario, seat: int) -> str:
    """The seat's table as one line per reviewer: 'Ava Li: BLEU 116, GloVe 79', the known cells by
    the papers' short names in column order; 'Daniel Nguyen: none' where no cell is known."""
    lines = []
    for name, row in zip(scenario.reviewers, scenario.view(seat)):
        known = [f"{PAPERS_SHORT[p]} {v}" for p, v in enumerate(row) if v is not None]
        lines.append(f"{name}: {', '.join(known) if known else 'none'}")
    return "\n".join(lines)


def ranked_cells(view: list[list[int | None]]) -> list[tuple[int, int, int]]:
    """The known cells of a view as (reviewer, paper, value), highest value first (ties: reviewer,
    then paper, in table order)."""
    cells = [(r, p, v) for r, row in enumerate(view) for p, v in enumerate(row) if v is not None]
    return sorted(cells, key=lambda c: (-c[2], c[0], c[1]))


def view_ranked(scenario: Scenario, seat: int) -> str:
    """The seat's known cells one a line, highest value first: 'Ava Li: GloVe 968' (the scripted
    messages' item form, one item a line); 'none' where no cell is known."""
    cells = ranked_cells(scenario.view(seat))
    lines = [f"{scenario.reviewers[r]}: {PAPERS_SHORT[p]} {v}" for r, p, v in cells]
    return "\n".join(lines) or "none"


def unknown_cells(view: list[list[int | None]]) -> list[tuple[int, int]]:
    """The cells a view does not know as (reviewer, paper), in table order (reviewer, then
    paper): the order ``scripted:asker`` asks about them."""
    return [(r, p) for r, row in enumerate(view) for p, v in enumerate(row) if v is None]


def view_gaps(scenario: Scenario, seat: int) -> str:
    """``view_ranked``, then the cells the seat does not know, one a line in table order, as a
    direct question names them: 'Not known to you:' / 'Ava Li on GloVe' ('none' if it knows all)."""
    cells = unknown_cells(scenario.view(seat))
    gaps = [f"{scenario.reviewers[r]} on {PAPERS_SHORT[p]}" for r, p in cells] or ["none"]
    return "\n".join([view_ranked(scenario, seat), "", GAPS_HEADER, *gaps])


def view_notes(scenario: Scenario, seat: int, answers: dict[tuple[int, int], int]) -> str:
    """``NOTES_HEADER`` and the seat's known cells merged with the partner's answers about the
    cells it does not know (values as stated), one a line in ``view_ranked``'s form, highest
    first: the list the seat's picks over the answers are read from."""
    merged = [list(row) for row in scenario.view(seat)]
    for (r, p), v in answers.items():
        if merged[r][p] is None:
            merged[r][p] = v
    lines = [f"{scenario.reviewers[r]}: {PAPERS_SHORT[p]} {v}" for r, p, v in ranked_cells(merged)]
    return "\n".join([NOTES_HEADER, *lines])


def view_advice(
    scenario: Scenario,
    seat: int,
    stated: dict[tuple[int, int], int],
    rejected: list[Pairs],
) -> str:
    """``ADVICE_HEADER`` and the proposal (``format_proposal``) of the best assignment by the
    seat's values and the partner's ``stated`` ones (``rules.estimate_table``) that is not among
    the seat's ``rejected`` proposals (``rules.best_untried``): the proposal ``scripted:advised``
    makes, so that proposing well is a copy."""
    estimate = estimate_table(scenario.view(seat), stated)
    pairs = best_untried(estimate, rejected)
    if pairs is None:
        return ADVICE_HEADER + "\n" + ADVICE_NONE
    return ADVICE_HEADER + "\n" + format_proposal(pairs, scenario.n)


def view_left(
    scenario: Scenario,
    seat: int,
    asked: set[tuple[int, int]],
    stated: dict[tuple[int, int], int],
) -> str:
    """``LEFT_HEADER`` and the unknown cells the seat has not asked about nor been told, one a
    line in table order ('Ava Li on GloVe'), at most 2(n - 1) - len(asked); 'none' when none."""
    budget = max(0, 2 * (scenario.n - 1) - len(asked))
    left = [c for c in unknown_cells(scenario.view(seat)) if c not in asked and c not in stated]
    lines = [f"{scenario.reviewers[r]} on {PAPERS_SHORT[p]}" for r, p in left[:budget]]
    return "\n".join([LEFT_HEADER, *(lines or ["none"])])


def view_gaps_advice(scenario: Scenario, seat: int) -> str:
    """``view_gaps``, then the advice before anything is said (``view_advice``)."""
    return view_gaps(scenario, seat) + "\n\n" + view_advice(scenario, seat, {}, [])


_VIEWS = {
    "csv": Scenario.view_csv,
    "lines": view_lines,
    "ranked": view_ranked,
    "gaps": view_gaps,
    "advice": view_gaps_advice,
}


def intro(
    scenario: Scenario, seat: int, table_format: str = "csv", instructions: str = "full"
) -> str:
    """The first thing a seat is shown: instructions (``INSTRUCTIONS_BY_STYLE``), its table, and
    who moves first."""
    table = _VIEWS[table_format](scenario, seat)
    rules = INSTRUCTIONS_BY_STYLE[instructions].format(n=scenario.n, unknown=_UNKNOWN[table_format])
    text = rules + "\n\n" + TABLE_HEADER + "\n" + table
    return text + ("\n\n" + YOU_START if seat == 0 else "")


# The API partner's system prompt (``DialogueGame.partner_persona``): a partner who only answers
# direct questions (``--partner openai:MODEL``).
SHY_PERSONA = """\
You are one of two players in a cooperative game: together you assign reviewers to papers. The \
first message shows the game's rules and the part of the reviewer-paper similarity table that \
you can see, in your own scale; your partner sees a different part, in another scale. Every \
reply must follow the rules' output format and start with [message], [propose], [accept] or \
[reject].

You are shy. Follow these rules strictly:
1. Never volunteer information. Do not share any similarity value, reviewer or paper preference \
unless you are asked for it directly.
2. Answer only a direct question about one specific reviewer-paper pair (it names one reviewer \
and one paper). Then give that pair's value from your own table, in one short [message]; if that \
cell is empty in your table, say that you do not know it.
3. To a general or vague question (for example "what do you know?", "who is good at BLEU?", \
"share your scores"), give a vague, noncommittal answer without any numbers.
4. Judge every proposal honestly by your own table: [accept] it when it is close to the best you \
can see, [reject] it otherwise.
5. Let your partner lead: do not make proposals yourself. Keep messages short.
"""
