"""The game interface: every registered game passes ``check_game``; broken games fail it, each
with a message naming the broken property; ``play_game`` plays through the interface; engines and
train import nothing of the game."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import itertools
import random
import subprocess
import sys
from pathlib import Path

import pytest

import selfplay
from selfplay import errors
from selfplay.engines import EngineFailure
from selfplay.game import GAMES, UnknownGameError, get_game
from selfplay.game.api import Outcome
from selfplay.game.conformance import ConformanceError, check_game
from selfplay.game.matching import MATCHING, MatchingGame
from selfplay.game.matching.turns import Game, StepResult
from selfplay.generate import play

PACKAGE = Path(selfplay.__file__).parent


@pytest.mark.parametrize("name", sorted(GAMES))
def test_registered_games_pass_check_game(name):
    check_game(GAMES[name])


def test_get_game_names_the_known_games():
    assert get_game("matching") is MATCHING
    with pytest.raises(UnknownGameError, match="unknown game 'chess'; known games: matching"):
        get_game("chess")


# --- broken games: small faults in the matching game, each caught by name --------------------


class _Rules(Game):
    """The matching rules with one fault switched on by ``fault``."""

    fault = ""

    @property
    def reward(self) -> float:
        return super().reward * (2 if self.fault == "reward" else 1)

    def step(self, seat, text):
        if self.fault == "zombie" and self.done:  # answers instead of raising GameOverError
            return StepResult(([], []), True, self.outcome, self._interpret(seat, text))
        if self.fault == "raises" and not text.lstrip().startswith("["):
            raise ValueError("cannot parse")
        if self.fault == "any seat":
            self.turn = seat
        result = super().step(seat, text)
        if self.fault == "endless" and self.outcome is Outcome.MAX_ACTIONS:
            self.outcome = None
            result = dataclasses.replace(result, done=False, outcome=None)
        if self.fault == "silent":
            result = dataclasses.replace(result, observations=(result.observations[seat], []))
        return result


class _Broken(MatchingGame):
    rules_fault = ""

    def new_game(self, scenario, *, max_actions=30, max_invalid=3):
        rules = _Rules(scenario, max_actions=max_actions, max_invalid=max_invalid)
        rules.fault = self.rules_fault
        return rules


class IgnoresLimits(_Broken):
    def new_game(self, scenario, *, max_actions=30, max_invalid=3):
        return super().new_game(scenario, max_actions=max(1, max_actions), max_invalid=max_invalid)


class StepsAfterEnd(_Broken):
    rules_fault = "zombie"


class NondeterministicScenario(_Broken):
    def new_scenario(self, seed, size):
        return super().new_scenario(random.randrange(1 << 30), size)


class SeedIgnored(_Broken):
    def new_scenario(self, seed, size):
        return super().new_scenario(0, size)


class SameIntro(_Broken):
    def intro(self, scenario, seat):
        return super().intro(scenario, 0)


class RewardAboveOne(_Broken):
    rules_fault = "reward"


class RaisesOnJunk(_Broken):
    rules_fault = "raises"


class OutOfTurn(_Broken):
    rules_fault = "any seat"


class NeverEnds(_Broken):
    rules_fault = "endless"


class PartnerNotTold(_Broken):
    rules_fault = "silent"


class UnseededPlayers(_Broken):
    seeds = itertools.count(1)

    def scripted(self, name, scenario, seat, *, seed=0):
        return super().scripted(name, scenario, seat, seed=next(self.seeds))


class NoQuestions(_Broken):
    def classify_question(self, text, scenario=None):
        return "none"


class BadLabel(_Broken):
    def classify_question(self, text, scenario=None):
        return "yes"


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (NondeterministicScenario, r"scenario: not deterministic: two draws for seed 0"),
        (SeedIgnored, r"scenario: seeds 0 and 1 give the same scenario"),
        (SameIntro, r"intro: both seats get the same intro"),
        (IgnoresLimits, r"new game: \{'max_actions': 0, 'max_invalid': 1\} accepted"),
        (StepsAfterEnd, r"after end: seat 0 could step after the end"),
        (RewardAboveOne, r"reward: \d\.\d+ is outside \[0, 1\] \(cooperative vs cooperative"),
        (RaisesOnJunk, r"invalid action: step\(0, ''\) raised ValueError: cannot parse"),
        (OutOfTurn, r"turn order: seat 1 could move out of turn"),
        (NeverEnds, r"termination: the game did not end within max_actions=30 \(\w"),
        (PartnerNotTold, r"observations: a valid action was not shown"),
        (UnseededPlayers, r"determinism: the same players with the same seeds played two"),
        (NoQuestions, r"questions: 'What is the score for .*' is 'none', expected 'direct'"),
        (BadLabel, r"questions: classify_question\(.*\) gave 'yes'"),
    ],
)
def test_check_game_catches_broken_games(broken, message):
    game = broken()
    game.name = broken.__name__
    with pytest.raises(ConformanceError, match=rf"^{broken.__name__}: {message}"):
        check_game(game)


def test_check_game_names_missing_members():
    class Empty:
        name = "empty"

    with pytest.raises(ConformanceError, match="empty: members: missing min_size, max_size"):
        check_game(Empty())


# --- the game loop and the import graph --------------------------------------------------------


class _Spy(MatchingGame):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def new_game(self, scenario, **limits):
        self.calls.append(f"new_game {limits['max_actions']} {limits['max_invalid']}")
        return super().new_game(scenario, **limits)

    def intro(self, scenario, seat):
        self.calls.append(f"intro {seat}")
        return super().intro(scenario, seat)


def test_play_game_plays_through_the_interface():
    spy = _Spy()
    scenario = spy.new_scenario(3, 4)
    seats = tuple(spy.scripted("cooperative", scenario, s, seed=s) for s in (0, 1))
    limits = {"max_actions": 20, "max_invalid": 2}
    record = asyncio.run(play.play_game(scenario, seats, game_id="g", seed=0, game=spy, **limits))
    assert spy.calls == ["new_game 20 2", "intro 0", "intro 1"]
    assert record.outcome is Outcome.ACCEPTED and 0 < record.reward <= 1


def test_engine_failure_is_one_class_wherever_it_is_imported_from():
    assert EngineFailure is errors.EngineFailure is play.EngineFailure
    assert issubclass(EngineFailure, errors.UserError)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("package", ["engines", "train"])
def test_engines_and_train_import_nothing_of_the_game(package):
    forbidden = ("selfplay.game", "selfplay.generate", "selfplay.players")
    for path in sorted((PACKAGE / package).glob("*.py")):
        bad = sorted(m for m in _imports(path) if m.startswith(forbidden))
        assert not bad, f"{path.name} imports {bad}"


def test_importing_the_engines_and_the_trainer_loads_no_game_module():
    code = (
        "import sys, selfplay.engines.openai, selfplay.engines.sglang, selfplay.train.batch\n"
        "import selfplay.train.trainer\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m.startswith(('selfplay.game', 'selfplay.generate'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_games_default_limits_are_declared_once_and_every_config_takes_them():
    """MAX_ACTIONS and MAX_INVALID (game.api) are the defaults of the game, of its rules and of
    every config with the options; no module restates the numbers."""
    import inspect
    import re

    from selfplay.evaluate.config import EvalConfig
    from selfplay.game.api import MAX_ACTIONS, MAX_INVALID
    from selfplay.generate.config import GenerateConfig
    from selfplay.iterate.config import IterateConfig
    from selfplay.iterate.warm_start import SFTConfig

    for config in (GenerateConfig, EvalConfig, IterateConfig, SFTConfig):
        assert config.model_fields["max_actions"].default == MAX_ACTIONS, config
    for config in (GenerateConfig, EvalConfig, IterateConfig):
        assert config.model_fields["max_invalid"].default == MAX_INVALID, config
    limits = inspect.signature(MATCHING.new_game).parameters
    assert (limits["max_actions"].default, limits["max_invalid"].default) == (30, 3)
    restated = re.compile(r"max_(actions|invalid)\b[^\n]*[=(:]\s*(30|3)\b")
    found = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if restated.search(line)
    ]
    assert found == [], "use selfplay.game.api.MAX_ACTIONS / MAX_INVALID"


def test_the_default_table_size_and_eval_seed_are_declared_once():
    """TABLE_SIZE (game.api) is the table size of every config that plays games and of a run's
    settings when its manifest has none; EVAL_SEED (seeds) is eval's and iterate's eval seed."""
    from selfplay.evaluate.config import EvalConfig
    from selfplay.game.api import TABLE_SIZE
    from selfplay.generate.config import GenerateConfig
    from selfplay.iterate.config import IterateConfig
    from selfplay.manifest import RunSettings
    from selfplay.seeds import EVAL_SEED

    for config in (GenerateConfig, EvalConfig, IterateConfig, RunSettings):
        assert config.model_fields["table_size"].default == TABLE_SIZE, config
    assert EvalConfig.model_fields["seed"].default == EVAL_SEED
    assert IterateConfig.model_fields["eval_seed"].default == EVAL_SEED
