"""Expert iteration: the selection rule, an iterate run with it on the real verl SFT update (rows =
the kept games' own actions), its resume after SIGKILL, and the mixed warm start's sources."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from selfplay.iterate.expert import select_games, without_invalid_turns
from selfplay.players.llm import load_chat_format
from selfplay.records import iter_game_records
from tests.fakes import iterate_cmd as _cmd
from tests.fakes import kill_when as _kill_when
from tests.fakes import line_count as _lines
from tests.fakes import run_ok as _run
from tests.fakes import start_killable as _start
from tests.test_sft import _assert_rows_are_the_games_actions


def _games(rewards: dict[str, list[float]]) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(game_id=f"{s}-g{i}", scenario_id=s, reward=r)
        for s, rs in rewards.items()
        for i, r in enumerate(rs)
    ]


def test_selection_keeps_the_best_of_each_scenario_above_the_threshold():
    games = _games(
        {"a": [0.2, 0.9, 0.9, 0.6], "b": [0.0, 0.4, 0.3, 0.1], "c": [1.0, 0.5, 0.7, 0.8]}
    )
    ids = lambda kept: [g.game_id for g in kept]  # noqa: E731
    assert ids(select_games(games, 1, 0.5)) == ["a-g1", "c-g0"]  # a tie goes to the earlier game
    assert ids(select_games(games, 2, 0.5)) == ["a-g1", "a-g2", "c-g0", "c-g3"]
    assert ids(select_games(games, 2, 0.35)) == ["a-g1", "a-g2", "b-g1", "c-g0", "c-g3"]
    assert ids(select_games(games, 4, 2.0)) == []
    # above the scenario's mean (a 0.65, b 0.2, c 0.75): a tie with the mean is not above it
    assert ids(select_games(games, 4, 0.0, above_mean=True)) == [
        "a-g1", "a-g2", "b-g1", "b-g2", "c-g0", "c-g3"
    ]  # fmt: skip
    assert ids(select_games(games, 1, 0.5, above_mean=True)) == ["a-g1", "c-g0"]
    alike = _games({"d": [0.7, 0.7, 0.7], "e": [0.0, 1.0, 1.0]})  # 0.7 * 3 / 3 < 0.7 in floats
    assert ids(select_games(alike, 3, 0.0, above_mean=True)) == ["e-g1", "e-g2"]


@given(
    st.dictionaries(
        st.sampled_from("abcdef"),
        st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]), min_size=1, max_size=8),
        min_size=1,
    ),
    st.integers(1, 4),
    st.sampled_from([0.0, 0.3, 0.5, 1.0]),
    st.booleans(),
)
def test_selection_properties(rewards, k, threshold, above_mean):
    games = _games(rewards)
    kept = select_games(games, k, threshold, above_mean)
    assert [g for g in games if g in kept] == kept  # input order
    for s, rs in rewards.items():
        mine = [g for g in kept if g.scenario_id == s]
        mean = sum(rs) / len(rs)
        eligible = sorted(
            (r for r in rs if r >= threshold and (not above_mean or r > mean)), reverse=True
        )
        assert sorted((g.reward for g in mine), reverse=True) == eligible[:k]


@pytest.fixture(scope="module")
def ei_run(primed_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("ei_ref")
    _run(_ei_cmd(root, primed_model))
    return root


def _ei_cmd(root: Path, model: Path) -> list[str]:
    cmd = _cmd(root, model, "ei")
    cmd[cmd.index("--iterations") + 1] = "1"
    cmd[cmd.index("--eval-scenarios") + 1] = "0"
    return [*cmd, "--algorithm", "expert-iteration", "--ei-top-k", "2", "--ei-min-reward", "0.1"]


@pytest.mark.slow
def test_expert_iteration_trains_on_exactly_the_kept_games(ei_run, primed_model):
    rdir = ei_run / "data" / "ei" / "round_0"
    games = list(iter_game_records(rdir / "games.jsonl"))
    want = select_games(games, 2, 0.1)
    assert 0 < len(want) < len(games), "the run should keep some games and drop others"
    kept = list(iter_game_records(rdir / "selected.jsonl"))
    assert [g.game_id for g in kept] == [g.game_id for g in want]
    rows = pq.read_table(rdir / "train.parquet").to_pylist()
    # self-play: both seats of every kept game, each row the game's own action tokens on mask 1
    assert sorted((r["game_id"], r["seat"]) for r in rows) == sorted(
        (g.game_id, s) for g in kept for s in (0, 1)
    )
    # ... the valid ones: a move the rules refused stays in the row as context, with mask 0
    _assert_rows_are_the_games_actions(
        rows, rdir / "selected.jsonl", load_chat_format(str(primed_model)), valid_only=True
    )
    manifest = json.loads((ei_run / "data" / "ei" / "manifest.json").read_text())
    stages = manifest["rounds"]["0"]["stages"]
    assert stages["convert"]["info"]["games_kept"] == len(want)
    invalid = sum(not a.valid for g in kept for a in g.actions)
    assert stages["convert"]["info"]["invalid_turns_skipped"] == invalid
    assert stages["train"]["info"]["loss"] > 0 and stages["train"]["info"]["pg_loss"] is None
    model = ei_run / "checkpoints" / "ei" / "round_0"
    assert json.loads((model / "metrics.json").read_text())["algorithm"] == "sft"
    assert _sha(model) != _sha(primed_model)


def test_invalid_turns_of_a_kept_game_are_context_not_cloned(ei_run, primed_model):
    from selfplay.convert import ConvertConfig, rows_table

    rdir = ei_run / "data" / "ei" / "round_0"
    game = next(iter_game_records(rdir / "selected.jsonl"))
    # mark seat 0's first action and seat 1's last one as refused by the rules
    first = next(i for i, a in enumerate(game.actions) if a.seat == 0)
    last = max(i for i, a in enumerate(game.actions) if a.seat == 1)
    actions = [
        a.model_copy(update={"valid": False}) if i in (first, last) else a
        for i, a in enumerate(game.actions)
    ]
    marked = game.model_copy(update={"actions": actions})
    cleaned, skipped = without_invalid_turns(marked)
    assert skipped == sum(not a.valid for a in marked.actions) >= 2
    for seat in (0, 1):
        before, after = marked.tokens[seat].mask, cleaned.tokens[seat].mask
        assert cleaned.tokens[seat].token_ids == marked.tokens[seat].token_ids
        assert all(b >= a for b, a in zip(before, after, strict=True))  # only 1 -> 0
        assert sum(before) > sum(after)
    path = rdir.parent / "marked.jsonl"
    path.write_text(marked.model_dump_json() + "\n")
    table, _ = rows_table([cleaned], ConvertConfig(games=path, out=rdir.parent))
    rows = table.to_pylist()
    chat = load_chat_format(str(primed_model))
    _assert_rows_are_the_games_actions(rows, path, chat, valid_only=True)
    # a seat whose only turns were refused has nothing to clone: no row
    refused = [a.model_copy(update={"valid": a.seat != 0}) for a in game.actions]
    alone, n = without_invalid_turns(game.model_copy(update={"actions": refused}))
    assert n == sum(a.seat == 0 for a in game.actions)
    assert sorted(
        r["seat"]
        for r in rows_table([alone], ConvertConfig(games=path, out=rdir.parent))[0].to_pylist()
    ) == [1]


@pytest.mark.slow
def test_expert_iteration_resumes_after_sigkill(ei_run, primed_model, tmp_path):
    cmd = _ei_cmd(tmp_path, primed_model)
    run = tmp_path / "data" / "ei"
    proc = _start(cmd)  # mid-generate
    _kill_when(proc, lambda: _lines(run / "round_0" / "games.jsonl") >= 3)
    proc = _start(cmd, SELFPLAY_HOLD_BEFORE="convert")  # at the selection
    _kill_when(proc, lambda: (run / "holding_convert").exists())
    (run / "holding_convert").unlink()
    proc = _start(cmd)  # mid-SFT
    _kill_when(proc, lambda: (tmp_path / "checkpoints" / "ei" / ".round_0.partial").exists())
    _run(cmd)
    for name in ("selected.jsonl",):
        got = (run / "round_0" / name).read_bytes()
        want = (ei_run / "data" / "ei" / "round_0" / name).read_bytes()
        assert _game_ids(got) == _game_ids(want)
    cols = ["game_id", "seat", "prompt_ids", "response_ids", "response_mask"]
    got = pq.read_table(run / "round_0" / "train.parquet").select(cols).to_pylist()
    want = pq.read_table(ei_run / "data" / "ei" / "round_0" / "train.parquet")
    assert got == want.select(cols).to_pylist()
    assert _sha(tmp_path / "checkpoints" / "ei" / "round_0") == _sha(
        ei_run / "checkpoints" / "ei" / "round_0"
    )


def _game_ids(data: bytes) -> list[str]:
    return [json.loads(line)["game_id"] for line in data.splitlines()]


def _sha(model: Path) -> str:
    return hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()


def test_mixed_warm_start_has_the_requested_games_of_each_source(tiny_model, tmp_path):
    from selfplay.iterate.warm_start import SFTConfig, build_rows

    chat = load_chat_format(str(tiny_model))
    cfg = SFTConfig(
        model=str(tiny_model),
        out=tmp_path / "m",
        teacher="scripted:cooperative:3,scripted:inquisitive:2",
        mini_batch_size=2,
    )
    path, sources = build_rows(cfg, chat)
    games = list(iter_game_records(cfg.data_dir / "games.jsonl"))
    assert Counter(g.seats[0].name for g in games) == {"cooperative": 3, "inquisitive": 2}
    assert sources == {"teacher scripted:cooperative": 6, "teacher scripted:inquisitive": 4}
    assert len({g.scenario_id for g in games}) == 5  # no scenario twice
    assert pq.read_metadata(path).num_rows == 10
    # the first source plays the games a single teacher of that name would
    single = SFTConfig(
        model=str(tiny_model),
        out=tmp_path / "s",
        teacher="scripted:cooperative",
        num_games=3,
        mini_batch_size=2,
    )
    build_rows(single, chat)
    one = [g.game_id for g in iter_game_records(single.data_dir / "games.jsonl")]
    assert one == [g.game_id for g in games[:3]]


@pytest.mark.parametrize(
    "spec, error",
    [
        ("scripted:cooperative:24,scripted:shy", "scripted:NAME:GAMES"),
        ("scripted:cooperative:2,scripted:cooperative:3", "twice"),
        ("scripted:nobody:3", "must be scripted:NAME"),
        ("scripted:cooperative:0", "at least 1"),
    ],
)
def test_a_bad_mixed_warm_start_is_a_clear_error(spec, error):
    from selfplay.game.matching import MATCHING
    from selfplay.iterate.config import parse_warm_start

    with pytest.raises(ValueError, match=error):
        parse_warm_start(spec, MATCHING)
    assert parse_warm_start("scripted:cooperative:24,scripted:inquisitive:4", MATCHING) == (
        ("cooperative", 24),
        ("inquisitive", 4),
    )


def _config(model: Path, **fields):
    """An IterateConfig of ``model`` on the hf engine, one round unless ``fields`` say more."""
    from selfplay.iterate.config import IterateConfig

    fields = {"iterations": 1, **fields}
    return IterateConfig(model=str(model), engine={"kind": "hf", "model": str(model)}, **fields)


def test_a_warm_start_against_the_runs_partner_clones_only_the_models_seat(tiny_model, tmp_path):
    from selfplay.iterate.heldout import warm_start_config
    from selfplay.iterate.warm_start import build_rows

    base = dict(
        name="w",
        checkpoint_root=tmp_path,
        table_size=3,
        warm_start="scripted:cooperative:3,scripted:inquisitive:2",
        warm_start_mini_batch_size=2,
    )
    with pytest.raises(ValueError, match="must then be scripted"):
        _config(tiny_model, **base, warm_start_partner="run")  # self-play: no partner to play
    cfg = _config(
        tiny_model, **base, warm_start_partner="run", partner="scripted:shy", policy_seat=2
    )
    sft_cfg = warm_start_config(cfg)
    assert (sft_cfg.partner, sft_cfg.clone) == ("scripted:shy", "2")
    path, sources = build_rows(sft_cfg, load_chat_format(str(tiny_model)))
    games = list(iter_game_records(sft_cfg.data_dir / "games.jsonl"))
    assert [(g.seats[0].name, g.seats[1].name) for g in games] == [("shy", "cooperative")] * 3 + [
        ("shy", "inquisitive")
    ] * 2
    rows = pq.read_table(path).to_pylist()
    assert [r["seat"] for r in rows] == [1] * 5 and sources == {
        "teacher scripted:cooperative": 3,
        "teacher scripted:inquisitive": 2,
    }
    assert warm_start_config(cfg.model_copy(update={"warm_start_partner": "self"})).clone == "both"


def test_runs_from_before_the_invalid_turn_option_resume_as_they_ran():
    """A manifest written before --ei-invalid-turns has no such key: its runs cloned every turn.
    A GRPO run resumes with the defaults; an expert-iteration run only with `train`."""
    from selfplay.iterate.config import IterateConfig, config_identity

    base = dict(name="r", iterations=1, model="m", engine={"kind": "hf", "model": "m"})
    for algorithm, resumes_with in (("grpo", "skip"), ("expert-iteration", "train")):
        old = IterateConfig(**base, algorithm=algorithm).model_dump(mode="json")
        del old["ei_invalid_turns"]
        for value in ("skip", "train"):
            now = IterateConfig(**base, algorithm=algorithm, ei_invalid_turns=value).identity()
            same = now == config_identity(old)
            assert same == (value == resumes_with or algorithm == "grpo"), (algorithm, value)


@pytest.mark.parametrize(("replay", "rounds"), [(1, []), (2, [1]), (0, [0, 1])])
def test_replay_trains_on_the_kept_games_of_the_latest_rounds(
    ei_run, primed_model, tmp_path, replay, rounds
):
    """--ei-replay N: round 2 trains on its own kept games and those of the rounds before it
    that N reaches (the earlier rounds' selected.jsonl, as they were kept)."""
    from selfplay.iterate.expert import select_stage

    cfg = _config(
        primed_model,
        name="replay",
        iterations=3,
        data_root=tmp_path,
        algorithm="expert-iteration",
        ei_top_k=2,
        ei_min_reward=0.1,
        ei_replay=replay,
    )
    games = list(iter_game_records(ei_run / "data" / "ei" / "round_0" / "games.jsonl"))
    kept = select_games(games, 2, 0.1)
    assert len(kept) >= 3
    earlier = {0: kept[:1], 1: kept[1:3]}  # what rounds 0 and 1 kept, renamed as theirs
    for j, theirs in earlier.items():
        cfg.round_dir(j).mkdir(parents=True)
        lines = [
            g.model_copy(update={"game_id": f"r{j}-{g.game_id}"}).model_dump_json() for g in theirs
        ]
        (cfg.round_dir(j) / "selected.jsonl").write_text("".join(f"{x}\n" for x in lines))
    cfg.round_dir(2).mkdir()
    (cfg.round_dir(2) / "games.jsonl").write_text(
        "".join(g.model_dump_json() + "\n" for g in games)
    )
    record = select_stage(cfg, 2, str(primed_model), {})
    want = [f"r{j}-{g.game_id}" for j in rounds for g in earlier[j]]
    want += [g.game_id for g in kept]
    rows = pq.read_table(record.artifacts["train"]).to_pylist()
    assert sorted({r["game_id"] for r in rows}) == sorted(want)
    assert record.info.games_replayed == len(want) - record.info.games_kept
    assert record.info.rows_train == len(rows) == 2 * len(want)  # self-play: both seats
