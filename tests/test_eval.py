"""`selfplay eval`: held-out seed spaces, the table, determinism, failures, cross-play, --run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from typer.testing import CliRunner

from selfplay.cli import app
from selfplay.evaluate.config import EvalConfig, EvalError, EvalResult, ModelSpec, load_result
from selfplay.evaluate.human import human_reference
from selfplay.evaluate.run import run_models
from selfplay.game.matching import MATCHING
from selfplay.players.partners import ScriptedPartner
from selfplay.seeds import eval_scenario_seed, scenario_seed

TESTS = Path(__file__).resolve().parent

WORDS = st.integers(min_value=0, max_value=2**64 - 1)
# small and fast: 3x3 tables, short games, short actions
FAST = ["--table-size", "3", "--max-actions", "6", "--max-new-tokens", "40"]
ROW_KEYS = {
    "name",
    "kind",
    "seat0",
    "seat1",
    "model",
    "error",
    "source",
    "games",
    "reward_mean",
    "reward_ci_low",
    "reward_ci_high",
    "reward_std",
    "agreement_rate",
    "mean_actions",
    "mean_words",
    "invalid_action_rate",
    "optimal_rate",
    "same_proposal_share",
    "stated_value_accuracy",
    "questions_per_game",
    "direct_questions_per_game",
    "general_questions_per_game",
    "outcomes",
    "seconds",
}


# --- seed spaces ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(seed=WORDS, round=WORDS, index=WORDS, eval_seed=WORDS, eval_index=WORDS)
def test_held_out_seeds_never_coincide_with_training_seeds(
    seed, round, index, eval_seed, eval_index
):
    train = scenario_seed(seed, round, index)
    held_out = eval_scenario_seed(eval_seed, eval_index)
    assert train % 2 == 0 and held_out % 2 == 1
    assert train != held_out
    assert 0 <= train < 2**64 and 0 <= held_out < 2**64


def test_seed_spaces_are_disjoint_sets_and_spread():
    train = {scenario_seed(s, r, i) for s in range(3) for r in range(4) for i in range(200)}
    held_out = {eval_scenario_seed(s, i) for s in range(3) for i in range(2000)}
    assert len(train) == 3 * 4 * 200 and len(held_out) == 3 * 2000  # no collisions inside
    assert not train & held_out
    assert eval_scenario_seed(7, 0) == eval_scenario_seed(7, 0) != eval_scenario_seed(8, 0)


# --- config -----------------------------------------------------------------------------------


def _cfg(**kw) -> EvalConfig:
    return EvalConfig(models=(ModelSpec(label="m", model="m"),), **kw)


@pytest.mark.parametrize(
    ("kwargs", "field", "text"),
    [
        ({"games_per_scenario": 4}, "games_per_scenario", "temperature above 0"),
        ({"partner": "greedy"}, "partner", "not a scripted policy"),
        ({"partner_key_env": "sk-not-a-name!"}, "partner_key_env", "NAME of an environment"),
        ({"policy_seat": 2}, "policy_seat", "needs a --partner"),
        ({"baselines": ("cooperative", "nope")}, "baselines", "not a scripted policy"),
        ({"cross_play": True}, "cross_play", "at least two models"),
        ({"num_scenarios": 0}, "num_scenarios", "greater than or equal to 1"),
        ({"human_data": Path("/no/such/file.jsonl")}, "human_data", "does not exist"),
    ],
)
def test_config_errors_name_the_field(kwargs, field, text):
    with pytest.raises(ValidationError) as info:
        _cfg(**kwargs)
    message = str(info.value)
    assert field in message and text in message


def test_sampled_games_per_scenario_and_cross_play_partner():
    from selfplay.records import SamplingParams

    cfg = _cfg(games_per_scenario=3, sampling=SamplingParams(temperature=0.7))
    assert cfg.games_per_scenario == 3
    two = (ModelSpec(label="a", model="a"), ModelSpec(label="b", model="b"))
    with pytest.raises(ValidationError, match="drop the partner"):
        EvalConfig(models=two, cross_play=True, partner="cooperative")
    with pytest.raises(ValidationError, match="repeated: a"):
        EvalConfig(models=(two[0], two[0]))


# --- the human reference ----------------------------------------------------------------------


def test_human_reference_from_the_data(human_games, monkeypatch):
    monkeypatch.delenv("SELFPLAY_HUMAN_DATA", raising=False)
    row = human_reference(MATCHING)
    assert row.games == 134
    assert row.reward_mean == pytest.approx(0.921, abs=0.001)
    assert row.reward_ci_low < row.reward_mean < row.reward_ci_high
    assert row.agreement_rate == 1.0
    assert row.questions_per_game == pytest.approx(
        row.direct_questions_per_game + row.general_questions_per_game
    )
    assert row.direct_questions_per_game > 0
    assert "computed from 134 human games" in row.source


def test_the_human_games_ship_with_the_package(tmp_path, monkeypatch):
    """The default is the packaged copy (with its licence), whatever lies beside the project: the
    reference loads with no ../shared folder; `sft --human-data packaged` reads the same file."""
    import selfplay
    from selfplay.iterate.warm_start import SFTConfig

    monkeypatch.delenv("SELFPLAY_HUMAN_DATA", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing of the repository around
    default = MATCHING.human.default_path
    package = Path(selfplay.__file__).resolve().parent
    assert default.is_relative_to(package) and "shared" not in default.parts
    assert (
        (default.parent / "LICENSE.md")
        .read_text()
        .startswith("# Community Data License Agreement - Permissive - Version 2.0")
    )
    row = human_reference(MATCHING)
    assert row.games == 134 and f"computed from 134 human games in {default}" in row.source
    assert row.name == "humans (8x8)" and MATCHING.human.table_size == 8
    cfg = SFTConfig(model="m", out=tmp_path / "m", human_data="packaged")
    assert cfg.human_data == default


def test_the_human_row_compares_only_with_its_table_size():
    from selfplay.evaluate.human import comparable

    assert comparable(MATCHING, 8) and not comparable(MATCHING, 3)


def test_human_reference_without_data_is_the_stored_constant(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFPLAY_HUMAN_DATA", str(tmp_path / "missing.jsonl"))
    row = human_reference(MATCHING)
    assert row.reward_mean == MATCHING.human.reference == 0.921
    assert "stored constant" in row.source and "134 human games of DialOp" in row.source


# --- the command ------------------------------------------------------------------------------


def _eval(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["eval", *args])
    return result.exit_code, result.output.replace("\n", "")  # undo rich's line wrapping


def _load(out: Path) -> EvalResult:
    return load_result(out / "eval.json")


def _table(result: EvalResult) -> list[dict]:
    return [r.model_dump(exclude={"seconds"}) for r in result.rows]


def _games(out: Path) -> dict[str, list[dict]]:
    """Every game written, without its timings and its log-probs (``_logprobs``)."""
    games = {}
    for path in sorted((out / "games").glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for r in rows:
            r.pop("timings")
            for seat in r["tokens"]:
                if seat is not None:
                    seat.pop("logprobs")
        games[path.name] = rows
    return games


def _logprobs(out: Path, name: str = "*.jsonl") -> list[float]:
    """Every log-prob written (in the game files matching ``name``), in file, game, seat order."""
    values = []
    for path in sorted((out / "games").glob(name)):
        for line in path.read_text().splitlines():
            for seat in json.loads(line)["tokens"]:
                values.extend([] if seat is None else seat["logprobs"])
    return values


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> Path:
    """A second tiny random model (other weights, same tokenizer recipe): a 'later round'."""
    from selfplay.game.matching.prompts import tokenizer_corpus
    from selfplay.models import build_tiny_model

    out = tmp_path_factory.mktemp("models") / "tiny_seed1"
    return build_tiny_model(out, corpus=tokenizer_corpus(), seed=1)


@pytest.mark.parametrize(
    ("which", "sampling"),
    [
        ("primed_model", []),  # greedy: the primed model writes whole (often invalid) proposals
        ("tiny_model", ["--temperature", "1.0", "--games-per-scenario", "2"]),
    ],
    ids=["greedy", "sampled"],
)
def test_eval_twice_gives_the_same_table(which, sampling, tmp_path, request):
    model_dir = request.getfixturevalue(which)
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        code, output = _eval(
            "--models", str(model_dir), "--num-scenarios", "5", "--baselines", "random",
            *FAST, *sampling, "--out", str(out),
        )  # fmt: skip
        assert code == 0, output
    a, b = _load(outs[0]), _load(outs[1])
    assert _table(a) == _table(b)
    games = _games(outs[0])
    assert games == _games(outs[1])  # token for token, not only the averages
    # the log-probs as well, up to float rounding: two runs may batch the games differently or
    # reuse a cached prefix, which moves the 7th digit (as ENGINE_RESUMABLE says)
    first, second = (_logprobs(out) for out in outs)
    assert len(first) > 0
    np.testing.assert_allclose(first, second, rtol=0, atol=1e-4)
    per = 2 if sampling else 1
    model = a.row(str(model_dir), "model")
    assert model.error is None and model.games == 5 * per
    assert sum(model.outcomes.values()) == 5 * per
    assert model.mean_words is not None and model.reward_mean is not None
    # every game is on a held-out (odd) scenario seed, the same set for every row
    assert a.scenario_seeds == [eval_scenario_seed(7, i) for i in range(5)]
    for rows in games.values():
        assert sorted(r["scenario"]["seed"] for r in rows) == sorted(a.scenario_seeds * per)
    model_games = next(v for k, v in games.items() if k.startswith("model-"))
    temps = {s["sampling"]["temperature"] for r in model_games for s in r["seats"]}
    assert temps == ({1.0} if sampling else {0.0})
    texts = [tuple(a["text"] for a in r["actions"]) for r in model_games]
    assert any(t.strip() for game in texts for t in game)  # the model did say something
    if sampling:  # the two seeded games of a scenario differ: the engine honours the seeds
        assert any(texts[i] != texts[i + 1] for i in range(0, len(texts), 2))


def test_eval_writes_documented_outputs(tiny_model, tmp_path):
    out = tmp_path / "ev"
    code, output = _eval(
        "--models", str(tiny_model), "--partner", "cooperative", "--num-scenarios", "3",
        *FAST, "--max-actions", "12", "--out", str(out),
    )  # fmt: skip
    assert code == 0, output
    data = json.loads((out / "eval.json").read_text())
    assert set(data) == {
        "schema_version",
        "config",
        "scenario_seeds",
        "rows",
        "cross_play",
        "errors",
        "seconds",
    }
    assert data["cross_play"] is None and data["errors"] == {}
    kinds = [(r["name"], r["kind"]) for r in data["rows"]]
    assert kinds == [
        (str(tiny_model), "model"),
        ("cooperative", "baseline"),
        ("no-talk", "baseline"),
        ("proposer", "baseline"),
        ("random", "baseline"),
    ]  # no human row: the humans played 8x8 tables, not 3x3
    for row in data["rows"]:
        assert set(row) == ROW_KEYS
    model = data["rows"][0]
    assert (model["seat0"], model["seat1"]) == (str(tiny_model), "cooperative")
    # the random tiny model writes garbage: its moves are invalid, and that is in the table
    assert model["invalid_action_rate"] > 0.5 and model["reward_mean"] == 0.0
    # baselines play seat 1 against the same partner, on the same scenarios
    coop = data["rows"][1]
    assert (coop["seat0"], coop["seat1"]) == ("cooperative", "cooperative")
    assert coop["agreement_rate"] > 0 and coop["reward_mean"] > 0.3
    assert coop["invalid_action_rate"] == 0.0
    md = (out / "eval.md").read_text()
    assert "human" not in md and "reward [95% CI]" in md and "![reward](reward.png)" in md
    assert "of the **dev split**" in md  # every published figure names its split
    assert (out / "reward.png").stat().st_size > 1000
    assert not (out / "cross_play.png").exists()
    assert "held-out scenarios" in output and "eval.json" in output  # table and files
    # eval.json reads back typed: its config is the EvalConfig it ran with
    result = load_result(out / "eval.json")
    assert isinstance(result.config, EvalConfig) and result.config.max_actions == 12
    assert result.config.partner == ScriptedPartner("cooperative")
    assert result.rows[0].name == str(tiny_model)


def test_an_older_eval_json_still_reads(tmp_path):
    # written by an earlier version: its human data is gone, one config field no longer exists
    config = EvalConfig(models=(ModelSpec(label="m", model="m"),), num_scenarios=2)
    data = EvalResult(config=config, scenario_seeds=[1, 3], rows=[]).model_dump(mode="json")
    data["config"]["human_data"] = str(tmp_path / "moved" / "optimization.jsonl")
    data["config"]["retired_option"] = 1
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(data))
    result = load_result(path)
    assert result.config.num_scenarios == 2 and result.scenario_seeds == [1, 3]
    assert result.config.human_data == tmp_path / "moved" / "optimization.jsonl"
    # a new config still refuses a human-data path that is not there
    with pytest.raises(ValueError, match="does not exist"):
        EvalConfig(models=config.models, human_data=tmp_path / "moved" / "optimization.jsonl")
    data["config"]["num_scenarios"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(EvalError, match="num_scenarios"):
        load_result(path)


def test_policy_seat_2_puts_the_partner_first(tiny_model, tmp_path):
    out = tmp_path / "ev2"
    code, output = _eval(
        "--models", str(tiny_model), "--partner", "scripted:shy", "--policy-seat", "2",
        "--num-scenarios", "2", "--baselines", "no-talk", *FAST, "--max-actions", "6",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, output
    rows = {r.name: r for r in _load(out).rows}
    model = next(r for r in rows.values() if r.kind == "model")
    assert (model.seat0, model.seat1) == ("shy", model.name)
    assert (rows["no-talk"].seat0, rows["no-talk"].seat1) == ("shy", "no-talk")
    for name, games in _games(out).items():
        for g in games:
            assert g["seats"][0]["name"] == "shy"
            assert g["actions"][0]["seat"] == 0  # the partner moves first
            if name.startswith("model"):
                assert g["seats"][1]["kind"] == "llm" and g["tokens"][0] is None


def test_api_partner_in_eval_gets_the_persona_and_the_key_stays_out(
    tiny_model, tmp_path, monkeypatch
):
    from tests.chat_standin import ChatStandIn

    secret = "sk-test-very-secret-0123456789"
    monkeypatch.setenv("STANDIN_KEY", secret)
    out = tmp_path / "ev-api"
    with ChatStandIn() as standin:
        code, output = _eval(
            "--models", str(tiny_model), "--partner", "openai:standin-model",
            "--policy-seat", "2", "--partner-base-url", standin.url,
            "--partner-key-env", "STANDIN_KEY", "--num-scenarios", "2",
            "--baselines", "no-talk", *FAST, "--out", str(out),
        )  # fmt: skip
        asked = standin.answered
    assert code == 0, output
    assert asked, "the API partner was never asked"
    first = asked[0]["body"]["messages"]
    assert first[0] == {"role": "system", "content": MATCHING.partner_persona}
    assert asked[0]["headers"].get("authorization") == f"Bearer {secret}"
    rows = {r.name: r for r in _load(out).rows}
    assert rows["no-talk"].seat0 == "openai:standin-model"
    for path in out.rglob("*"):
        if path.is_file():
            assert secret not in path.read_text(errors="ignore"), path


def test_a_model_that_cannot_load_is_named_and_the_rest_still_run(tiny_model, tmp_path):
    missing = tmp_path / "no-such-model"
    out = tmp_path / "ev"
    code, output = _eval(
        "--models", f"{missing},{tiny_model}", "--num-scenarios", "2", "--baselines", "",
        *FAST, "--out", str(out),
    )  # fmt: skip
    assert code == 0, output  # one model worked: not a failed evaluation
    result = _load(out)
    bad = result.row(str(missing))
    assert (
        bad.error is not None and str(missing) in bad.error and "could not be loaded" in bad.error
    )
    assert bad.reward_mean is None and bad.games == 0
    assert result.errors == {str(missing): bad.error}
    good = result.row(str(tiny_model))
    assert good.error is None and good.games == 2
    assert "could not be loaded" in output and str(missing) in output
    assert "## Errors" in (out / "eval.md").read_text()


def test_every_model_failing_exits_1_after_writing_the_rest(tmp_path):
    out = tmp_path / "ev"
    code, _ = _eval(
        "--models", str(tmp_path / "nope"), "--num-scenarios", "2", "--table-size", "8",
        "--baselines", "no-talk", "--out", str(out),
    )  # fmt: skip
    assert code == 1
    result = _load(out)
    # 8x8, the humans' size: their row is there, named with it
    assert result.row("no-talk").games == 2 and result.row("humans (8x8)").reward_mean > 0.9
    assert "nope" in result.row(str(tmp_path / "nope")).error


def test_cross_play_of_a_run(tiny_model, other_model, tmp_path):
    from selfplay.manifest import Manifest, RoundRecord, StageRecord

    stage = StageRecord(finished_at=0.0, seconds=0.0, artifacts={"model": str(other_model)})
    manifest = Manifest(
        name="r",
        config={"model": str(tiny_model)},
        created_at=0.0,
        versions={},
        git_commit=None,
        rounds={0: RoundRecord(model=str(tiny_model), stages={"train": stage})},
    )
    (tmp_path / "data" / "r").mkdir(parents=True)
    (tmp_path / "data" / "r" / "manifest.json").write_text(manifest.model_dump_json())
    specs = run_models("r", tmp_path / "data")
    assert [(s.label, s.model) for s in specs] == [
        ("initial", str(tiny_model)),
        ("round_0", str(other_model)),
    ]
    started = time.perf_counter()
    code, output = _eval(
        "--run", "r", "--data-root", str(tmp_path / "data"), "--cross-play",
        "--num-scenarios", "3", "--baselines", "", *FAST,
    )  # fmt: skip
    assert code == 0, output
    out = tmp_path / "data" / "r" / "eval"
    result = _load(out)
    cp = result.cross_play
    assert cp is not None and cp.models == ["initial", "round_0"]
    assert [[g > 0 for g in row] for row in cp.games] == [[True, True], [True, True]]
    assert cp.reward[1][1] == result.row("round_0", "model").reward_mean
    assert cp.reward[0][1] == result.row("initial + round_0", "cross").reward_mean
    for i, label in enumerate(cp.models):
        others = [cp.reward[i][1 - i], cp.reward[1 - i][i]]
        assert cp.cross_play_mean[label] == pytest.approx(sum(others) / 2)
        assert cp.gap[label] == pytest.approx(cp.reward[i][i] - cp.cross_play_mean[label])
    assert (out / "cross_play.png").stat().st_size > 1000
    assert "## Cross-play" in (out / "eval.md").read_text()
    assert time.perf_counter() - started < 120


def test_run_without_manifest_is_a_clear_error(tmp_path):
    code, output = _eval("--run", "ghost", "--data-root", str(tmp_path))
    assert code == 1
    assert "manifest.json does not exist" in output and "selfplay iterate" in output


def test_cli_option_errors(tmp_path):
    code, output = _eval("--models", "m", "--players", "cooperative,cooperative")
    assert code == 1 and "--partner and --num-scenarios" in output
    code, output = _eval("--models", "m", "--games-per-scenario", "2", "--out", str(tmp_path))
    assert code == 1 and "--games-per-scenario" in output and "temperature" in output
    code, output = _eval("--models", "m", "--partner", "greedy", "--out", str(tmp_path))
    assert code == 1 and "--partner" in output
    code, output = _eval("--cross-play")
    assert code == 1 and "need --models or --run" in output


# --- any engine: models served by an attached SGLang server -------------------------------------


@pytest.fixture
def sglang_url(tiny_model):
    """The SGLang stand-in, serving the tiny model's weights whatever it is told to load."""
    from tests.servers import running

    with running([str(TESTS / "sglang_standin.py"), "--model-path", str(tiny_model)]) as url:
        yield url


def test_eval_through_an_attached_sglang_server(sglang_url, tiny_model, other_model, tmp_path):
    """Two models through one SGLang server (the stand-in: the wire format, backed by the hf
    engine on the tiny model's weights, whatever it is told to load), each model's weights loaded
    before its rows; the same held-out scenarios, and for the tiny model the same games, as the
    hf engine gives."""
    import httpx

    from selfplay.engines import SGLangEngineConfig
    from selfplay.evaluate.run import run_eval
    from selfplay.records import SamplingParams

    models = (
        ModelSpec(label="tiny", model=str(tiny_model)),
        ModelSpec(label="later", model=str(other_model)),
    )
    common = dict(
        num_scenarios=3,
        table_size=3,
        max_actions=6,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=40),
        baselines=("random",),
    )
    template = SGLangEngineConfig(model="replaced by each model", url=sglang_url)
    result = run_eval(EvalConfig(models=models, engine=template, out=tmp_path / "sg", **common))
    assert result.scenario_seeds == [eval_scenario_seed(7, i) for i in range(3)]
    assert result.config.engine.kind == "sglang" and result.errors == {}
    for label in ("tiny", "later"):
        row = result.row(label, "model")
        assert row.error is None and row.games == 3 == sum(row.outcomes.values())
        assert 0.0 <= row.reward_mean <= 1.0
    assert result.row("random", "baseline").games == 3
    # the server was given each model's weights in turn: the later model's last
    assert httpx.get(f"{sglang_url}/model_info").json()["model_path"] == str(other_model)

    hf = run_eval(EvalConfig(models=models[:1], device="cpu", out=tmp_path / "hf", **common))
    assert hf.scenario_seeds == result.scenario_seeds
    assert _table(hf)[0] == _table(result)[0]  # the tiny model's row

    sg_games = _games(tmp_path / "sg")["model-tiny.jsonl"]
    hf_games = _games(tmp_path / "hf")["model-tiny.jsonl"]
    assert sg_games == hf_games  # token for token
    sg_lp, hf_lp = (_logprobs(tmp_path / d, "model-tiny.jsonl") for d in ("sg", "hf"))
    assert len(sg_lp) == len(hf_lp) > 0
    np.testing.assert_allclose(sg_lp, hf_lp, rtol=0, atol=1e-4)


def test_eval_cli_through_sglang(sglang_url, tiny_model, tmp_path):
    """`selfplay eval --engine sglang --engine-url URL`: the model is played through the server."""
    out = tmp_path / "ev"
    args = [
        "eval", "--models", str(tiny_model), "--engine", "sglang", "--engine-url", sglang_url,
        "--num-scenarios", "2", "--table-size", "3", "--max-actions", "4",
        "--max-new-tokens", "24", "--baselines", "", "--out", str(out),
    ]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    result = json.loads((out / "eval.json").read_text())
    assert result["config"]["engine"]["kind"] == "sglang"
    assert result["config"]["engine"]["url"] == sglang_url
    (row,) = [r for r in result["rows"] if r["kind"] == "model"]
    assert row["games"] == 2 and row["error"] is None
    # an engine URL without --engine sglang is refused, as in generate and iterate
    bad = CliRunner().invoke(app, [*args[:3], "--engine-url", sglang_url, "--out", str(out)])
    assert bad.exit_code == 1 and "add --engine sglang" in bad.output


def test_dev_and_test_splits_are_separate_seed_spaces_and_eval_plays_the_one_named(tmp_path):
    """The test split's scenario seeds share none with the dev split's (or training's, which are
    even) over thousands of indices and several eval seeds; dev's seeds are the ones every earlier
    run used; `selfplay eval --players A,B --split test` plays test scenarios and says so."""
    import json
    import subprocess
    import sys

    from selfplay.evaluate.scripted import play_scripted
    from selfplay.game import get_game
    from selfplay.seeds import heldout_game_seed, heldout_scenario_seed

    dev = {heldout_scenario_seed("dev", s, i) for s in range(4) for i in range(3000)}
    test = {heldout_scenario_seed("test", s, i) for s in range(4) for i in range(3000)}
    assert len(dev) == len(test) == 12000 and not dev & test
    assert all(x % 2 for x in test)
    assert heldout_scenario_seed("dev", 7, 3) == eval_scenario_seed(7, 3)
    assert heldout_game_seed("test", 7, 0, 0) != heldout_game_seed("dev", 7, 0, 0)
    with pytest.raises(ValueError, match="split"):
        heldout_scenario_seed("train", 7, 0)
    game = get_game("matching")
    games = play_scripted(game, ("proposer", "shy"), num_games=3, seed=7, n=3, split="test")
    assert [g.scenario.seed for g in games] == [
        heldout_scenario_seed("test", 7, i) for i in range(3)
    ]
    assert all(g.game_id.startswith("test-") for g in games)
    out = tmp_path / "pair.json"
    cmd = [sys.executable, "-m", "selfplay", "eval", "--players", "proposer,shy-strict"]
    cmd += ["--table-size", "3", "--num-games", "4", "--split", "test", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "test split" in done.stdout
    assert json.loads(out.read_text())["split"] == "test"
    bad = subprocess.run([*cmd[:-2], "--split", "train"], capture_output=True, text=True)
    assert bad.returncode != 0 and "split" in (bad.stdout + bad.stderr)


def test_a_row_numbers_its_seats_as_the_records_do_and_reads_an_older_rows_seat1_seat2():
    """Seats are numbered from 0 everywhere (records, metrics' seat0/seat1, eval rows); an
    eval.json written when rows said seat1/seat2 reads back with the same players in order."""
    from selfplay.evaluate.config import EvalRow

    old = EvalRow.model_validate({"name": "x", "kind": "baseline", "seat1": "a", "seat2": "b"})
    assert (old.seat0, old.seat1) == ("a", "b")
    assert set(old.model_dump()) >= {"seat0", "seat1"} and "seat2" not in old.model_dump()
    new = EvalRow.model_validate({"name": "x", "kind": "baseline", "seat0": "a", "seat1": "b"})
    assert new == old
    with pytest.raises(ValidationError, match="seat0"):  # a row names both seats
        EvalRow.model_validate({"name": "x", "kind": "baseline", "seat1": "b"})


def test_the_published_runs_metrics_read_back_with_their_seats_numbered_from_zero():
    """The runs committed under docs/runs stored per-seat metrics as seat0/seat1 (the records'
    numbering, kept): every metrics.jsonl still reads, each round with both seats' numbers."""
    from pathlib import Path

    from selfplay.iterate.report import read_metrics

    runs = sorted((Path(__file__).parent.parent / "docs" / "runs").glob("*/metrics.jsonl"))
    assert runs, "docs/runs holds the published runs"
    for path in runs:
        for row in read_metrics(path.parent):
            seats = row.questions_per_game_seat0, row.questions_per_game_seat1
            assert all(isinstance(x, float) for x in seats), path
            assert "questions_per_game_seat2" not in row.model_dump(), path
