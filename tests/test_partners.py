"""Fixed partners: the --partner spec, --policy-seat, scripted partners in either seat, and the API
partner against a local chat-completions stand-in (persona, retries, cache, call cap, no key leak).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from selfplay.cli import app
from selfplay.convert import ConvertConfig, convert
from selfplay.engines import HFEngineConfig
from selfplay.game.api import Outcome
from selfplay.game.matching import MATCHING
from selfplay.generate.config import GenerateConfig
from selfplay.generate.output import OutputMismatch
from selfplay.generate.runner import generate_games, partner_config
from selfplay.iterate.config import IterateConfig, IterateError
from selfplay.iterate.loop import iterate
from selfplay.iterate.resume import Run
from selfplay.metrics import summarize
from selfplay.players.api import PartnerCallCap, open_partner_client
from selfplay.players.llm import ChatFormat, load_chat_format
from selfplay.players.partners import (
    OpenAIPartner,
    ScriptedPartner,
    SelfPlay,
    parse_partner,
    stored_partner,
)
from selfplay.records import GameRecord, ReadReport, SamplingParams, iter_game_records
from tests.chat_standin import ChatStandIn
from tests.fakes import (
    PARTNER_KEY_ENV,
    PARTNER_MODEL,
    PARTNER_SECRET,
    MovesEngine,
    generate_beside_api_partner,
    mask_runs,
)

KEY_ENV, SECRET, MODEL = PARTNER_KEY_ENV, PARTNER_SECRET, PARTNER_MODEL
QUESTION = "[message] What is the score of Ava Li on BLEU?"

# ---------------------------------------------------------------------------------------------
# the spec


@pytest.mark.parametrize(
    "text, spec, canonical",
    [
        (None, SelfPlay(), None),
        ("", SelfPlay(), None),
        ("self", SelfPlay(), None),
        ("scripted:shy", ScriptedPartner("shy"), "shy"),
        ("scripted:cooperative", ScriptedPartner("cooperative"), "cooperative"),
        ("shy", ScriptedPartner("shy"), "shy"),  # the bare name of earlier versions
        ("no-talk", ScriptedPartner("no-talk"), "no-talk"),
        ("openai:gpt-4.1", OpenAIPartner("gpt-4.1"), "openai:gpt-4.1"),
        ("openai:org/model:v2", OpenAIPartner("org/model:v2"), "openai:org/model:v2"),
    ],
)
def test_parse_partner(text, spec, canonical):
    names = MATCHING.scripted_names
    assert parse_partner(text, names) == spec
    assert stored_partner(parse_partner(text, names)) == canonical
    # idempotent: stored values re-parse
    assert stored_partner(parse_partner(canonical, names)) == canonical


@pytest.mark.parametrize(
    "text, message",
    [
        ("scripted:greedy", "not a scripted policy"),
        ("greedy", "not a scripted policy"),
        ("openai:", "needs a model name"),
        ("anthropic:claude", "unknown partner"),
    ],
)
def test_parse_partner_rejects_with_the_accepted_forms(text, message):
    with pytest.raises(ValueError, match=message):
        parse_partner(text, MATCHING.scripted_names)


def _gen(out: Path, **kw) -> GenerateConfig:
    defaults = dict(
        out=out,
        num_games=4,
        model="m",
        table_size=3,
        games_per_scenario=1,
        sampling=SamplingParams(temperature=0.7, max_new_tokens=24),
    )
    return GenerateConfig(**(defaults | kw))


@pytest.mark.parametrize(
    "kw, field, message",
    [
        ({"policy_seat": 2}, "policy_seat", "needs a --partner"),
        ({"policy_seat": 3, "partner": "shy"}, "policy_seat", "1 or 2"),
        ({"partner": "shy", "partner_max_calls": 5}, "partner_max_calls", "openai:MODEL"),
        ({"partner_base_url": "http://x"}, "partner_base_url", "openai:MODEL"),
        ({"partner": "openai:m", "partner_max_calls": 0}, "partner_max_calls", "greater"),
        ({"partner": "bogus"}, "partner", "not a scripted policy"),
    ],
)
def test_generate_config_names_the_bad_partner_field(tmp_path, kw, field, message):
    with pytest.raises(ValidationError) as err:
        _gen(tmp_path, **kw)
    e = err.value.errors()[0]
    assert e["loc"] == (field,) and message in e["msg"]


def test_a_pasted_key_is_refused_without_being_echoed(tmp_path):
    with pytest.raises(ValidationError) as err:
        _gen(tmp_path, partner="openai:m", partner_key_env=SECRET)
    assert err.value.errors()[0]["loc"] == ("partner_key_env",)
    assert SECRET not in err.value.errors()[0]["msg"]


def test_identity_has_the_partner_but_not_the_cap_or_key_name(tmp_path):
    old = _gen(tmp_path, partner="scripted:shy").identity()
    assert old["partner"] == "shy"
    # fields added later stay out at their old value, so earlier folders still resume
    assert "policy_seat" not in old and "partner_base_url" not in old
    api = _gen(
        tmp_path,
        partner="openai:gpt-4.1",
        policy_seat=2,
        partner_base_url="http://h/v1",
        partner_max_calls=9,
        partner_key_env="OTHER_KEY",
    ).identity()
    assert api["partner"] == "openai:gpt-4.1"
    assert api["policy_seat"] == 2 and api["partner_base_url"] == "http://h/v1"
    assert "partner_max_calls" not in api and "partner_key_env" not in api


# ---------------------------------------------------------------------------------------------
# a token engine that plays valid moves: asks one direct question, proposes, accepts


@pytest.fixture(scope="module")
def chat(tiny_model) -> ChatFormat:
    return load_chat_format(str(tiny_model))


def read(path: Path) -> list[GameRecord]:
    report = ReadReport()
    records = list(iter_game_records(path, report))
    assert report.skipped == []
    return records


def play(cfg: GenerateConfig, chat: ChatFormat, **client_kw):
    """Generate with the AskingEngine; an API partner through the real client (fast backoff)."""

    async def go():
        api = partner_config(cfg)
        client = None
        if api is not None:
            client = open_partner_client(api.model_copy(update={"backoff_s": 0.01, **client_kw}))
        try:
            return await generate_games(
                cfg,
                MovesEngine(chat, first_move=QUESTION, name="asking"),
                chat,
                partner_client=client,
            )
        finally:
            if client is not None:
                await client.aclose()

    return asyncio.run(go())


def check_trained_seat(record: GameRecord, seat: int, chat: ChatFormat) -> None:
    """Only ``seat`` is trained and has tokens; its mask-1 runs are exactly its own actions and
    every partner turn sits in its mask-0 tokens."""
    other = 1 - seat
    assert record.seats[seat].kind == "llm" and record.seats[seat].trained
    assert not record.seats[other].trained and record.tokens[other] is None
    t = record.tokens[seat]
    own = [a.text for a in record.actions if a.seat == seat]
    runs = mask_runs(t.token_ids, t.mask)
    assert [chat.decode(r[:-1]) for r in runs] == own
    context = chat.decode([i for i, m in zip(t.token_ids, t.mask) if m == 0])
    for a in record.actions:
        if a.seat == other:
            assert a.text in context


# ---------------------------------------------------------------------------------------------
# scripted partners in either seat


@pytest.mark.parametrize("policy_seat", [1, 2])
def test_scripted_shy_partner_in_either_seat(tmp_path, chat, policy_seat):
    cfg = _gen(
        tmp_path / "run",
        model="tiny",
        partner="scripted:shy",
        policy_seat=policy_seat,
        num_games=4,
        games_per_scenario=2,
    )
    result = play(cfg, chat)
    records = read(cfg.games_path)
    assert len(records) == 4
    seat, other = policy_seat - 1, 2 - policy_seat
    for r in records:
        assert r.seats[other].kind == "scripted" and r.seats[other].name == "shy"
        check_trained_seat(r, seat, chat)
        assert r.actions[0].seat == 0  # seat index 0 always moves first
        if policy_seat == 2:  # the partner opens, volunteering nothing
            assert r.actions[0].text == "[message] Hello."
        # the model's direct question is answered with the partner's own value of that cell
        ask = next(i for i, a in enumerate(r.actions) if a.seat == seat)
        assert r.actions[ask].text == QUESTION
        value = r.scenario.view(other)[0][0]
        expected = (
            f"[message] Ava Li on BLEU: {value}."
            if value is not None
            else "[message] I don't know the score for Ava Li on BLEU."
        )
        assert r.actions[ask + 1].text == expected
    # the question metrics see the model's seat asking one direct question per game
    s = result.summary
    # (the shy seat's "I don't know the score for ..." also reads as a question to the detector)
    assert getattr(s, f"questions_per_game_seat{seat}") == 1.0
    assert s.games == 4 and s.questions_per_game == summarize(records).questions_per_game
    # convert makes rows for the model's seat only
    conv = convert(
        ConvertConfig(games=cfg.games_path, out=tmp_path / "rows", val_fraction=0.0,
                      keep_degenerate=True)
    )  # fmt: skip
    seats = set(pq.read_table(conv.train_path, columns=["seat"]).column("seat").to_pylist())
    assert seats == {seat}


def test_resume_refuses_a_changed_partner_or_seat(tmp_path, chat):
    out = tmp_path / "run"
    play(_gen(out, model="tiny", partner="scripted:shy", num_games=2), chat)
    for kw in ({"partner": "scripted:cooperative"}, {"partner": "shy", "policy_seat": 2}):
        with pytest.raises(OutputMismatch, match=r"partner|policy_seat"):
            play(_gen(out, model="tiny", num_games=2, **kw), chat)
    # the bare name is the same partner: resumes (nothing left to play)
    assert play(_gen(out, model="tiny", partner="shy", num_games=2), chat).stats.played == 0


# ---------------------------------------------------------------------------------------------
# the API partner against the stand-in


@pytest.fixture
def key(monkeypatch) -> str:
    monkeypatch.setenv(KEY_ENV, SECRET)
    return SECRET


def _api(out: Path, url: str, **kw) -> GenerateConfig:
    defaults = dict(
        model="tiny",
        partner=f"openai:{MODEL}",
        partner_base_url=url,
        partner_key_env=KEY_ENV,
        num_games=4,
    )
    return _gen(out, **(defaults | kw))


def _without_timings(records: list[GameRecord]) -> dict[str, dict]:
    return {r.game_id: r.model_dump(mode="json", exclude={"timings"}) for r in records}


def test_api_partner_sends_the_shy_persona_retries_429_and_counts(tmp_path, chat, key):
    with ChatStandIn() as standin:
        standin.fail_next(2)  # the first request is answered 429 twice, then served
        cfg = _api(tmp_path / "run", standin.url, num_games=2)
        result = play(cfg, chat)
    assert [r["status"] for r in standin.requests[:3]] == [429, 429, 200]
    answered = standin.answered
    assert len(answered) == 4  # 2 games x (answer the question, judge the proposal)
    for r in answered:
        body = r["body"]
        assert body["model"] == MODEL and body["temperature"] == 0.0
        assert body["messages"][0] == {"role": "system", "content": MATCHING.partner_persona}
        roles = [m["role"] for m in body["messages"][1:]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        assert r["headers"]["authorization"] == f"Bearer {SECRET}"
    records = read(cfg.games_path)
    for r in records:
        assert r.outcome == Outcome.ACCEPTED
        assert r.seats[1].kind == "api" and r.seats[1].name == MODEL
        check_trained_seat(r, 0, chat)
    usage = result.summary.partner
    assert usage["calls"] == 4 and usage["retries"] == 2 and usage["cache_hits"] == 0
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert result.summary.questions_per_game_seat0 == 1.0


def test_api_partner_moves_first_with_policy_seat_2(tmp_path, chat, key):
    with ChatStandIn() as standin:
        cfg = _api(tmp_path / "run", standin.url, num_games=2, policy_seat=2)
        play(cfg, chat)
    first = standin.answered[0]["body"]["messages"]
    assert len(first) == 2 and "Reviewer Paper Similarity" in first[1]["content"]
    for r in read(cfg.games_path):
        assert r.actions[0].seat == 0 and r.seats[0].kind == "api"
        check_trained_seat(r, 1, chat)


def test_cache_replays_a_repeated_run_without_new_requests(tmp_path, chat, key, caplog):
    out = tmp_path / "run"
    with ChatStandIn() as standin:
        # 2 scenarios x 2 games: the same scenario's games have the same dialogue, so they share
        # one call per partner turn (in flight or from the cache)
        cfg = _api(out, standin.url, num_games=4, games_per_scenario=2)
        first = play(cfg, chat)
        paid = len(standin.requests)
        assert paid == 4 and first.summary.partner["calls"] == 4
        assert first.summary.partner["cache_hits"] + first.summary.partner["shared"] == 4
        records = _without_timings(read(cfg.games_path))
        # repeat the run from scratch, with a torn line at the end of the cache
        (out / "games.jsonl").unlink()
        with (out / "partner_cache.jsonl").open("ab") as f:
            f.write(b'{"key": "abc", "model": "standin-mo')
        with caplog.at_level(logging.WARNING):
            again = play(cfg, chat)
        assert "torn" in caplog.text
        assert len(standin.requests) == paid  # the stand-in saw nothing new
    assert again.summary.partner["calls"] == 0
    assert again.summary.partner["cache_hits"] == 8
    assert _without_timings(read(cfg.games_path)) == records


@pytest.mark.parametrize("concurrency", [1, None])
def test_call_cap_stops_cleanly_keeps_finished_games_and_resumes(tmp_path, chat, key, concurrency):
    out = tmp_path / "run"
    with ChatStandIn() as standin:
        # 6 games on 6 scenarios, 2 partner calls each: 12 calls in all
        cfg = _api(out, standin.url, num_games=6, concurrency=concurrency, partner_max_calls=5)
        with pytest.raises(PartnerCallCap, match="--partner-max-calls") as err:
            play(cfg, chat)
        assert "finished games are kept" in str(err.value)
        assert len(standin.requests) == 5  # exactly the cap
        # one game at a time: 2 finished; all at once: the 6 first turns alone pass the cap
        kept = read(cfg.games_path) if cfg.games_path.exists() else []
        assert len(kept) == (2 if concurrency == 1 else 0)
        for r in kept:  # only whole games: none cut off by the cap
            assert r.outcome == Outcome.ACCEPTED and len(r.actions) == 4
        # a higher cap resumes: the 5 paid answers are replayed from the cache
        more = _api(out, standin.url, num_games=6, concurrency=concurrency, partner_max_calls=50)
        result = play(more, chat)
        assert len(standin.requests) == 12  # every answer paid exactly once over both runs
    assert result.stats.resumed == len(kept) and result.stats.played == 6 - len(kept)
    records = read(cfg.games_path)
    assert len({r.game_id for r in records}) == len(records) == 6
    assert all(r.outcome == Outcome.ACCEPTED for r in records)
    usage = [orjson.loads(x) for x in (out / "partner_usage.jsonl").read_bytes().splitlines()]
    assert [u["capped"] for u in usage] == [True, False]
    assert sum(u["calls"] for u in usage) == 12


def _files_containing(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_cli_generate_with_an_api_partner_never_writes_the_key(tmp_path, primed_model):
    out = tmp_path / "run"
    runner = CliRunner()
    with ChatStandIn() as standin:
        args = [
            "generate", "--model", str(primed_model), "--out", str(out), "--device", "cpu",
            "--num-games", "12", "--games-per-scenario", "2", "--table-size", "3",
            "--max-new-tokens", "48", "--temperature", "0.5",
            "--partner", f"openai:{MODEL}", "--partner-base-url", standin.url,
            "--partner-key-env", KEY_ENV,
        ]  # fmt: skip
        env = {KEY_ENV: SECRET, "TOKENIZERS_PARALLELISM": "false"}
        capped = runner.invoke(app, [*args, "--partner-max-calls", "1"], env=env)
        assert capped.exit_code == 1, capped.output
        assert "--partner-max-calls" in capped.output and SECRET not in capped.output
        assert len(standin.requests) == 1
        res = runner.invoke(app, args, env=env)
        assert res.exit_code == 0, res.output
        assert "partner calls" in res.output and SECRET not in res.output
        assert standin.requests[0]["headers"]["authorization"] == f"Bearer {SECRET}"
    records = read(out / "games.jsonl")
    assert len(records) == 12
    for r in records:
        assert r.seats[1].kind == "api" and r.tokens[1] is None and r.seats[0].trained
    snapshot = json.loads((out / "generate.json").read_text())["identity"]
    assert snapshot["partner"] == f"openai:{MODEL}"
    assert (out / "partner_cache.jsonl").exists() and (out / "partner_usage.jsonl").exists()
    assert _files_containing(tmp_path, SECRET.encode()) == []


def test_a_key_the_server_echoes_reaches_no_record_log_or_output(tmp_path, tiny_model):
    """A 400 whose error text carries the key across the 500-character cut and a tail of it (as
    a server masking the key shows), then answers that echo the key as the partner's words: no
    piece of the key of 8 characters or more is printed or written anywhere (a real generate)."""

    from selfplay.engines.servertext import FRAGMENT

    out = tmp_path / "run"
    echo = "x" * 488 + SECRET + " (key ending in " + SECRET[-10:] + ")"

    def echoing(body: dict) -> str:
        return f"[message] You sent {SECRET}, which ends {SECRET[-9:]}."

    with ChatStandIn(reply=echoing) as standin:
        standin.fail_next(1, 400, echo)
        res = generate_beside_api_partner(tiny_model, out, standin.url, verbose=True)
    assert res.returncode == 0, res.stderr[-3000:]
    records = read(out / "games.jsonl")
    errors = [r.error for r in records if r.outcome == Outcome.ERROR]
    assert len(errors) == 1 and "HTTP 400" in errors[0] and "***" in errors[0], errors
    said = [a.text for r in records for a in r.actions if a.seat == 0]
    assert said and all("***" in t for t in said), said
    pieces = {SECRET[i : i + FRAGMENT] for i in range(len(SECRET) - FRAGMENT + 1)}
    for piece in pieces:
        assert piece not in res.stdout + res.stderr, piece
        assert _files_containing(tmp_path, piece.encode()) == [], piece


def test_cli_rejects_a_policy_seat_without_partner(tmp_path, tiny_model):
    res = CliRunner().invoke(
        app,
        ["generate", "--model", str(tiny_model), "--out", str(tmp_path), "--policy-seat", "2"],
    )
    assert res.exit_code == 1 and "--policy-seat" in res.output and "--partner" in res.output


# ---------------------------------------------------------------------------------------------
# iterate: the options reach every round's generate, and a resume keeps the partner


class _Stop(Exception):
    pass


def _iter_cfg(root: Path, **kw) -> IterateConfig:
    defaults = dict(
        name="shy",
        iterations=1,
        model="m",
        engine=HFEngineConfig(model="m"),
        data_root=root / "data",
        checkpoint_root=root / "ckpt",
        table_size=3,
        partner=f"openai:{MODEL}",
        policy_seat=2,
        partner_base_url="http://127.0.0.1:9/v1",
        partner_key_env=KEY_ENV,
        partner_max_calls=5,
        eval_scenarios=0,
    )
    return IterateConfig(**(defaults | kw))


def test_iterate_passes_partner_options_and_resume_keeps_the_partner(tmp_path):
    seen = []

    def fake_generate(gen_cfg, engine_cfg):
        seen.append(gen_cfg)
        gen_cfg.games_path.write_text("{}\n")  # a game was played: the run has started
        raise _Stop

    cfg = _iter_cfg(tmp_path)
    with pytest.raises(_Stop):
        iterate(cfg, generate=fake_generate)
    g = seen[0]
    assert (g.partner, g.policy_seat, g.partner_base_url) == (
        OpenAIPartner(MODEL),
        2,
        "http://127.0.0.1:9/v1",
    )
    assert (g.partner_key_env, g.partner_max_calls) == (KEY_ENV, 5)
    # a higher cap or another key variable resumes; another partner or seat does not
    Run(_iter_cfg(tmp_path, partner_max_calls=500, partner_key_env="OTHER"))
    for kw in ({"partner": "openai:other"}, {"policy_seat": 1}):
        with pytest.raises(IterateError, match=r"partner|policy_seat"):
            Run(_iter_cfg(tmp_path, **kw))


def test_iterate_manifest_from_before_the_partner_options_still_resumes(tmp_path):
    cfg = _iter_cfg(
        tmp_path,
        partner="shy",
        policy_seat=1,
        partner_base_url=None,
        partner_max_calls=None,
    )
    run = Run(cfg)
    manifest = json.loads(run.path.read_text())
    for k in ("policy_seat", "partner_base_url", "partner_key_env", "partner_max_calls"):
        del manifest["config"][k]
    run.path.write_text(json.dumps(manifest))
    Run(cfg)  # no IterateError


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy-seat", "2"], "--policy-seat"),
        (["--partner", "scripted:greedy"], "--partner"),
        (["--partner", "shy", "--partner-max-calls", "3"], "--partner-max-calls"),
    ],
)
def test_cli_iterate_validates_partner_options(tmp_path, tiny_model, args, message):
    res = CliRunner().invoke(
        app,
        ["iterate", "--model", str(tiny_model), "--data-root", str(tmp_path), *args],
    )
    assert res.exit_code == 1 and message in res.output
    assert not (tmp_path / "selfplay").exists()  # refused before the run was created
