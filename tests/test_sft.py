"""Behaviour cloning: token-exact teacher rows and verl's SFT loss on the real CPU worker."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from selfplay.cli import app
from selfplay.game.matching import MATCHING
from selfplay.generate.teacher import teacher_seed
from selfplay.iterate.warm_start import SFTConfig, build_rows
from selfplay.players.llm import load_chat_format
from selfplay.records import iter_game_records
from selfplay.seeds import eval_scenario_seed


@pytest.fixture(scope="module")
def teacher_rows(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "model"
    cfg = SFTConfig(model=str(tiny_model), out=out, teacher="scripted:cooperative", num_games=6)
    chat = load_chat_format(str(tiny_model))
    path, sources = build_rows(cfg, chat)
    return cfg, chat, path, sources


def test_rows_decode_to_the_teachers_actions_on_mask_1(teacher_rows):
    cfg, chat, path, sources = teacher_rows
    table = pq.read_table(path).to_pylist()
    assert len(table) == 12 == sources["teacher scripted:cooperative"]  # both seats of 6 games
    _assert_rows_are_the_games_actions(table, cfg.data_dir / "games.jsonl", chat)


def _assert_rows_are_the_games_actions(table, games_path, chat, *, valid_only=False) -> None:
    games = {g.game_id: g for g in iter_game_records(games_path)}
    for row in table:
        game = games[row["game_id"]]
        mine = [a for a in game.actions if a.seat == row["seat"]]
        actions = [a.text for a in mine if a.valid or not valid_only]
        mask = np.array(row["response_mask"])
        ids = np.array(row["response_ids"])
        # the mask-1 runs, one per turn, each the action's tokens then the end-of-turn token
        runs, run = [], []
        for i, m in zip(ids, mask):
            if m:
                run.append(int(i))
            elif run:
                runs.append(run)
                run = []
        runs.append(run)
        assert len(runs) == len(actions)
        for run, action in zip(runs, actions):
            assert run[-1] == chat.stop_token_ids[0]
            assert chat.decode(run[:-1]) == action
        assert row["reward"] == pytest.approx(game.reward)
        # the prompt is the seat's first turn as the LLM player renders it (when that turn is
        # skipped as invalid, it is context: the prompt runs on to the first cloned turn)
        first = games[row["game_id"]].tokens[row["seat"]].messages[0]["content"]
        want = chat.encode(chat.first_prompt(first))
        if mine[0].valid or not valid_only:
            assert row["prompt_ids"] == want
        else:
            assert row["prompt_ids"][: len(want)] == want and len(row["prompt_ids"]) > len(want)


def test_human_games_become_rows_of_both_seats_under_the_rendering_policy(
    human_games, tiny_model, tmp_path
):
    from selfplay.generate.teacher import HumanReplay, human_records

    src = tmp_path / "human.jsonl"
    src.write_text("".join(json.dumps(g) + "\n" for g in human_games[:4]))
    cfg = SFTConfig(model=str(tiny_model), out=tmp_path / "m", human_data=src, mini_batch_size=2)
    chat = load_chat_format(str(tiny_model))
    path, sources = build_rows(cfg, chat)
    table = pq.read_table(path).to_pylist()
    assert len(table) == 8 == sources[f"human games {src}"]  # both seats of 4 games
    _assert_rows_are_the_games_actions(table, cfg.data_dir / "human_games.jsonl", chat)
    # the whole file: most games replay to the logged accept, scored as the humans were
    src.write_text("".join(json.dumps(g) + "\n" for g in human_games))
    stats = HumanReplay()
    records = list(human_records(MATCHING, src, chat, stats))
    assert stats.games == 134 and stats.complete == 115 and stats.dropped_messages == 145
    assert sum(stats.stopped.values()) == 134 - 115
    assert all(r.counts["invalid"] == 0 for r in records)
    done = [r for r in records if r.outcome == "accepted"]
    assert len(done) == 115 and np.mean([r.reward for r in done]) == pytest.approx(0.924, abs=1e-3)
    # proposals are canonical, not the logged HTML
    assert all("<br/>" not in a.text for r in records for a in r.actions)


def test_teacher_scenarios_are_training_seeds_not_eval_seeds():
    seeds = {teacher_seed(0, i) for i in range(200)}
    assert all(s % 2 == 0 for s in seeds)
    assert not seeds & {eval_scenario_seed(7, i) for i in range(200)}


@pytest.mark.parametrize(
    ("teacher", "partner", "clone", "first"),
    [
        ("cooperative", None, "both", 0),
        ("inquisitive", "shy", "1", 3),
        ("random", "no-talk", "2", 0),
    ],
)
def test_teacher_games_through_the_rollout_path_are_the_sequential_loops_games(
    tiny_model, teacher, partner, clone, first
):
    """Teacher games moved from their own sequential loop to rollout.play_plan: the records (ids,
    scenarios, seeds, actions, token ids, masks) are the ones that loop played, game for game."""
    import asyncio

    from selfplay.generate.play import play_game
    from selfplay.generate.teacher import SFT_SPACE, play_teacher_games
    from selfplay.players.teacher import TeacherPlayer
    from selfplay.seeds import derive_seed

    chat = load_chat_format(str(tiny_model))
    names = (teacher, partner or teacher)
    cloned = {"both": (0, 1), "1": (0,), "2": (1,)}[clone]

    async def sequential() -> list:  # the loop teacher games were played by before
        records = []
        for i in range(first, first + 4):
            sseed = teacher_seed(7, i)
            scenario = MATCHING.new_scenario(sseed, 3)
            gseed = derive_seed(SFT_SPACE, 7, i)
            seats = []
            for seat in (0, 1):
                policy = names[0] if seat in cloned else names[1]
                player = MATCHING.scripted(policy, scenario, seat, seed=derive_seed(gseed, seat))
                seats.append(TeacherPlayer(player, chat) if seat in cloned else player)
            record = await play_game(
                scenario,
                tuple(seats),
                game_id=f"sft-s{sseed}-g0",
                seed=gseed,
                max_actions=12,
                game=MATCHING,
            )
            records.append(record)
        return records

    got = play_teacher_games(
        chat,
        game=MATCHING,
        teacher=f"scripted:{teacher}",
        partner=partner,
        clone=clone,
        num_games=4,
        seed=7,
        table_size=3,
        max_actions=12,
        first=first,
    )
    want = asyncio.run(sequential())
    dump = lambda rs: [r.model_dump(mode="json", exclude={"timings"}) for r in rs]  # noqa: E731
    assert dump(got) == dump(want)
    assert all(r.tokens[s] is not None for r in got for s in cloned)


@pytest.mark.slow
def test_an_sft_update_lowers_the_loss_on_its_batch(teacher_rows, tiny_model):
    from selfplay.train.batch import collate
    from selfplay.train.config import TrainConfig
    from selfplay.train.trainer import load_rows
    from selfplay.train.workers import LocalWorkers, sft_inputs

    cfg, _, path, _ = teacher_rows
    tcfg = TrainConfig(
        data=path, model=str(tiny_model), out=cfg.out, lr=1e-3, mini_batch_size=4,
        micro_batch_size=2,
    )  # fmt: skip
    rows, pad_id = load_rows(tcfg, groups=False)
    batch = sft_inputs(collate(rows.select(range(4)), pad_id))
    workers = LocalWorkers(tcfg, total_steps=3)
    try:
        workers.use_sft_loss()
        before = workers.loss(batch)
        for step in range(3):
            workers.update(batch, 4, step)
        after = workers.loss(batch)
    finally:
        workers.close()
    assert np.isfinite(before) and before > 0
    assert after < before - 0.1


@pytest.mark.slow
def test_sft_cli_writes_a_model_and_its_data(tiny_model, tmp_path):
    out = tmp_path / "sft_model"
    result = CliRunner().invoke(
        app,
        [
            "sft", "--out", str(out), "--model", str(tiny_model),
            "--teacher", "scripted:no-talk", "--num-games", "8",
            "--mini-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["algorithm"] == "sft" and metrics["rows"] == 16
    assert [s["step"] for s in metrics["steps"]] == [4]
    assert (out / "sft_data" / "rows.parquet").exists()
    # and it loads as a model the LLM player can use
    load_chat_format(str(out))


def test_sft_without_a_source_names_the_fix(tmp_path):
    result = CliRunner().invoke(app, ["sft", "--out", str(tmp_path / "m"), "--model", "x"])
    assert result.exit_code == 1
    assert "at least one source: teacher, games or human_data" in result.output


def test_filtered_games_keep_only_rewarding_games(teacher_rows, tiny_model, tmp_path):
    cfg, chat, _, _ = teacher_rows
    games = cfg.data_dir / "games.jsonl"
    rewards = sorted(g.reward for g in iter_game_records(games))
    cut = rewards[len(rewards) // 2]
    fcfg = SFTConfig(
        model=str(tiny_model), out=tmp_path / "m", games=games, min_reward=cut, mini_batch_size=2
    )
    path, _ = build_rows(fcfg, chat)
    kept = pq.read_table(path).column("reward").to_pylist()
    assert kept and min(kept) >= cut - 1e-6
    assert len(kept) == 2 * sum(r >= cut for r in rewards)


@pytest.mark.slow
def test_a_trained_checkpoint_carries_a_model_card(tiny_model, tmp_path):
    from selfplay.train.model_card import add_heldout, provenance, read_card

    out = tmp_path / "carded"
    result = CliRunner().invoke(
        app,
        [
            "sft", "--out", str(out), "--model", str(tiny_model),
            "--teacher", "scripted:cooperative", "--num-games", "4",
            "--mini-batch-size", "4", "--micro-batch-size", "2",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    meta = read_card(out)
    assert meta["base_model"] == str(tiny_model) and "selfplay" in meta["tags"]
    info = meta["selfplay"]
    assert info["algorithm"] == "sft" and info["data"]["rows"] == 8
    assert info["data"]["path"].endswith("rows.parquet") and info["settings"]["lr"] == 1e-4
    assert info["version"] and info["heldout"] == []
    held = {"scenarios": 3, "table_size": 3, "eval_seed": 7, "reward_mean": 0.5}
    held |= {"reward_ci_low": 0.1, "reward_ci_high": 0.9, "agreement_rate": 1.0}
    assert add_heldout(out, held)
    assert read_card(out)["selfplay"]["heldout"] == [held]
    assert "reward 0.500 [0.100, 0.900]" in (out / "README.md").read_text()
    assert provenance(out).startswith(f"sft from {tiny_model}, on 8 rows of ")
