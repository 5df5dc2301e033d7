"""Objects, not names: a config or record validates its ``game`` and ``partner`` once, into the
game and the partner spec, and stores them back as the names they were given as (child processes,
manifests and games.jsonl still read them). Past the CLI and the configs nothing looks them up
again."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from selfplay.game.matching import MATCHING, MATCHING_ADVICE, MATCHING_LINES
from selfplay.generate.config import GenerateConfig, GenerateOptions
from selfplay.manifest import RunSettings
from selfplay.players.partners import OpenAIPartner, ScriptedPartner, SelfPlay
from selfplay.records import known_game

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "selfplay"
# where a name may still become an object: the registry and the partner parser themselves, and
# the CLI that reads the user's text
RESOLVERS = ("game/", "players/", "cli.py", "commands/")
LOOKUP = re.compile(r"\b(get_game|lookup_game|parse_partner)\(")


def _config(tmp_path: Path, **fields) -> GenerateConfig:
    return GenerateConfig(out=tmp_path, num_games=2, model="m", **fields)


def test_the_game_field_holds_the_game_and_stores_its_name(tmp_path):
    config = _config(tmp_path, game="matching-lines", table_size=3)
    assert config.game is MATCHING_LINES
    assert _config(tmp_path).game is MATCHING  # the default is a game too, not a name
    assert config.model_dump()["game"] == "matching-lines"  # python mode too: child configs
    assert config.model_dump(mode="json")["game"] == "matching-lines"
    assert GenerateConfig.model_validate_json(config.model_dump_json()) == config
    assert _config(tmp_path, game=MATCHING_LINES, table_size=3) == config  # the object passes


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("chess", "unknown game 'chess'; known games: matching"),
        (3, "a game is named by a string (matching"),
    ],
)
def test_a_bad_game_is_refused_on_the_game_field(tmp_path, value, said):
    with pytest.raises(ValidationError) as e:
        _config(tmp_path, game=value)
    first = e.value.errors()[0]
    assert first["loc"] == ("game",) and said in first["msg"]


@pytest.mark.parametrize(
    ("text", "spec", "stored"),
    [
        (None, SelfPlay(), None),
        ("self", SelfPlay(), None),
        ("scripted:shy", ScriptedPartner("shy"), "shy"),
        ("shy", ScriptedPartner("shy"), "shy"),
        ("openai:gpt-4.1", OpenAIPartner("gpt-4.1"), "openai:gpt-4.1"),
    ],
)
def test_the_partner_field_holds_the_spec_and_stores_its_canonical_text(
    tmp_path, text, spec, stored
):
    config = _config(tmp_path, partner=text)
    assert config.partner == spec
    assert config.model_dump(mode="json")["partner"] == stored
    assert GenerateConfig.model_validate_json(config.model_dump_json()).partner == spec


def test_a_partner_is_parsed_against_the_configs_own_game(tmp_path):
    # matching-advice has scripted players matching has not, and the other way round none
    advised = _config(tmp_path, game="matching-advice", table_size=3, partner="advised")
    assert advised.game is MATCHING_ADVICE and advised.partner == ScriptedPartner("advised")
    with pytest.raises(ValidationError) as e:
        _config(tmp_path, partner="scripted:nobody")
    first = e.value.errors()[0]
    assert first["loc"] == ("partner",) and "'nobody' is not a scripted policy" in first["msg"]
    with pytest.raises(ValidationError, match="--policy-seat 2 needs a --partner"):
        _config(tmp_path, policy_seat=2)  # checked on the spec: self-play


def test_a_record_holds_its_game_and_the_fast_reader_checks_the_name_the_same_way():
    assert known_game({"game": "matching-advice"}) == "matching-advice"
    assert known_game({}) == "matching"  # schema 1: the matching game's
    assert known_game({"game": "chess"}) is None and known_game({"game": 3}) is None


def test_every_published_manifest_reads_its_game_and_partner_back_as_they_were():
    manifests = sorted((ROOT / "docs" / "runs").glob("*/manifest.json"))
    assert manifests, "docs/runs holds the published runs' manifests"
    for path in manifests:
        config = json.loads(path.read_text())["config"]
        settings = RunSettings.model_validate(config)
        assert settings.game.name == config.get("game", "matching"), path
        keys = ("game", "partner", "policy_seat", "table_size")
        options = GenerateOptions.model_validate({k: config[k] for k in keys if k in config})
        dumped = options.model_dump(mode="json")
        assert (dumped["game"], dumped["partner"]) == (
            config.get("game", "matching"),
            config.get("partner"),
        ), path
    assert RunSettings().game is MATCHING  # a manifest from before --game


def test_nothing_past_the_cli_and_the_configs_looks_a_name_up_again():
    found = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if not str(path.relative_to(PACKAGE)).startswith(RESOLVERS)
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if LOOKUP.search(line)
    ]
    assert found == [], "use config.game / config.partner, the objects:\n" + "\n".join(found)
