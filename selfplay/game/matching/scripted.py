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

The players live in a module per family (``scripted_share``, ``scripted_shy``, ``scripted_ask``),
what they share in ``scripted_base``; this module names them (``make_scripted``) and re-exports
the names other modules use.
"""

from __future__ import annotations

from selfplay.game.matching.rules import Scenario
from selfplay.game.matching.scripted_ask import (
    Advised,
    AdvisedAsker,
    AdvisedLateAsker,
    Asker,
    Inquisitive,
    LateAsker,
    Picker,
    Proposer,
)
from selfplay.game.matching.scripted_base import (
    NOTHING_LEFT,
    PICKS,
    ScriptedPlayer,
    format_picks,
    format_values,
    greedy_picks,
    parse_picks,
    parse_values,
    partner_events,
)
from selfplay.game.matching.scripted_share import Cooperative, Explainer, NoTalk, RandomPlayer
from selfplay.game.matching.scripted_shy import Shy, ShyStrict

__all__ = [
    "NOTHING_LEFT",
    "PICKS",
    "SCRIPTED_NAMES",
    "Advised",
    "AdvisedAsker",
    "AdvisedLateAsker",
    "Asker",
    "Cooperative",
    "Explainer",
    "Inquisitive",
    "LateAsker",
    "NoTalk",
    "Picker",
    "Proposer",
    "RandomPlayer",
    "ScriptedPlayer",
    "Shy",
    "ShyStrict",
    "format_picks",
    "format_values",
    "greedy_picks",
    "make_scripted",
    "parse_picks",
    "parse_values",
    "partner_events",
]

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
