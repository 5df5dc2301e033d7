"""``check_game(game)``: the conformance check every ``DialogueGame`` must pass.

In the spirit of PettingZoo's ``api_test``: it runs against any game object, plays it, and raises
``ConformanceError`` (an ``AssertionError``) whose message names the game, the broken property and
the case, e.g. ``matching: reward: 2.0 is outside [0, 1] (cooperative vs shy, seed 0, size 3)``.
Properties, each a section below: ``members``, ``scenario``, ``intro``, ``new game``,
``invalid action``, ``turn order``, ``after end``, ``fail``, ``observations``, ``outcome``,
``reward``, ``termination``, ``determinism``, ``scripted``, ``questions``. The contract itself is
written in ``selfplay.game.api``.

It only reads the game through the interface, plays scripted players in one ``asyncio.run`` per
game (so call it from synchronous code); the matching game passes in about a second.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import orjson

from selfplay.game.api import (
    MAX_ACTIONS,
    MAX_INVALID,
    QUESTION_KINDS,
    DialogueGame,
    GameOverError,
    Outcome,
    Rules,
)

MEMBERS = (
    "name",
    "min_size",
    "max_size",
    "scenario_type",
    "new_scenario",
    "new_game",
    "intro",
    "scripted_names",
    "scripted",
    "classify_question",
    "direct_question",
    "check_statements",
    "baselines",
    "heldout_baselines",
    "partner_persona",
    "human",
)
# Texts no game may accept as an action: empty, blank, control characters, symbols, 100k chars.
_SYMBOLS = string.punctuation.replace("[", "") + " "
JUNK: tuple[str, ...] = (
    "",
    " \n\t ",
    "\x00\x01\x02",
    "}{ ~~ @@ ##",
    "".join(random.Random(0).choices(_SYMBOLS, k=300)),
    "}{" * 50_000,
)


class ConformanceError(AssertionError):
    """A game broke its contract; the message names the game, the property and the case."""


def check_game(
    game: DialogueGame,
    *,
    seeds: Iterable[int] = range(3),
    sizes: Sequence[int] | None = None,
    max_actions: int = MAX_ACTIONS,
    max_invalid: int = MAX_INVALID,
) -> None:
    """Check ``game`` against the interface's contract; raise ConformanceError on the first fault.

    Scenarios are drawn for every seed and size (default: the game's smallest and largest);
    every scripted policy plays itself on each of them and every ordered pair of policies plays on
    the first seed of each size.
    """
    _check_members(game)
    seeds = list(seeds)
    if len(seeds) < 2 or max_invalid < 1 or max_actions <= max_invalid:
        raise ValueError("check_game needs two seeds or more and max_actions > max_invalid >= 1")
    sizes = list(sizes) if sizes is not None else sorted({game.min_size, game.max_size})
    names = _check_scripted_names(game)
    for size in sizes:
        scenarios = _check_scenarios(game, seeds, size)
        for seed, scenario in zip(seeds, scenarios):
            case = _Case(game, scenario, f"seed {seed}, size {size}", max_actions, max_invalid)
            _check_intro(case)
            _check_new_game(case)
            _check_invalid_actions(case)
            _check_fail(case)
            pairs = itertools.product(names, repeat=2) if seed == seeds[0] else zip(names, names)
            for pair in pairs:
                _check_scripted_play(case.playing(pair), pair, seed)
            _check_questions(case)


def _error(game: DialogueGame, prop: str, detail: str) -> ConformanceError:
    return ConformanceError(f"{getattr(game, 'name', type(game).__name__)}: {prop}: {detail}")


def _expect(ok: object, game: DialogueGame, prop: str, detail: str) -> None:
    if not ok:
        raise _error(game, prop, detail)


@dataclass(frozen=True)
class _Case:
    """One scenario under test, the limits its games are played with, and where to say it is."""

    game: DialogueGame
    scenario: Any
    where: str  # "seed 0, size 3", or "shy vs random, seed 0, size 3"
    max_actions: int
    max_invalid: int

    def new(self) -> Rules:
        return self.game.new_game(
            self.scenario, max_actions=self.max_actions, max_invalid=self.max_invalid
        )

    def playing(self, names: tuple[str, str]) -> _Case:
        where = f"{names[0]} vs {names[1]}, {self.where}"
        return _Case(self.game, self.scenario, where, self.max_actions, self.max_invalid)

    def expect(self, ok: object, prop: str, detail: str) -> None:
        _expect(ok, self.game, prop, f"{detail} ({self.where})")

    def raised(self, prop: str, e: Exception, doing: str) -> NoReturn:
        detail = f"{doing} raised {type(e).__name__}: {e} ({self.where})"
        raise _error(self.game, prop, detail) from e

    def fault(self, prop: str, detail: str) -> NoReturn:
        raise _error(self.game, prop, f"{detail} ({self.where})")


def _check_members(game: DialogueGame) -> None:
    missing = [m for m in MEMBERS if not hasattr(game, m)]
    _expect(not missing, game, "members", f"missing {', '.join(missing)}")
    _expect(isinstance(game.name, str) and game.name, game, "members", "name is not a string")
    lo, hi = game.min_size, game.max_size
    _expect(
        isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi,
        game,
        "members",
        f"sizes must be integers with 1 <= min_size <= max_size, got {lo!r}, {hi!r}",
    )


def _check_scripted_names(game: DialogueGame) -> tuple[str, ...]:
    names = tuple(game.scripted_names)
    _expect(names, game, "scripted", "no scripted players (scripted_names is empty)")
    _expect(len(set(names)) == len(names), game, "scripted", f"duplicate names in {names}")
    for member in ("baselines", "heldout_baselines"):
        rows = tuple(getattr(game, member))
        unknown = [b for b in rows if b not in names]
        _expect(rows and not unknown, game, member, f"{rows} must name scripted players {names}")
    persona = game.partner_persona
    _expect(
        persona is None or (isinstance(persona, str) and persona.strip()),
        game,
        "partner_persona",
        "must be None or a non-empty system prompt",
    )
    return names


def _check_scenarios(game: DialogueGame, seeds: list[int], size: int) -> list[Any]:
    scenarios = [game.new_scenario(seed, size) for seed in seeds]
    for seed, scenario in zip(seeds, scenarios):
        _expect(
            game.new_scenario(seed, size) == scenario,
            game,
            "scenario",
            f"not deterministic: two draws for seed {seed}, size {size} differ",
        )
        _expect(
            isinstance(scenario.id, str) and scenario.id,
            game,
            "scenario",
            f"id must be a non-empty string, got {scenario.id!r} (seed {seed})",
        )
        _check_scenario_json(game, scenario, seed)
    for (a, sa), (b, sb) in itertools.combinations(zip(seeds, scenarios), 2):
        _expect(sa != sb, game, "scenario", f"seeds {a} and {b} give the same scenario")
    return scenarios


def _check_scenario_json(game: DialogueGame, scenario: Any, seed: int) -> None:
    """A record stores the scenario as JSON and reads it back with ``scenario_type``."""
    kind = game.scenario_type
    _expect(
        isinstance(scenario, kind),
        game,
        "scenario",
        f"{type(scenario).__name__} is not the game's scenario_type {kind!r} (seed {seed})",
    )
    try:
        again = kind.model_validate(orjson.loads(orjson.dumps(scenario.model_dump(mode="json"))))
    except Exception as e:
        raise _error(
            game, "scenario", f"its JSON does not read back: {type(e).__name__}: {e} (seed {seed})"
        ) from e
    _expect(again == scenario, game, "scenario", f"its JSON reads back different (seed {seed})")


def _check_intro(c: _Case) -> None:
    intros = [c.game.intro(c.scenario, seat) for seat in (0, 1)]
    for seat, text in enumerate(intros):
        c.expect(
            isinstance(text, str) and text.strip(),
            "intro",
            f"seat {seat}'s intro is not a non-empty string",
        )
        again = c.game.intro(c.scenario, seat)
        c.expect(again == text, "intro", f"seat {seat}'s intro is not deterministic")
    c.expect(intros[0] != intros[1], "intro", "both seats get the same intro")


def _check_new_game(c: _Case) -> None:
    rules = c.new()
    c.expect(not rules.done, "new game", "a new game is already done")
    c.expect(rules.outcome is None, "new game", f"outcome {rules.outcome!r} at the start")
    c.expect(rules.turn in (0, 1), "new game", f"turn {rules.turn!r} is not 0 or 1")
    c.expect(not rules.actions, "new game", "a new game has actions")
    c.expect(rules.scenario == c.scenario, "new game", "the game does not keep its scenario")
    for limits in ({"max_actions": 0, "max_invalid": 1}, {"max_actions": 1, "max_invalid": 0}):
        try:
            c.game.new_game(c.scenario, **limits)
        except ValueError:
            continue
        c.fault("new game", f"{limits} accepted; limits below 1 must raise ValueError")


def _step(c: _Case, rules: Rules, seat: int, text: str) -> Any:
    """One step, checked against the contract for every step; returns its result."""
    before, turn, partner = len(rules.actions), rules.turn, 1 - seat
    try:
        result = rules.step(seat, text)
    except Exception as e:
        c.raised("invalid action", e, f"step({seat}, {text!r:.40})")
    obs, action = result.observations, result.action
    c.expect(
        len(obs) == 2 and all(isinstance(o, str) for seat_obs in obs for o in seat_obs),
        "observations",
        f"observations must be two lists of strings, one per seat, got {obs!r:.120}",
    )
    c.expect(
        action.seat == seat and action.text == text and len(rules.actions) == before + 1,
        "observations",
        "the step's action is not the one just taken, or was not recorded",
    )
    c.expect(
        result.done == rules.done and result.outcome == rules.outcome,
        "outcome",
        "the step result and the rules disagree on done or outcome",
    )
    c.expect(
        rules.done == (rules.outcome is not None),
        "outcome",
        f"done is {rules.done} but outcome is {rules.outcome!r}",
    )
    if action.valid:
        c.expect(obs[partner], "observations", "a valid action was not shown to the partner")
    else:
        c.expect(
            obs[seat] and not obs[partner] and action.error,
            "invalid action",
            f"{text!r:.40} must be reported (with an error) to the acting seat only",
        )
        c.expect(rules.done or rules.turn == turn, "invalid action", "it passed the turn")
    if rules.done:
        _check_end(c, rules)
    return result


def _check_end(c: _Case, rules: Rules) -> None:
    outcome, score, reward = rules.outcome, rules.score, rules.reward
    c.expect(
        isinstance(outcome, Outcome) and outcome is not Outcome.ERROR,
        "outcome",
        f"the rules ended the game with {outcome!r}; expected an Outcome other than ERROR",
    )
    c.expect(
        isinstance(reward, int | float) and 0.0 <= reward <= 1.0,
        "reward",
        f"{reward!r} is outside [0, 1]",
    )
    if outcome is Outcome.ACCEPTED:
        c.expect(
            (score == 0) == (reward == 0),
            "reward",
            f"score {score!r} and reward {reward!r} disagree",
        )
    else:
        c.expect(
            score == 0 and reward == 0,
            "reward",
            f"score {score!r}, reward {reward!r} without agreement ({outcome}); both must be 0",
        )
    before = len(rules.actions)
    for seat in (0, 1):
        try:
            rules.step(seat, "hello")
        except GameOverError:
            continue
        except Exception as e:
            c.raised("after end", e, "a step after the end (expected GameOverError)")
        c.fault("after end", f"seat {seat} could step after the end")
    c.expect(len(rules.actions) == before, "after end", "a step after the end was recorded")


def _check_invalid_actions(c: _Case) -> None:
    for text in JUNK:
        rules = c.new()
        result = _step(c, rules, rules.turn, text)
        c.expect(
            not result.action.valid,
            "invalid action",
            f"junk text {text!r:.40} was accepted as a valid action",
        )
    rules = c.new()
    other = 1 - rules.turn
    try:
        rules.step(other, JUNK[3])
    except GameOverError:
        pass
    except Exception as e:
        c.raised("turn order", e, "an out-of-turn step (expected GameOverError)")
    else:
        c.fault("turn order", f"seat {other} could move out of turn")
    c.expect(not rules.actions, "turn order", "an out-of-turn step was recorded")
    for i in range(c.max_invalid):
        c.expect(
            not rules.done,
            "invalid action",
            f"the game ended after {i} invalid actions, before max_invalid={c.max_invalid}",
        )
        _step(c, rules, rules.turn, JUNK[i % len(JUNK)])
    c.expect(
        rules.outcome is Outcome.INVALID,
        "invalid action",
        f"{c.max_invalid} invalid actions in a row ended with {rules.outcome!r}, not INVALID",
    )


def _check_fail(c: _Case) -> None:
    rules = c.new()
    rules.fail(Outcome.ERROR)
    c.expect(
        rules.done and rules.outcome is Outcome.ERROR and rules.reward == 0,
        "fail",
        "fail(ERROR) must end the game with ERROR and reward 0",
    )
    rules = c.new()
    for _ in range(c.max_invalid):
        rules.step(rules.turn, JUNK[0])
    rules.fail(Outcome.ERROR)
    c.expect(rules.outcome is Outcome.INVALID, "fail", "it overwrote a finished game's outcome")


def _check_scripted_play(c: _Case, names: tuple[str, str], seed: int) -> None:
    first = asyncio.run(_play(c, names, seed))
    again = asyncio.run(_play(c, names, seed))

    def summary(rules: Rules) -> tuple:
        return [(a.seat, a.text) for a in rules.actions], rules.outcome, rules.score, rules.reward

    c.expect(
        summary(first) == summary(again),
        "determinism",
        "the same players with the same seeds played two different games",
    )
    for action in first.actions:
        if action.valid:
            _check_label(c, action.text)


async def _play(c: _Case, names: tuple[str, str], seed: int) -> Rules:
    try:
        players = [c.game.scripted(names[s], c.scenario, s, seed=seed + s) for s in (0, 1)]
    except Exception as e:
        c.raised("scripted", e, "building the players")
    rules = c.new()
    shown = [[c.game.intro(c.scenario, 0)], [c.game.intro(c.scenario, 1)]]
    for _ in range(c.max_actions):
        if rules.done:
            break
        seat = rules.turn
        text = await players[seat].act("\n\n".join(shown[seat]))
        c.expect(isinstance(text, str), "scripted", f"act returned {text!r:.40}, not a string")
        shown[seat] = []
        result = _step(c, rules, seat, text)
        for s in (0, 1):
            shown[s].extend(result.observations[s])
    c.expect(rules.done, "termination", f"the game did not end within max_actions={c.max_actions}")
    return rules


def _check_label(c: _Case, text: str) -> str:
    label = c.game.classify_question(text, c.scenario)
    c.expect(
        label in QUESTION_KINDS,
        "questions",
        f"classify_question({text!r:.40}) gave {label!r}, not one of {QUESTION_KINDS}",
    )
    return label


def _check_questions(c: _Case) -> None:
    direct = c.game.direct_question(c.scenario)
    for text, want in ((direct, "direct"), ("What do you think?", "general"), ("Okay.", "none")):
        got = _check_label(c, text)
        c.expect(got == want, "questions", f"{text!r} is {got!r}, expected {want!r}")
    for text in JUNK:
        _check_label(c, text)
    c.expect(
        c.game.classify_question(direct) in QUESTION_KINDS,
        "questions",
        "classify_question without a scenario must still return a label",
    )
