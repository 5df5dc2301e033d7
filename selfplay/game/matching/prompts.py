"""What a seat sees: the instructions, its own scaled table, and the events of the dialogue as text.

Players turn these strings into chat turns; the game itself only produces plain text lines.
"""

from __future__ import annotations

from selfplay.game.matching.rules import PAPERS, REVIEWERS, Scenario

INSTRUCTIONS = """\
You and your partner are area chairs for a conference. Together you must assign {n} reviewers to \
{n} papers, one reviewer per paper, so that the total reviewer-paper similarity is as high as \
possible.

Each of you sees a different, partial view of the similarity table below; empty cells are unknown \
to you. Your partner's numbers are scaled by a different factor than yours, so compare them by \
their relative size, not their absolute value. Neither of you knows the other's view.

Talk with your partner to share what you know, then propose a full assignment. Every turn starts \
with exactly one tag: "[message] your text" to talk, "[propose] Proposal:" followed by one line \
"Paper: Reviewer" for each of the {n} papers, "[accept]" or "[reject]" to answer your partner's \
proposal. The game ends when a proposal is accepted; your shared score is its total similarity \
divided by the best possible, out of 1.0."""

TABLE_HEADER = "Reviewer Paper Similarity Scores:"
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
        *(INSTRUCTIONS.format(n=n) for n in range(3, 9)),
    ]


def intro(scenario: Scenario, seat: int) -> str:
    """The first thing a seat is shown: instructions, its table, and who moves first."""
    text = (
        INSTRUCTIONS.format(n=scenario.n) + "\n\n" + TABLE_HEADER + "\n" + scenario.view_csv(seat)
    )
    return text + ("\n\n" + YOU_START if seat == 0 else "")
