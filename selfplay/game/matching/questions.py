"""Question detection in matching-game messages: is it a question, and does it ask for a score.

``is_question`` is plain English (a '?', a question word first, an asking phrase);
``classify_question`` adds the matching game's names: ``direct`` when the question names a
reviewer and a paper of the table, ``general`` for any other question, ``none`` otherwise. Pure
string functions; ``MATCHING.classify_question`` calls the second.
"""

from __future__ import annotations

import re

from selfplay.game.api import QuestionKind
from selfplay.game.matching.rules import MAX_N, PAPERS_SHORT, REVIEWERS, mentions

_QUESTION_WORDS = (
    "what", "which", "who", "whom", "whose", "how", "why", "where", "when", "do", "does", "did",
    "can", "could", "would", "will", "is", "are", "should", "any", "have", "has",
)  # fmt: skip
# Requests that ask without a question mark (the original analysis script's patterns among them).
_ASKING = re.compile(
    r"\b(score for|scores for|affinity between|similarity between|value for|tell me|"
    r"let me know|share (your|the|what)|do you (know|have|see)|can you|could you)\b",
    re.IGNORECASE,
)


# Statements of ignorance that contain an asking phrase ("I don't know the score for ...").
_NOT_ASKING = re.compile(r"^\s*(i (don't|do not|dont) know|i have no|no idea)\b", re.IGNORECASE)


def is_question(text: str) -> bool:
    """A question: a '?', a sentence opening with a question word, or an asking phrase."""
    if "?" in text:
        return True
    for sentence in re.split(r"[.!;\n]", text):
        if _NOT_ASKING.search(sentence):
            continue
        words = sentence.strip().lower().split()
        if _ASKING.search(sentence) or (words and words[0].strip(",:") in _QUESTION_WORDS):
            return True
    return False


def classify_question(text: str, n: int = MAX_N) -> QuestionKind:
    """direct: a question naming a reviewer and a paper (asks for a score); general: any other
    question; none: not a question."""
    if not is_question(text):
        return "none"
    reviewers, papers = mentions(text, n)
    return "direct" if reviewers and papers else "general"


def asked_cell(text: str, n: int) -> tuple[int, int] | None:
    """The (reviewer, paper) a message asks about when it names exactly one of each (the rule by
    which ``scripted:shy`` answers, and matching-advice counts a question); None otherwise."""
    reviewers, papers = mentions(text, n)
    if len(reviewers) == 1 and len(papers) == 1:
        return next(iter(reviewers)), next(iter(papers))
    return None


# A stated value in a direct answer's words: "Ava Li on BLEU: 107" (scripted players answer so).
ANSWER = re.compile(r"([A-Za-z]+(?: [A-Za-z]+)?) on ([A-Za-z0-9-]+): (\d+)")


def parse_answers(text: str, n: int) -> dict[tuple[int, int], int]:
    """The values ``text`` states in answer form, by (reviewer, paper) of an n x n table; names
    outside the table are skipped."""
    reviewers = [r.casefold() for r in REVIEWERS[:n]]
    papers = [p.casefold() for p in PAPERS_SHORT[:n]]
    found = {}
    for name, paper, value in ANSWER.findall(text):
        name, paper = name.strip().casefold(), paper.strip().casefold()
        if name in reviewers and paper in papers:
            found[reviewers.index(name), papers.index(paper)] = int(value)
    return found
