"""A second game (tests/toy_game.py, one module) registered with one line runs through the generic
stages: conformance, the rollout path, records and their JSONL round trip, metrics, config."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from selfplay import game as game_registry
from selfplay.game.conformance import check_game
from selfplay.generate.config import GenerateConfig
from selfplay.generate.rollout import (
    Scenarios,
    Seating,
    play_plan,
    scripted_seat,
    seating,
    training_plan,
)
from selfplay.metrics import summarize
from selfplay.players.partners import ScriptedPartner
from selfplay.records import GameRecord, ReadReport, append_records, iter_game_records
from tests.toy_game import SUM, SumScenario


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(game_registry.GAMES, SUM.name, SUM)  # the one registration line
    return SUM


def test_the_second_game_passes_the_conformance_check():
    check_game(SUM, sizes=(1, 3, 5))


def _play(policy: str, partner: str, num_games: int = 6) -> list[GameRecord]:
    async def run():
        scenarios = Scenarios(3, game=SUM)
        try:
            seats = Seating(scripted_seat(policy, SUM), scripted_seat(partner, SUM))
            plan = list(training_plan(0, 0, num_games, 2))
            return await play_plan(plan, seats, scenarios, max_actions=10, max_invalid=2)
        finally:
            scenarios.close()

    return asyncio.run(run())


def test_the_rollout_path_records_and_metrics_play_the_second_game(registered, tmp_path):
    records = _play("teller", "teller")
    assert [r.game for r in records] == [SUM] * 6  # the game itself, stored as its name
    assert records[0].model_dump(mode="json")["game"] == "sum"
    assert all(isinstance(r.scenario, SumScenario) for r in records)
    assert [r.reward for r in records] == [1.0] * 6  # tellers find the exact sum
    path = tmp_path / "games.jsonl"
    append_records(path, records)
    again = list(iter_game_records(path))
    assert again == records  # the scenario reads back as the game's own type
    summary = summarize(again)
    assert summary.optimal_rate == 1.0 and summary.agreement_rate == 1.0
    assert summary.questions_per_game == 1.0  # seat 0 asks "What is your number?" once
    assert summary.direct_questions_per_game == 1.0

    guessed = summarize(_play("guesser", "teller"))
    assert guessed.questions_per_game == 0.0 and guessed.reward_mean < 1.0


def test_records_of_a_game_no_longer_registered_are_skipped_by_name(registered, tmp_path):
    path = tmp_path / "games.jsonl"
    append_records(path, _play("guesser", "guesser", num_games=2))
    del game_registry.GAMES["sum"]  # monkeypatch restores the registry after the test
    report = ReadReport()
    assert list(iter_game_records(path, report)) == []
    assert [line for line, _ in report.skipped] == [1, 2]
    assert all("unknown game 'sum'; known games: matching" in why for _, why in report.skipped)


def test_the_config_takes_the_game_and_its_sizes(registered, tmp_path):
    base = dict(out=tmp_path, num_games=2, model="m")
    assert GenerateConfig(**base, game="sum", table_size=1).game is SUM
    with pytest.raises(ValidationError, match=r"table_size\n.*the sum game's sizes are 1 to 5"):
        GenerateConfig(**base, game="sum", table_size=8)
    with pytest.raises(ValidationError, match=r"game\n.*unknown game 'chess'; known games"):
        GenerateConfig(**base, game="chess")
    assert "game" not in GenerateConfig(**base).identity()  # runs before --game still resume
    assert GenerateConfig(**base, game="sum", table_size=3).identity()["game"] == "sum"


def test_a_scripted_partner_is_one_of_the_games_own_players(registered, tmp_path):
    base = dict(out=tmp_path, num_games=2, model="m", game="sum", table_size=2)
    config = GenerateConfig(**base, partner="scripted:teller")
    assert config.partner == ScriptedPartner("teller")  # parsed once, by the config
    assert config.model_dump(mode="json")["partner"] == "teller"  # stored canonical
    assert GenerateConfig.model_validate_json(config.model_dump_json()) == config
    with pytest.raises(
        ValidationError, match=r"'shy' is not a scripted policy \(teller, guesser\)"
    ):
        GenerateConfig(**base, partner="shy")
    seats = seating(
        scripted_seat("teller", SUM), ScriptedPartner("guesser"), policy_seat=2, game=SUM
    )
    one, two = seats.players(SUM.new_scenario(0, 2), seed=0)
    assert (one.config.name, two.config.name) == ("guesser", "teller")


def test_eval_plays_a_model_and_the_games_own_baselines(registered, tiny_model):
    """selfplay eval on the second game: the model row (the tiny random model breaks the rules,
    as a game outcome), the game's scripted players as default baselines, no (matching) human
    row; iterate refuses the matching-only warm start for it."""
    from selfplay.evaluate.config import EvalConfig, ModelSpec
    from selfplay.evaluate.run import run_eval
    from selfplay.iterate.config import IterateConfig
    from selfplay.records import SamplingParams

    config = EvalConfig(
        models=(ModelSpec(label="tiny", model=str(tiny_model)),),
        game="sum",
        table_size=2,
        num_scenarios=3,
        max_actions=6,
        max_invalid=2,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=8),
        device="cpu",
    )
    assert config.baselines == ("teller", "guesser")
    with pytest.raises(ValidationError, match="'cooperative' is not a scripted policy; choose"):
        EvalConfig.model_validate({**config.model_dump(), "baselines": ("cooperative",)})
    result = run_eval(config)
    rows = {r.name: r for r in result.rows}
    assert set(rows) == {"tiny", "teller", "guesser"}
    assert rows["teller"].reward_mean == 1.0 and rows["teller"].games == 3
    assert rows["tiny"].games == 3 and rows["tiny"].outcomes.get("invalid") == 3
    with pytest.raises(ValidationError, match=r"warm_start\n.*NAME one of teller, guesser"):
        IterateConfig(
            name="r", iterations=1, model="m", engine={"kind": "hf", "model": "m"},
            game="sum", table_size=2, warm_start="scripted:cooperative:8",
        )  # fmt: skip


def test_the_second_game_gets_teacher_games_and_a_warm_start(registered, tiny_model, tmp_path):
    """Teacher games play through the rollout path for any game: sft's rows of the sum game's
    scripted teller, and iterate takes it as a warm start."""
    from selfplay.iterate.config import IterateConfig
    from selfplay.iterate.warm_start import SFTConfig, build_rows
    from selfplay.players.llm import load_chat_format
    from selfplay.records import iter_game_records

    cfg = SFTConfig(
        model=str(tiny_model), out=tmp_path / "sft", game="sum", table_size=2,
        teacher="scripted:teller:3,scripted:guesser:2", max_length=512,
    )  # fmt: skip
    _, sources = build_rows(cfg, load_chat_format(str(tiny_model)))
    records = list(iter_game_records(cfg.data_dir / "games.jsonl"))
    assert [r.game.name for r in records] == ["sum"] * 5
    assert [r.seats[0].name for r in records] == ["teller"] * 3 + ["guesser"] * 2
    assert len({r.scenario_id for r in records}) == 5  # the second source starts where one ended
    assert sources == {"teacher scripted:teller": 6, "teacher scripted:guesser": 4}
    with pytest.raises(ValidationError, match="the sum game has no recorded human games"):
        SFTConfig(model="m", out=tmp_path, game="sum", table_size=2, human_data=tmp_path)
    run = IterateConfig(
        name="r", iterations=1, model="m", engine={"kind": "hf", "model": "m"},
        game="sum", table_size=2, warm_start="scripted:teller:8",
    )  # fmt: skip
    assert run.warm_start == "scripted:teller:8"
