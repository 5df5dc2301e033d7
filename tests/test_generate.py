"""`selfplay generate` end to end on CPU: token-exact records, resume, options, a dying server."""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from pathlib import Path

import orjson
import pytest
import torch
from typer.testing import CliRunner

from selfplay.engines import EngineFailure, SGLangEngineConfig
from selfplay.game.api import Outcome
from selfplay.generate.config import GenerateConfig
from selfplay.generate.output import OutputMismatch, plan_games
from selfplay.generate.runner import generate_games, run_generate
from selfplay.metrics import summarize
from selfplay.players.llm import ChatFormat, load_chat_format
from selfplay.records import GameRecord, ReadReport, SamplingParams, iter_game_records
from tests.fakes import MovesEngine, mask_runs
from tests.sglang_standin import install_fake_sglang

TESTS = Path(__file__).resolve().parent


def config(out: Path, model: Path, **kw) -> GenerateConfig:
    defaults = dict(
        out=out,
        num_games=8,
        model=str(model),
        table_size=3,
        games_per_scenario=4,
        sampling=SamplingParams(temperature=0.7, max_new_tokens=24),
    )
    return GenerateConfig(**(defaults | kw))


def read(path: Path) -> list[GameRecord]:
    report = ReadReport()
    records = list(iter_game_records(path, report))
    assert report.skipped == []
    return records


def check_tokens(record: GameRecord, chat: ChatFormat) -> None:
    """For each LLM seat: its mask-1 runs, decoded exactly (special tokens kept, no clean-up),
    are its own action texts in order, each followed by the text of the stop token that ended it
    (when one did); every mask-1 token has a real log-prob, every mask-0 token 0.0."""
    for seat, tokens in enumerate(record.tokens):
        if tokens is None:
            continue
        own = [a.text for a in record.actions if a.seat == seat]
        runs = mask_runs(tokens.token_ids, tokens.mask)
        assert len(runs) == len(own)
        for run, text in zip(runs, own):
            stop = run[-1] in chat.stop_token_ids and chat.decode(run[:-1]) == text
            assert chat.decode(run) == (text + chat.decode(run[-1:]) if stop else text)
        for lp, m in zip(tokens.logprobs, tokens.mask):
            assert (math.isfinite(lp) and lp <= 0.0) if m else lp == 0.0
        assert any(lp < 0 for lp in tokens.logprobs) or not own  # a seat that never acted
        assert tokens.tokenizer_fingerprint == chat.fingerprint


def test_end_to_end_tiny_model_records_are_token_exact(tiny_model, tmp_path):
    from selfplay.engines import HFEngineConfig

    cfg = config(tmp_path / "run", tiny_model)
    result = run_generate(cfg, HFEngineConfig(model=str(tiny_model), device="cpu"))
    records = read(cfg.games_path)
    assert len(records) == 8 == len({r.game_id for r in records}) == result.stats.played
    assert result.summary.games == 8
    chat = load_chat_format(str(tiny_model))
    for r in records:
        # the random tiny model emits garbage: games end as data, never as a crash
        assert r.outcome in (Outcome.INVALID, Outcome.MAX_ACTIONS)
        check_tokens(r, chat)
    # K = 4 games per scenario, distinct sampling seeds, ids from (round, scenario seed, k)
    specs = list(plan_games(cfg))
    assert {r.game_id for r in records} == {s.game_id for s in specs}
    by_scenario = {}
    for r in records:
        by_scenario.setdefault(r.scenario_id, []).append(r)
    assert sorted(len(v) for v in by_scenario.values()) == [4, 4]
    assert len({r.seats[0].sampling.seed for r in records}) == 8
    # the recorded log-probs are the model's own: recompute one seat by teacher forcing
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    t = records[0].tokens[0]
    with torch.no_grad():
        logits = model(torch.tensor([t.token_ids])).logits[0].float() / 0.7
    logp = torch.log_softmax(logits, -1)
    for i, (tok, m, lp) in enumerate(zip(t.token_ids, t.mask, t.logprobs)):
        if m:
            assert abs(logp[i - 1, tok].item() - lp) < 1e-3


def play(cfg: GenerateConfig, engine) -> object:
    chat = engine.chat

    async def go():
        return await generate_games(cfg, engine, chat)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def chat(tiny_model) -> ChatFormat:
    return load_chat_format(str(tiny_model))


def test_valid_games_end_accepted_and_keep_exact_tokens(tiny_model, tmp_path, chat):
    cfg = config(tmp_path / "run", tiny_model, num_games=6, games_per_scenario=3)
    result = play(cfg, MovesEngine(chat, 3, name="policy"))
    records = read(cfg.games_path)
    assert len(records) == 6
    for r in records:
        assert r.outcome == Outcome.ACCEPTED and r.reward > 0
        assert [a.kind for a in r.actions] == ["message", "message", "propose", "accept"]
        check_tokens(r, chat)
    assert result.summary.agreement_rate == 1.0
    assert result.stats.generated_tokens > 0
    # a scripted partner in seat 2 has no tokens; the LLM seat still does
    cfg2 = config(tmp_path / "partner", tiny_model, num_games=2, partner="cooperative")
    play(cfg2, MovesEngine(chat, 3, name="policy"))
    for r in read(cfg2.games_path):
        assert r.tokens[1] is None and r.seats[1].kind == "scripted"
        check_tokens(r, chat)


def test_resume_keeps_finished_games_drops_a_torn_line_and_never_duplicates(
    tiny_model, tmp_path, chat, caplog
):
    out = tmp_path / "run"
    play(config(out, tiny_model, num_games=6), MovesEngine(chat, 3, name="policy"))
    first = {r.game_id: r for r in read(out / "games.jsonl")}
    with (out / "games.jsonl").open("ab") as f:  # a write cut off by a crash
        f.write(b'{"schema_version":1,"game_id":"r0-s1-g0","scen')
    engine = MovesEngine(chat, 3, name="policy")
    with caplog.at_level(logging.WARNING):
        result = play(config(out, tiny_model, num_games=10), engine)
    assert "torn" in caplog.text
    records = read(out / "games.jsonl")
    ids = [r.game_id for r in records]
    assert len(ids) == len(set(ids)) == 10
    assert result.stats.resumed == 6 and result.stats.played == 4
    assert engine.requests == 4 * 4  # only the missing games were played (4 actions each)
    # the summary covers the kept games and the new ones, each once, as a fresh read would
    fresh = summarize(records)
    got, want = result.summary.model_dump(), fresh.model_dump()
    assert got.pop("outcomes") == want.pop("outcomes")
    assert got == pytest.approx(want, nan_ok=True)
    for r in records[:6]:  # finished games are untouched
        assert r == first[r.game_id]
    again = MovesEngine(chat, 3, name="policy")
    result = play(config(out, tiny_model, num_games=10), again)
    assert again.requests == 0 and result.stats.played == 0
    assert result.summary.games == 10
    assert len(read(out / "games.jsonl")) == 10


def test_a_rerun_with_other_options_is_refused(tiny_model, tmp_path, chat):
    out = tmp_path / "run"
    play(config(out, tiny_model, num_games=2), MovesEngine(chat, 3, name="policy"))
    with pytest.raises(OutputMismatch, match="seed: was 0, now 5"):
        play(config(out, tiny_model, num_games=2, seed=5), MovesEngine(chat, 3, name="policy"))


def test_same_seed_same_games(tiny_model, tmp_path):
    from selfplay.engines import HFEngineConfig

    def strip(r: GameRecord) -> dict:
        d = r.model_dump(exclude={"timings"})
        d["logprobs"] = [t.pop("logprobs") for t in d["tokens"] if t]
        return d

    runs = []
    for name in ("a", "b"):
        cfg = config(tmp_path / name, tiny_model, num_games=4, games_per_scenario=2)
        run_generate(cfg, HFEngineConfig(model=str(tiny_model), device="cpu"))
        runs.append(sorted((strip(r) for r in read(cfg.games_path)), key=lambda d: d["game_id"]))
    lp = [[d.pop("logprobs") for d in run] for run in runs]
    assert runs[0] == runs[1]  # same scenarios, seeds, tokens, actions, outcomes
    # log-probs agree up to float noise (rows may share a batch with other rows in another run)
    for a, b in zip(lp[0], lp[1]):
        for x, y in zip(a, b):
            assert all(abs(p - q) < 1e-5 for p, q in zip(x, y))


def test_a_server_dying_mid_run_is_a_clear_error_and_finished_games_are_kept(
    tiny_model, tmp_path, monkeypatch
):
    from tests.servers import free_port

    monkeypatch.setenv("PYTHONPATH", str(install_fake_sglang(tmp_path / "fake")))
    pid_file = tmp_path / "server.pid"
    cfg = config(tmp_path / "run", tiny_model, num_games=8, concurrency=1)
    engine_cfg = SGLangEngineConfig(
        model=str(tiny_model),
        python=sys.executable,
        port=free_port(),
        extra_args=("--die-after", "7", "--pid-file", str(pid_file)),
        log_path=str(tmp_path / "sglang.log"),
        retries=1,
        backoff_s=0.05,
        startup_timeout_s=120,
    )
    with pytest.raises(EngineFailure) as err:
        run_generate(cfg, engine_cfg)
    message = str(err.value)
    assert "exited with code 1" in message and "re-run the same command" in message
    records = read(cfg.games_path)
    assert 1 <= len(records) < 8  # every game that finished before the crash is on disk
    assert all(r.outcome != Outcome.ERROR for r in records)
    lines = cfg.games_path.read_bytes().splitlines()
    assert [orjson.loads(x)["game_id"] for x in lines] == [r.game_id for r in records]
    import os

    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_cli_generate_smoke_and_env_vars(tiny_model, tmp_path, monkeypatch):
    from selfplay.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EXP_NAME", "exp1")
    monkeypatch.setenv("NUM_GAMES", "2")
    monkeypatch.setenv("MAX_LENGTH", "4")
    monkeypatch.setenv("TEMPERATURE", "0.9")
    monkeypatch.setenv("MODEL_NAME", str(tiny_model))
    args = ["generate", "--table-size", "3", "--max-new-tokens", "8", "--games-per-scenario", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    records = read(tmp_path / "data" / "exp1" / "games.jsonl")
    assert len(records) == 2
    assert records[0].seats[0].sampling.temperature == 0.9
    assert all(len(r.actions) <= 4 for r in records)
    assert "reward mean" in result.output
    seen = []

    def no_engine(cfg):
        seen.append(cfg)
        raise RuntimeError("only the engine config is looked at")

    monkeypatch.setattr("selfplay.generate.runner.open_engine", no_engine)
    CliRunner().invoke(app, [*args, "--num-games", "4", "--prefix-cache-tokens", "0"])
    assert seen and seen[0].prefix_cache_tokens == 0  # the flag reaches the engine config
    bad = CliRunner().invoke(app, ["generate", "--engine-url", "http://x:1"])
    assert bad.exit_code == 1
