"""The one rollout path: pinned seed spaces and plans, seating, bounded play, clean cancellation,
and eval rows built from the summary key by key."""

from __future__ import annotations

import asyncio
import math

import pytest

from selfplay.engines import EngineFailure, HFEngineConfig, SGLangEngineConfig
from selfplay.evaluate.config import NOT_IN_ROW, EvalConfig, EvalRow, ModelSpec, summary_fields
from selfplay.game.matching import MATCHING
from selfplay.game.matching.rules import PAPERS_SHORT, REVIEWERS
from selfplay.game.matching.scripted import make_scripted
from selfplay.generate.config import GenerateConfig
from selfplay.generate.output import plan_games
from selfplay.generate.rollout import (
    GameSpec,
    Scenarios,
    Seating,
    eval_plan,
    play_many,
    play_plan,
    scripted_seat,
    seating,
    training_plan,
)
from selfplay.metrics import summarize
from selfplay.players.partners import OpenAIPartner, ScriptedPartner, SelfPlay

# --- seed spaces and plans: every existing game id and seed stays what it was ------------------


def test_seed_formulas_and_plans_are_pinned():
    """Values made by the formulas of runner.py / evaluate.py before selfplay.seeds existed."""
    from selfplay import seeds

    assert seeds.scenario_seed(0, 0, 0) == 5918759735706020762
    assert seeds.scenario_seed(3, 2, 5) == 17516875071935976220
    assert seeds.game_seed(0, 0, 0, 0) == 8047175967907551869
    assert seeds.game_seed(3, 2, 5, 1) == 3585571055588808721
    assert seeds.eval_scenario_seed(7, 0) == 16365312898935196221
    assert seeds.eval_scenario_seed(7, 4) == 9116695980741364993
    assert seeds.eval_game_seed(7, 0, 0) == 3204394615972970535
    assert seeds.eval_game_seed(7, 4, 1) == 4197812042613604998
    cfg = GenerateConfig(out="x", num_games=3, model="m", games_per_scenario=2, seed=3, round=2)
    assert [(s.game_id, s.seed) for s in plan_games(cfg)] == [
        ("r2-s4957054257163939580-g0", 2622793108034077445),
        ("r2-s4957054257163939580-g1", 2353832475164682279),
        ("r2-s6357428164812449870-g0", 1482612838638804068),
    ]
    assert list(plan_games(cfg)) == list(training_plan(3, 2, 3, 2))


def test_eval_plan_covers_every_scenario_with_its_games_in_order():
    plan = eval_plan(7, 3, 2)
    assert [s.index for s in plan] == list(range(6))
    assert [(s.scenario_index, s.k) for s in plan] == [(i, k) for i in range(3) for k in (0, 1)]
    first = plan[0]
    assert first.scenario_seed == 16365312898935196221 and first.seed == 3204394615972970535
    assert first.game_id == "eval-s16365312898935196221-g0"
    assert all(s.scenario_seed % 2 == 1 for s in plan)


# --- seating ----------------------------------------------------------------------------------


def _named(tag: str):
    """A seat factory whose player says who it is: (tag, seat, seed)."""

    def make(scenario, seat, seed):
        return (tag, seat, seed)

    return make


def test_seating_puts_the_policy_where_the_partner_spec_says():
    from selfplay.game.matching.rules import generate_scenario

    scenario = generate_scenario(1, 3)
    me = _named("me")
    assert seating(me, game=MATCHING).players(scenario, 9) == (("me", 0, 9), ("me", 1, 9))
    assert seating(me, SelfPlay(), game=MATCHING).players(scenario, 9)[1] == ("me", 1, 9)
    shy = seating(me, ScriptedPartner("shy"), policy_seat=2, game=MATCHING)
    one, two = shy.players(scenario, 9)
    assert two == ("me", 1, 9)
    assert one.config.kind == "scripted" and one.config.name == "shy"
    one, two = seating(me, ScriptedPartner("cooperative"), game=MATCHING).players(scenario, 9)
    assert one == ("me", 0, 9) and two.config.name == "cooperative"
    # the scripted seat's seed derives from the game seed, as in generate and eval before
    from selfplay.seeds import derive_seed

    want = make_scripted("random", scenario, 1, seed=derive_seed(9, 1))
    got = scripted_seat("random", MATCHING)(scenario, 1, 9)
    assert got.config == want.config
    assert got.rng.bit_generator.state == want.rng.bit_generator.state
    with pytest.raises(ValueError, match="needs a PartnerClient"):
        seating(me, OpenAIPartner("gpt-4.1"), game=MATCHING)
    with pytest.raises(ValueError, match="policy_seat is 1 or 2"):
        Seating(me, me, policy_seat=3)
    assert Seating(me, _named("b")).players(scenario, 1) == (("me", 0, 1), ("b", 1, 1))


# --- playing ----------------------------------------------------------------------------------


class _Wrapped:
    """A scripted seat whose every move first awaits ``gate`` (or fails, or counts)."""

    def __init__(self, inner, gate, log: dict) -> None:
        self.inner, self.gate, self.log = inner, gate, log
        self.config = inner.config

    async def act(self, observation: str) -> str:
        try:
            await self.gate()
        except asyncio.CancelledError:
            self.log["cancelled"] += 1
            raise
        return await self.inner.act(observation)

    def tokens(self):
        return None


def _plan(n: int) -> list[GameSpec]:
    return [GameSpec(i, i, 2 * i + 1, 0, f"g{i}", i) for i in range(n)]


def _seating(gate_of, log) -> Seating:
    """Cooperative pairs; game ``seed``'s moves wait on ``gate_of(seed)``."""

    def make(scenario, seat, seed):
        return _Wrapped(make_scripted("cooperative", scenario, seat, seed=seed), gate_of(seed), log)

    return Seating(make)


def test_play_many_keeps_at_most_concurrency_games_in_flight_and_reports_each_once():
    log = {"cancelled": 0, "active": 0, "most": 0}
    started: set[int] = set()

    def gate_of(seed):
        async def gate():
            if seed not in started:
                started.add(seed)
                log["active"] += 1
                log["most"] = max(log["most"], log["active"])
            await asyncio.sleep(0.001)

        return gate

    finished = []

    def on_game(spec, record):
        log["active"] -= 1
        finished.append((spec.index, record.game_id))

    async def go():
        scenarios = Scenarios(3, game=MATCHING)
        try:
            await play_many(
                _plan(9), _seating(gate_of, log), scenarios, count=9, concurrency=3,
                max_actions=12, max_invalid=3, on_game=on_game,
            )  # fmt: skip
        finally:
            scenarios.close()

    asyncio.run(go())
    assert sorted(finished) == [(i, f"g{i}") for i in range(9)]
    assert log["most"] == 3


def test_play_plan_returns_the_records_in_plan_order():
    async def go():
        scenarios = Scenarios(3, game=MATCHING)
        try:
            seats = Seating(scripted_seat("cooperative", MATCHING))
            limits = dict(max_actions=12, max_invalid=3)
            return await play_plan(_plan(5), seats, scenarios, concurrency=2, **limits)
        finally:
            scenarios.close()

    records = asyncio.run(go())
    assert [r.game_id for r in records] == [f"g{i}" for i in range(5)]
    assert [r.scenario.seed for r in records] == [2 * i + 1 for i in range(5)]


@pytest.mark.parametrize("how", ["engine failure", "cancelled (Ctrl-C)"])
def test_a_failure_cancels_the_games_in_flight_and_awaits_them(how):
    """Games 0 and 1 wait forever; game 2 fails (or the caller is cancelled): both waiting games
    are cancelled and finished before play_many returns, none is reported, no worker is left."""
    log = {"cancelled": 0}
    blocked = asyncio.Event()

    def gate_of(seed):
        async def gate():
            if seed == 2 and how == "engine failure":
                raise EngineFailure("the server died")
            if seed in (0, 1):
                blocked.set()
                await asyncio.Event().wait()

        return gate

    reported = []

    async def go():
        scenarios = Scenarios(3, game=MATCHING)
        task = asyncio.create_task(
            play_many(
                _plan(6), _seating(gate_of, log), scenarios, count=6, concurrency=3,
                max_actions=12, max_invalid=3, on_game=lambda s, r: reported.append(s.index),
            )
        )  # fmt: skip
        try:
            if how != "engine failure":
                await blocked.wait()
                await asyncio.sleep(0.01)
                task.cancel()
            await task
        finally:
            scenarios.close()
            left = [t for t in asyncio.all_tasks() if t.get_name().startswith("game-worker")]
            assert left == []

    with pytest.raises(EngineFailure if how == "engine failure" else asyncio.CancelledError):
        asyncio.run(go())
    assert log["cancelled"] == 2
    assert 0 not in reported and 1 not in reported


def test_scenarios_are_shared_kept_or_forgotten():
    plan = eval_plan(7, 3, 2)

    async def go(keep: bool):
        scenarios = Scenarios(3, game=MATCHING, keep=keep)
        try:
            first = scenarios.get(plan[0])
            assert scenarios.get(plan[1]) is first  # game 1 plays the same scenario
            await scenarios.warm(plan)
            scenarios.get(plan[4])  # scenario 2: the plan has moved past scenarios 0 and 1
            again = scenarios.get(plan[0])
            return first is again, (await again).seed
        finally:
            scenarios.close()

    assert asyncio.run(go(keep=True)) == (True, plan[0].scenario_seed)
    same, seed = asyncio.run(go(keep=False))  # forgotten, then made again (the same table)
    assert not same and seed == plan[0].scenario_seed


# --- eval rows from the summary, key by key ----------------------------------------------------


def test_every_summary_key_is_a_row_field_or_left_out_on_purpose():
    from selfplay.evaluate.scripted import play_scripted

    summary = summarize(play_scripted(MATCHING, ("cooperative", "shy"), num_games=3, seed=1, n=3))
    keys = set(type(summary).model_fields) - {"partner"}  # partner: generate's API usage
    row_fields = set(EvalRow.model_fields)
    assert keys <= row_fields | NOT_IN_ROW
    assert not NOT_IN_ROW & row_fields
    fields = summary_fields(summary)
    assert set(fields) == keys - NOT_IN_ROW
    row = EvalRow(name="x", kind="baseline", seat0="a", seat1="b", **fields)
    assert row.games == 3 and row.outcomes == summary.outcomes
    empty = summary_fields(summarize([]))
    assert empty["reward_mean"] is None and not any(
        isinstance(v, float) and math.isnan(v) for v in empty.values()
    )

    class Grown(type(summary)):  # a metric added to the summary but not to the rows
        new_metric: float = 1.0

    with pytest.raises(TypeError, match="new_metric, which EvalRow does not have"):
        summary_fields(Grown(**summary.model_dump()))
    with pytest.raises(ValueError, match="new_metric"):
        EvalRow(name="x", kind="baseline", seat0="a", seat1="b", new_metric=1.0)


# --- eval engine templates --------------------------------------------------------------------


def test_eval_engine_template_gives_each_model_its_engine():
    models = (ModelSpec(label="a", model="a"), ModelSpec(label="b", model="b"))
    hf = EvalConfig(models=models, device="cpu", max_batch_size=8)
    assert hf.engine_for("/m/a") == HFEngineConfig(model="/m/a", device="cpu", max_batch_size=8)
    template = HFEngineConfig(model="template", device="cpu", prefix_cache_tokens=0)
    cfg = EvalConfig(models=models, engine=template)
    assert cfg.engine_for("/m/b", 1) == template.model_copy(update={"model": "/m/b"})
    launched = EvalConfig(
        models=models, cross_play=True, engine={"kind": "sglang", "model": "t", "port": 31000}
    )
    got = [launched.engine_for(f"/m/{i}", i) for i in range(2)]
    assert [(e.model, e.port) for e in got] == [("/m/0", 31000), ("/m/1", 31001)]
    attached = SGLangEngineConfig(model="t", url="http://127.0.0.1:9")
    one = EvalConfig(models=models, engine=attached)
    assert one.engine_for("/m/b", 1) == attached.model_copy(update={"model": "/m/b"})
    with pytest.raises(ValueError, match="cross_play: an attached server"):
        EvalConfig(models=models, engine=attached, cross_play=True)
    with pytest.raises(ValueError, match=r"engine\.device"):
        EvalConfig(models=models, engine=attached, device="cuda")
    for name, field in EvalConfig.model_fields.items():
        if name not in {"partner", "policy_seat", "partner_base_url", "partner_key_env",
                        "partner_max_calls"}:  # fmt: skip
            assert field.description, f"EvalConfig.{name} has no description"


def test_same_proposal_share_tells_a_fixed_answer_from_one_that_reads_the_scenario():
    """Scripted cooperative proposes each scenario's best assignment by what both know, so its
    first proposals differ across scenarios; a record whose every first proposal is the same
    assignment (what the warm-started SmolLM2 does) scores 1."""
    from selfplay.evaluate.scripted import play_scripted

    games = play_scripted(MATCHING, ("cooperative", "cooperative"), num_games=24, seed=1, n=3)
    share = summarize(games).same_proposal_share
    assert 1 / 6 <= share < 0.6  # 6 assignments on 3x3
    fixed = [[0, 2], [1, 0], [2, 1]]
    same = [
        g.model_copy(
            update={
                "actions": [
                    a.model_copy(update={"proposal": fixed}) if a.proposal else a for a in g.actions
                ]
            }
        )
        for g in games
    ]
    assert summarize(same).same_proposal_share == 1.0
    assert math.isnan(summarize([]).same_proposal_share)


def test_stated_value_accuracy_counts_the_values_a_message_gets_right_about_its_own_table():
    """Scripted cooperative states its known cells exactly (1.0); a message that moves each value
    to the next paper of its reviewer (what the CSV-cloned SmolLM2 does) scores 0 on those items;
    no stated value is NaN; the lines game's intro lines, said back, are all true."""
    from selfplay.evaluate.scripted import play_scripted
    from selfplay.game import GAMES

    games = play_scripted(MATCHING, ("cooperative", "cooperative"), num_games=12, seed=1, n=3)
    assert summarize(games).stated_value_accuracy == 1.0
    s = games[0].scenario
    view = s.view(0)
    r, p = next((r, p) for r, row in enumerate(view) for p, v in enumerate(row) if v is not None)
    q = next(q for q in range(3) if view[r][q] != view[r][p])  # another paper, another value
    wrong = f"[message] My known scores: {REVIEWERS[r]}: {PAPERS_SHORT[q]} {view[r][p]}"
    assert MATCHING.check_statements(wrong, s, 0) == (1, 0)
    assert MATCHING.check_statements("[message] Hello!", s, 0) == (0, 0)
    lines = GAMES["matching-lines"].intro(s, 1).split("Scores:\n")[1].split("\n\n")[0]
    said = "[message] " + "; ".join(x for x in lines.split("\n") if not x.endswith("none"))
    known = sum(v is not None for row in s.view(1) for v in row)
    assert MATCHING.check_statements(said, s, 1) == (known, known)
    silent = [g.model_copy(update={"actions": [a for a in g.actions if a.kind != "message"]})
              for g in games]  # fmt: skip
    assert math.isnan(summarize(silent).stated_value_accuracy)
