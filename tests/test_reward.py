"""The reward seam (selfplay/reward): a new shaping is one function and one registration, the
names of shapings and credits are checked, and turn credit (GiGPO's state groups) puts the right
advantage on each turn, learns a first-turn choice faster on a toy and trains end to end."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from selfplay import game as game_registry
from selfplay.convert import ConvertConfig, ConvertOptions, convert
from selfplay.game.api import Outcome
from selfplay.records import ActionRecord, GameRecord, SeatConfig, SeatTokens, dump_record
from selfplay.reward import (
    SHAPINGS,
    GameResult,
    row_advantages,
    shaping,
    state_advantages,
    token_advantages,
    turn_spans,
)
from selfplay.reward.credit import turn_states
from selfplay.training_schema import TRAINING_SCHEMA
from tests.test_convert import scenario
from tests.toy_game import SUM, SumScenario

LLM = SeatConfig(kind="llm", name="tiny", trained=True)


@pytest.fixture
def shapings():
    """The shaping registry as it was, after the test (a test registers its own)."""
    before = dict(SHAPINGS)
    yield SHAPINGS
    SHAPINGS.clear()
    SHAPINGS.update(before)


def seat_tokens(seat: int, turns: list[list[int]], fingerprint: str = "fp") -> SeatTokens:
    """Prompt [40 + seat, 41]; each own turn's ids (mask 1), then a partner token 50 (mask 0)."""
    ids, mask = [40 + seat, 41], [0, 0]
    for own in turns:
        ids += [*own, 50]
        mask += [1] * len(own) + [0]
    logprobs = [-0.5 if m else 0.0 for m in mask]
    return SeatTokens(
        token_ids=ids, mask=mask, logprobs=logprobs, tokenizer_fingerprint=fingerprint,
        messages=[{"role": "user", "content": "hi"}],
    )  # fmt: skip


def record(gid: str, sid: str, reward: float, turns: list[list[list[int]]], **kw) -> GameRecord:
    """A finished game whose seats played ``turns[seat]``; one action per own turn."""
    actions = [
        ActionRecord(seat=s, text="[message] hi", kind="message", valid=True)
        for t in range(max(map(len, turns)))
        for s in (0, 1)
        if t < len(turns[s])
    ]
    fingerprint = kw.pop("fingerprint", "fp")
    fields = dict(
        game_id=gid, scenario_id=sid, seed=0, seats=(LLM, LLM), actions=actions,
        tokens=tuple(seat_tokens(s, turns[s], fingerprint) for s in (0, 1)),
        outcome=Outcome.ACCEPTED if reward > 0 else Outcome.MAX_ACTIONS,
        score=int(reward * 100), reward=reward,
    )  # fmt: skip
    return GameRecord(**(fields | kw))


def write(path: Path, records: list[GameRecord]) -> Path:
    path.write_bytes(b"".join(dump_record(r) for r in records))
    return path


def rows_of(out: Path) -> list[dict]:
    return pq.read_table(out / "train.parquet").to_pylist()


# ---------------------------------------------------------------------------------------------
# (A) the seam: a new shaping, and names checked


def test_a_new_shaping_is_one_function_and_one_registration_on_the_toy_game(
    shapings, monkeypatch, tmp_path
):
    monkeypatch.setitem(game_registry.GAMES, SUM.name, SUM)  # the toy game, as its tests do

    @shaping("sum-haste")  # the registration
    def haste(game: GameResult, seat: int, reward: float) -> float:  # the function
        """A tenth of a point off for each action the game took."""
        return reward - 0.1 * game.actions

    scenario = SumScenario(id="S", size=1, secrets=(1, 2))
    long, short = [[21], [22], [23]], [[21]]
    games = [  # the same scenario: one group; 6, 2, 4 actions
        record("a", "S", 1.0, [long, long], game="sum", scenario=scenario),
        record("b", "S", 0.5, [short, short], game="sum", scenario=scenario),
        record("c", "S", 0.0, [long[:2], long[:2]], game="sum", scenario=scenario),
    ]
    path = write(tmp_path / "games.jsonl", games)
    plain = convert(ConvertConfig(games=path, out=tmp_path / "plain"))
    shaped = convert(ConvertConfig(games=path, out=tmp_path / "shaped", reward_shaping="sum-haste"))
    assert (plain.reward_shaping, shaped.reward_shaping) == ("none", "sum-haste")
    before = {(r["game_id"], r["seat"]): r["reward"] for r in rows_of(tmp_path / "plain")}
    after = {(r["game_id"], r["seat"]): r["reward"] for r in rows_of(tmp_path / "shaped")}
    assert before == {(g, s): r for g, r in (("a", 1.0), ("b", 0.5), ("c", 0.0)) for s in (0, 1)}
    actions = {"a": 6, "b": 2, "c": 4}
    assert after == pytest.approx({k: v - 0.1 * actions[k[0]] for k, v in before.items()})


def test_the_penalty_and_the_shaping_are_one_function_for_both_readers(shapings):
    from selfplay.convert.rows import rows_of_json, rows_of_record
    from selfplay.reward import row_reward

    shaping("double")(lambda game, seat, reward: 2 * reward)
    game = record("g", "S", 0.0, [[[21]], [[22]]], scenario=scenario("S"))
    game = game.model_copy(update={"outcome": Outcome.INVALID})  # seat 1 acted last
    assert GameResult.of_record(game, 0.0) == GameResult(0.0, "invalid", 1, 2)
    result = GameResult(0.0, "invalid", 1, 2)
    assert row_reward(result, 1, invalid_penalty=0.5, shaping="none") == -0.5
    assert row_reward(result, 0, invalid_penalty=0.5, shaping="none") == 0.0
    cfg = ConvertConfig(
        games=Path("g"), out=Path("o"), invalid_penalty=0.5, reward_shaping="double"
    )
    typed = [r.reward for r in rows_of_record(game, cfg).rows]
    fast = [r.reward for r in rows_of_json(orjson.loads(dump_record(game)), cfg).rows]
    assert typed == fast == [0.0, -1.0]  # the offender's -0.5, doubled; its partner keeps 0


def test_unknown_shapings_and_credits_are_refused_naming_the_field_and_the_known_ones(tmp_path):
    with pytest.raises(ValidationError, match=r"reward_shaping[\s\S]*known shapings: none"):
        ConvertOptions(reward_shaping="nope")
    with pytest.raises(ValidationError, match=r"credit[\s\S]*known: episode, turn"):
        ConvertOptions(credit="gigpo")
    from selfplay.cli import app

    res = CliRunner().invoke(
        app, ["convert", "--games", str(tmp_path / "g.jsonl"), "--credit", "gigpo"]
    )
    said = " ".join(res.output.split())
    assert res.exit_code == 1 and "--credit" in said and "episode, turn" in said, said


def test_the_iterate_recipe_key_reaches_the_convert_stage(tmp_path, monkeypatch):
    from selfplay.cli import parse_iterate

    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "x"\ncredit = "turn"\nreward-shaping = "none"\n')
    cfg = parse_iterate(["--config", str(recipe), "--model", "m"], resolve=False)
    assert cfg.credit == "turn"
    convert_options = cfg.model_dump(include=set(ConvertOptions.model_fields))  # as stages.py
    assert ConvertConfig(games=Path("g"), out=Path("o"), **convert_options).credit == "turn"
    default = parse_iterate(["--model", "m", "--name", "y"], resolve=False)
    assert default.credit == "episode"
    from selfplay.iterate.config import config_identity

    # a run from before the option resumes: the default is not part of its identity
    assert "credit" not in config_identity(default.model_dump(mode="json"))


# ---------------------------------------------------------------------------------------------
# (B) turn credit: states, advantages, convert, learning, end to end


def test_turn_states_share_the_opening_and_part_where_the_histories_part():
    prompt = np.array([1, 2], np.int32)
    mask = np.array([1, 0, 1, 1, 0, 1], np.int8)
    assert turn_spans(mask) == [(0, 1), (2, 4), (5, 6)]
    a = turn_states(prompt, np.array([7, 9, 8, 8, 9, 5]), mask, 0)
    b = turn_states(prompt, np.array([7, 9, 8, 8, 9, 6]), mask, 0)  # differs in the last turn
    c = turn_states(prompt, np.array([6, 9, 8, 8, 9, 5]), mask, 0)  # differs in the first turn
    assert len(a) == 3 and a.dtype == np.int64 and (a >= 0).all()
    assert (a == b).all()  # the tokens before each turn are the same: so are the states
    assert a[0] == c[0] and a[1] != c[1] and a[2] != c[2]
    assert turn_states(prompt, np.array([7, 9, 8, 8, 9, 5]), mask, 1)[0] != a[0]  # the seat


def test_a_turn_gets_the_episode_advantage_plus_its_state_advantage():
    rows = SimpleNamespace(
        group_ids=np.array([0, 0, 0, 0, 9]), rewards=np.array([1.0, 0.0, 1.0, 0.0, 3.0])
    )
    states = [np.array([5, 6]), np.array([5, 6]), np.array([5, 7]), np.array([5, 8]), [5]]
    by_state = state_advantages(rows, states)
    first = (np.array([1.0, 0.0, 1.0, 0.0]) - 0.5) / (np.std([1, 0, 1, 0], ddof=1) + 1e-6)
    assert np.allclose([s[0] for s in by_state[:4]], first)  # one state: the opening
    second = (np.array([1.0, 0.0]) - 0.5) / (np.std([1, 0], ddof=1) + 1e-6)
    assert np.allclose([by_state[0][1], by_state[1][1]], second)  # state 6, rows 0 and 1
    assert by_state[2][1] == by_state[3][1] == 0  # states 7 and 8: no other turn reaches them
    assert by_state[4][0] == 0  # state 5 of another group is another state
    episode = np.array([0.3, -0.3, 0.3, -0.3, 0.0])
    masks = [[1, 0, 1, 1], [1, 0, 1, 1], [1, 0, 1, 1], [1, 0, 1, 1], [0, 1]]
    per_token = token_advantages(rows, masks, states, episode)
    want = [0.3 + by_state[0][0], 0, 0.3 + by_state[0][1], 0.3 + by_state[0][1]]
    assert np.allclose(per_token[0], want)
    assert np.allclose(per_token[4], [0, 0])
    episode_only = token_advantages(rows, masks, [None] * 5, episode)
    assert np.allclose(episode_only[0], [0.3, 0, 0.3, 0.3])
    with pytest.raises(ValueError, match="row 0 has 2 own turns"):
        token_advantages(rows, masks, [np.array([5]), *states[1:]], episode)


def test_convert_with_turn_credit_writes_a_state_per_turn_and_old_files_still_read(tmp_path):
    from selfplay.train.batch import read_rows, rows_from_table

    turns = [[[[21 + k % 2], [30]], [[22], [31]]] for k in range(4)]
    games = [record(f"g{k}", "A", k % 2, turns[k], scenario=scenario("A")) for k in range(4)]
    path = write(tmp_path / "games.jsonl", games)
    convert(ConvertConfig(games=path, out=tmp_path / "turn", credit="turn"))
    rows = rows_of(tmp_path / "turn")
    assert len(rows) == 8
    for r in rows:
        assert len(r["turn_states"]) == len(turn_spans(r["response_mask"])) == 2
    seat0 = [r["turn_states"] for r in rows if r["seat"] == 0]
    seat1 = [r["turn_states"] for r in rows if r["seat"] == 1]
    assert len({s[0] for s in seat0}) == 1 and len({s[0] for s in seat1}) == 1  # the opening
    assert len({s[1] for s in seat0}) == 2  # after two different first moves (21, 22)
    assert seat0[0][0] != seat1[0][0]
    # a file without the column (written before it) reads as episode credit
    table = pq.read_table(tmp_path / "turn" / "train.parquet")
    old = table.drop_columns(["turn_states", "off_policy", "temperature"])
    pq.write_table(old, tmp_path / "old.parquet")
    assert rows_from_table(read_rows(tmp_path / "old.parquet")).turn_states is None
    assert rows_from_table(read_rows(tmp_path / "turn" / "train.parquet")).turn_states is not None
    assert "turn_states" in TRAINING_SCHEMA.names


# The learning toy: the first turn picks GOOD (reward 1) or BAD (0); LATER more turns each pick a
# token too, which changes nothing, and the reward carries Gaussian noise. A logits table per turn
# plus a bias all turns share (as a language model's weights are) is the policy; the loss is the
# trainer's seq-mean-token-mean of -A * log p on the own tokens (on-policy, so PPO's ratio is 1).
GOOD, BAD, PARTNER, PROMPT, LATER = 11, 10, 300, np.array([100], np.int32), 3


def _play(logits: torch.Tensor, k: int, rng: np.random.Generator, noise: float) -> list[tuple]:
    p_good = torch.softmax(logits, -1)[:, 1].detach().numpy()
    games = []
    for _ in range(k):
        picks = [int(rng.random() < p) for p in p_good]
        response = np.array([t for c in picks for t in (GOOD if c else BAD, PARTNER)][:-1])
        mask = np.array([1, 0] * LATER + [1], np.int8)
        games.append((picks, response, mask, picks[0] + noise * rng.standard_normal()))
    return games


def _updates_to_learn(credit: str, seed: int, *, k=8, lr=0.5, noise=1.0, target=0.9, budget=200):
    """Updates until p(GOOD at the first turn) >= target, advantages from selfplay.reward."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    table = torch.zeros(LATER + 1, 2, requires_grad=True)
    bias = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([table, bias], lr=lr)
    for update in range(budget):
        if torch.softmax(table + bias, -1)[0, 1] >= target:
            return update
        games = _play(table + bias, k, rng, noise)
        rows = SimpleNamespace(
            group_ids=np.zeros(k, np.int64), rewards=np.array([g[3] for g in games], np.float32)
        )
        masks = [g[2] for g in games]
        states = [None] * k
        if credit == "turn":
            states = [turn_states(PROMPT, g[1], g[2], 0) for g in games]
        adv = token_advantages(rows, masks, states, row_advantages(rows))
        logp = torch.log_softmax(table + bias, -1)
        per_row = [
            -(torch.from_numpy(a[m == 1]) * logp[torch.arange(LATER + 1), picks]).mean()
            for (picks, _, m, _), a in zip(games, adv)
        ]
        opt.zero_grad()
        torch.stack(per_row).mean().backward()
        opt.step()
    return budget


def test_turn_credit_learns_a_first_turn_choice_in_fewer_updates_than_episode_credit():
    episode = [_updates_to_learn("episode", seed) for seed in range(4)]
    turn = [_updates_to_learn("turn", seed) for seed in range(4)]
    assert max(episode + turn) < 200, (episode, turn)  # both learn within the budget
    assert all(t <= e for t, e in zip(turn, episode)), (episode, turn)
    assert np.median(turn) < 0.75 * np.median(episode), (episode, turn)


@pytest.mark.slow
def test_turn_credit_rows_train_end_to_end(tiny_model, tmp_path):
    """games -> convert --credit turn -> parquet -> the real trainer (verl's update, CPU)."""
    import json

    from transformers import AutoTokenizer

    from selfplay.models import tokenizer_fingerprint
    from selfplay.train import train
    from selfplay.train.config import TrainConfig
    from selfplay.train.trainer import plan, step_batch

    fp = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_model))
    games = [
        record(f"{sid}{k}", sid, float(k % 2), [[[21 + k % 2, 23], [30]], [[24], [31]]],
               fingerprint=fp, scenario=scenario(sid))
        for sid in ("A", "B") for k in range(4)
    ]  # fmt: skip
    path = write(tmp_path / "games.jsonl", games)
    # groups per seat, so that a seat's opening state group is its episode group
    convert(
        ConvertConfig(games=path, out=tmp_path / "rows", credit="turn", group_by="scenario-seat")
    )
    cfg = TrainConfig(
        data=tmp_path / "rows" / "train.parquet", model=str(tiny_model), out=tmp_path / "ckpt",
        lr=1e-3, batch_size=8, mini_batch_size=8, micro_batch_size=4, save_verl_checkpoint=False,
    )  # fmt: skip
    p = plan(cfg)
    assert p.token_advantages is not None
    batch = step_batch(p, np.arange(len(p.rows)))
    for i in range(len(p.rows)):
        first = turn_spans(p.rows.masks[i])[0]
        # every game of a scenario opens alike: the first turn's state advantage is the episode's
        assert batch["advantages"][i, first[0]] == pytest.approx(2 * p.advantages[i], abs=1e-5)
    assert (batch["advantages"][batch["response_mask"] == 0] == 0).all()
    result = train(cfg)
    steps = json.loads(result.metrics_path.read_text())["steps"]
    assert len(steps) == 2 and all(np.isfinite(s["pg_loss"]) for s in steps)
    assert any(s["grad_norm"] > 0 for s in steps)
