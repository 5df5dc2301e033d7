"""What a model learned, read from held-out games: the panel every run report shows.

Reward alone cannot tell a model that decides when asking pays from one that copies a scripted
player or asks unconditionally. From the games files of one held-out split (the model's, the
model it started from, every scripted baseline's, all on the same scenarios) the panel gives:

- **paired differences**: the model's reward minus the start's and minus every baseline's,
  paired by scenario (95% t-interval), the strongest non-asking policy (``proposer``) included;
- **behaviour identity**: "plays like X in K of N games": games whose actions (seat, kind, text
  or proposal) equal X's on the same scenario, for the start and every baseline;
- **when it asks**: each scenario's value of asking (an asking scripted player's reward minus
  ``proposer``'s there; ``ASKERS``), and the model's first decision (ask or propose), its
  probability of asking on the first turn (``first_decision``) and questions per game in the
  scenarios where asking pays against those where it does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from selfplay.evaluate.compare import CompareError, games_set, paired
from selfplay.metrics import questions_by_seat
from selfplay.records import GameRecord, iter_game_records

PROPOSER = "proposer"  # the strongest non-asking scripted policy
# the asking scripted policy whose gain over PROPOSER is "asking pays": the first of these among
# the baselines (advised-asker where the game shows advice, which it copies; else inquisitive)
ASKERS = ("advised-asker", "inquisitive")


@dataclass(frozen=True)
class AskingSplit:
    """The model's asking where asking pays (first of each pair) and where it does not."""

    scenarios: tuple[int, int]
    first_asks: tuple[float, float]  # share of games whose model seat asks before proposing
    questions: tuple[float, float]  # the model seat's questions per game
    p_ask: tuple[float, float]  # mean first-turn probability of asking (nan: no tokenizer)


_TOKENIZERS: dict[str, object] = {}


def _tokenizer(path: str):
    """The tokenizer of a seat's model (its path in the record), or None where it is not here."""
    if path not in _TOKENIZERS:
        try:
            from transformers import AutoTokenizer

            _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
        except Exception:  # a model of another machine, or an API name: no probabilities
            _TOKENIZERS[path] = None
    return _TOKENIZERS[path]


def first_decision(game: GameRecord, tokenizer=None) -> float | None:
    """The model seat's probability of asking on its first turn: the action tag it generated
    first ("[message]" or "[propose]") has probability p, the product of its tokens'
    behaviour probabilities up to the one that closes the tag; p(ask) is p after "[message]",
    1 - p after "[propose]" (the two tags are the first turn's choices; a greedy model's p is
    the probability of the choice it made). None without tokens, a tokenizer or a tag."""
    seat = _model_seat(game)
    tokens = game.tokens[seat]
    tokenizer = tokenizer or (_tokenizer(game.seats[seat].name) if tokens else None)
    if tokens is None or tokenizer is None or 1 not in tokens.mask:
        return None
    start = tokens.mask.index(1)
    end = start
    while end < len(tokens.mask) and tokens.mask[end] == 1:
        end += 1
    for stop in range(start + 1, min(end, start + 8) + 1):
        text = tokenizer.decode(tokens.token_ids[start:stop]).strip().lower()
        if "]" in text:
            p = math.exp(sum(tokens.logprobs[start:stop]))
            if text.startswith("[message]"):
                return p
            if text.startswith("[propose]"):
                return 1.0 - p
            return None
    return None


def _by_scenario(games: list[GameRecord]) -> dict[str, GameRecord]:
    return {g.scenario_id: g for g in games}


def _moves(game: GameRecord) -> list[tuple]:
    return [
        (a.seat, a.kind, tuple(map(tuple, a.proposal)) if a.proposal else a.text.strip())
        for a in game.actions
    ]


def identity(model: dict[str, GameRecord], other: dict[str, GameRecord]) -> tuple[int, int]:
    """(games played action for action like ``other``, scenarios both played)."""
    common = model.keys() & other.keys()
    return sum(_moves(model[s]) == _moves(other[s]) for s in common), len(common)


def _model_seat(game: GameRecord) -> int:
    trained = [i for i, t in enumerate(game.tokens) if t is not None]
    return trained[0] if trained else 0


def first_asks(game: GameRecord) -> bool:
    """Whether the model's seat asks a question before its first proposal."""
    seat = _model_seat(game)
    for a in game.actions:
        if a.seat != seat or not a.valid:
            continue
        if a.kind == "propose":
            return False
        if a.kind == "message" and "?" in a.text:
            return True
    return False


def asking_split(
    model: dict[str, GameRecord], proposer: dict[str, GameRecord], asker: dict[str, GameRecord]
) -> AskingSplit | None:
    """The model's asking split by each scenario's value of asking (``asker`` minus
    ``proposer``); None without scenarios common to the three."""
    common = sorted(model.keys() & proposer.keys() & asker.keys())
    if not common:
        return None
    pays = [s for s in common if asker[s].reward - proposer[s].reward > 1e-9]
    rest = [s for s in common if s not in set(pays)]

    def share(ids: list[str]) -> float:
        return sum(first_asks(model[s]) for s in ids) / len(ids) if ids else float("nan")

    def questions(ids: list[str]) -> float:
        if not ids:
            return float("nan")
        return sum(questions_by_seat(model[s])[_model_seat(model[s])] for s in ids) / len(ids)

    def p_ask(ids: list[str]) -> float:
        ps = [p for s in ids if (p := first_decision(model[s])) is not None]
        return sum(ps) / len(ps) if ps else float("nan")

    return AskingSplit(
        (len(pays), len(rest)),
        (share(pays), share(rest)),
        (questions(pays), questions(rest)),
        (p_ask(pays), p_ask(rest)),
    )


def panel(model: Path, start: Path | None, baselines: dict[str, Path], split: str) -> list[str]:
    """The panel as Markdown lines, for the ``model`` games file beside ``start``'s and the
    baselines' (name -> games file) on one held-out ``split``; sets not on disk are left out."""
    if not model.is_file():
        return []
    others = {"start": start} if start is not None else {}
    others |= {f"scripted {k}": v for k, v in sorted(baselines.items())}
    others = {k: v for k, v in others.items() if v is not None and v.is_file()}
    read: dict[Path, list[GameRecord]] = {}

    def records(path: Path) -> list[GameRecord]:
        """A games file's records, read once (the pairing, the identity and the asking split
        each use them)."""
        if path not in read:
            read[path] = list(iter_game_records(path))
        return read[path]

    mine = games_set(records(model), model, "final")
    games = _by_scenario(records(model))
    md = [
        f"### What the model learned ({split} split)",
        "",
        "| final minus | scenarios | paired difference [95% CI] | plays like it |",
        "|---|---|---|---|",
    ]
    for label, path in others.items():
        try:
            d = paired(games_set(records(path), path, label), mine)
        except CompareError:
            continue
        same, n = identity(games, _by_scenario(records(path)))
        md.append(
            f"| {label} | {d.scenarios} | {d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}] "
            f"| {same} of {n} games |"
        )
    asker = next((a for a in ASKERS if a in baselines), None)
    if PROPOSER in baselines and asker is not None:
        p, a = baselines[PROPOSER], baselines[asker]
        split_ = (
            asking_split(games, _by_scenario(records(p)), _by_scenario(records(a)))
            if p.is_file()
            else None
        )
        if split_ is not None and a.is_file():
            (np_, nn), (fp, fn) = split_.scenarios, split_.first_asks
            (qp, qn), (pp, pn) = split_.questions, split_.p_ask
            md += [
                "",
                f"When it asks: asking pays (scripted {asker} above {PROPOSER}) in {np_} "
                f"scenarios and not in {nn}.",
                "",
                "| scenarios | first decision is a question | p(ask) on the first turn "
                "| questions per game |",
                "|---|---|---|---|",
                f"| asking pays ({np_}) | {fp:.2f} | {pp:.2f} | {qp:.2f} |",
                f"| asking does not pay ({nn}) | {fn:.2f} | {pn:.2f} | {qn:.2f} |",
            ]
    return [*md, ""]
