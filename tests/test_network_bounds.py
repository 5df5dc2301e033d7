"""Every network call has a deadline and every answer a size cap (``selfplay/engines/bounded.py``),
against stub servers: one that drips its answer a byte at a time (httpx's read timeout alone
would wait for good), a 429 with a Retry-After of 1e9 seconds, and answers over their cap. Each
test asserts a bounded time, one clear message (one warning per failed attempt), and that no
over-cap text reaches a record, a log or a file. The fault table (docs/guide/faults.md) names
these tests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from selfplay.engines import (
    EngineFailure,
    EngineRequestError,
    GenerationRequest,
    SGLangEngineConfig,
    bounded,
)
from selfplay.engines.openai import OpenAIEngine, OpenAIEngineConfig
from selfplay.engines.sglang import SGLangEngine
from selfplay.game.api import Outcome
from selfplay.players.llm import ChatFormat, load_chat_format
from tests.chat_standin import ChatStandIn, shy_reply
from tests.fakes import PARTNER_KEY_ENV as KEY_ENV
from tests.fakes import PARTNER_MODEL as MODEL
from tests.fakes import PARTNER_SECRET as SECRET
from tests.fakes import generate_beside_api_partner
from tests.fakes import subprocess_env as _env
from tests.servers import Reply, stub_server
from tests.test_partners import _api, play, read


@pytest.fixture(scope="module")
def chat(tiny_model) -> ChatFormat:
    return load_chat_format(str(tiny_model))


@pytest.fixture
def key(monkeypatch) -> str:
    monkeypatch.setenv(KEY_ENV, SECRET)
    return SECRET


def _warnings(caplog) -> list[str]:
    """The retry warnings logged (one per failed attempt)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "(attempt " in r.getMessage()
    ]


def _files_containing(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


# ---------------------------------------------------------------------------------------------
# the API partner


def test_a_partner_that_drips_its_answer_fails_within_the_deadline(tmp_path, chat, key, caplog):
    """A byte every 0.2 s never trips httpx's read timeout; the attempt's 1 s and the call's
    2.5 s deadline end it, with one warning per attempt and the deadline said."""
    with stub_server([Reply(body=b"x" * 200, drip_s=0.2)]) as (url, seen):
        cfg = _api(tmp_path / "run", url + "/v1", num_games=1)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING), pytest.raises(EngineFailure) as err:
            play(cfg, chat, request_timeout_s=1.0, deadline_s=2.5, retries=5)
        spent = time.monotonic() - started
    assert spent < 10, spent
    said = str(err.value)
    assert f"{MODEL} at {url}/v1 failed 3 times in" in said, said
    assert "within the call's deadline of 2.5 s (last: ReadTimeout: no whole answer" in said
    assert "finished games are kept" in said
    warned = _warnings(caplog)
    assert len(warned) == 3, warned
    assert "no whole answer within 1 s (attempt 1 of 6); retrying in 0.0 s" in warned[0]
    assert "(attempt 2 of 6); retrying in" in warned[1]
    assert "(attempt 3 of 6); a retry in" in warned[2], warned[2]
    assert "would start past the call's 2.5 s deadline: giving up" in warned[2]
    assert seen == ["/v1/chat/completions"] * 3


def test_a_huge_retry_after_is_waited_only_up_to_the_cap(tmp_path, chat, key, caplog, monkeypatch):
    """429 with Retry-After: 1e9 waits the cap (lowered here to 0.5 s), says so, then plays on."""
    monkeypatch.setattr(bounded, "MAX_RETRY_AFTER_S", 0.5)
    with ChatStandIn() as standin:
        standin.fail_next(1, 429, retry_after="1e9")
        cfg = _api(tmp_path / "run", standin.url, num_games=1)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            play(cfg, chat)
        spent = time.monotonic() - started
    assert spent < 20, spent
    assert [r["status"] for r in standin.requests[:2]] == [429, 200]
    assert [r.outcome for r in read(cfg.games_path)] == [Outcome.ACCEPTED]
    (warned,) = _warnings(caplog)
    assert "failed: HTTP 429: stand-in says 429 (attempt 1 of 6); retrying in 0.5 s" in warned
    assert "(the server's Retry-After of 1e9 s, capped at 0.5 s)" in warned


def test_a_retry_after_past_the_deadline_fails_at_once(caplog):
    """The default 60 s cap, beyond a 5 s deadline: not waited at all; the call fails at once."""
    answer = httpx.Response(429, headers={"retry-after": "1e9"}, json={"error": {"message": "no"}})
    engine = OpenAIEngine(
        OpenAIEngineConfig(model="m", deadline_s=5.0),
        transport=httpx.MockTransport(lambda r: answer),
    )

    async def go():
        try:
            await engine.chat([{"role": "user", "content": "hi"}])
        finally:
            await engine.aclose()

    started = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(EngineFailure) as err:
        asyncio.run(go())
    assert time.monotonic() - started < 3
    assert "failed once in" in str(err.value)
    assert "within the call's deadline of 5 s (last: HTTP 429: no)" in str(err.value)
    (warned,) = _warnings(caplog)
    assert "(attempt 1 of 6); a retry in 60.0 s (the server's Retry-After of 1e9 s, capped at " in (
        warned
    )
    assert "60 s) would start past the call's 5 s deadline: giving up" in warned


def test_an_over_cap_partner_answer_ends_its_game_as_error_and_is_kept_nowhere(
    tmp_path, tiny_model
):
    """A real generate: the partner's first answer is 3 MiB (the cap is 1 MiB). Reading stops at
    the cap; that game ends with outcome error, the next plays on; no run of the answer is in
    any record, the partner cache, or what was printed."""
    out = tmp_path / "run"
    calls = []

    def huge_first(body: dict) -> str:
        calls.append(body)
        return "[message] " + "Z" * (3 << 20) if len(calls) == 1 else shy_reply(body)

    with ChatStandIn(reply=huge_first) as standin:
        res = generate_beside_api_partner(tiny_model, out, standin.url, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    records = read(out / "games.jsonl")
    errors = [r.error for r in records if r.outcome == Outcome.ERROR]
    assert len(records) == 2 and len(errors) == 1, [r.outcome for r in records]
    assert "EngineRequestError" in errors[0], errors[0]
    assert "the answer to /chat/completions is over 1 MiB (reading stopped there)" in errors[0]
    said = " ".join(res.stderr.split())
    assert "the answer to /chat/completions is over 1 MiB" in said, said[-3000:]
    run = b"Z" * 64
    assert run.decode() not in res.stdout + res.stderr
    assert (out / "partner_cache.jsonl").exists()
    assert _files_containing(tmp_path, run) == []


# ---------------------------------------------------------------------------------------------
# a server engine (SGLang's client; vLLM's shares ServerEngine.generate)

# a /generate answer the client reads (the start-up probe's)
ANSWER = json.dumps(
    {
        "text": "",
        "meta_info": {
            "output_token_logprobs": [[-0.5, 7, None]],
            "completion_tokens": 1,
            "prompt_tokens": 3,
            "finish_reason": {"type": "length"},
        },
    }
).encode()


def _generate_once(url: str, **config) -> None:
    engine = SGLangEngine(SGLangEngineConfig(model="m", url=url, backoff_s=0.0, **config))

    async def go():
        await engine.start()
        try:
            await engine.generate(GenerationRequest([1, 2, 3], max_new_tokens=4))
        finally:
            await engine.aclose()

    asyncio.run(go())


def test_an_engine_that_drips_its_answer_fails_within_its_deadline(caplog):
    """The probe is answered; the generation is dripped a byte every 0.2 s: each attempt ends
    at its 1 s, with a warning each, and the run's error says what happened."""
    replies = [Reply(body=ANSWER), Reply(body=ANSWER, drip_s=0.2)]
    with stub_server(replies) as (url, seen):
        started = time.monotonic()
        with caplog.at_level(logging.WARNING), pytest.raises(EngineFailure) as err:
            _generate_once(url, request_timeout_s=1.0, retries=1)
        spent = time.monotonic() - started
    assert spent < 10, spent
    said = str(err.value)
    assert f"SGLang server at {url} failed 2 times in" in said, said
    assert "(last: ReadTimeout: no whole answer within 1 s)" in said, said
    warned = _warnings(caplog)
    assert warned == [
        "SGLang request failed: ReadTimeout: no whole answer within 1 s (attempt 1 of 2); "
        "retrying in 0.0 s",
        "SGLang request failed: ReadTimeout: no whole answer within 1 s (attempt 2 of 2); "
        "no retries left",
    ]
    assert seen == ["/generate"] * 3


@pytest.mark.parametrize("length", [True, False], ids=["said-in-its-header", "read-to-the-cap"])
def test_an_engine_answer_over_its_cap_fails_only_its_request(monkeypatch, caplog, length):
    """A 200 answer over the generation cap (lowered here to 64 KiB), its length in its header
    or not (then read up to the cap): a request error (the game ends with outcome error), not
    retried, nothing of it in the message."""
    monkeypatch.setattr(bounded, "MAX_GENERATION_BYTES", 64 << 10)
    huge = b'{"text": "' + b"Q" * (1 << 20) + b'"}'
    with (
        stub_server([Reply(body=ANSWER), Reply(body=huge, length=length)]) as (url, seen),
        caplog.at_level(logging.WARNING),
        pytest.raises(EngineRequestError) as err,
    ):
        _generate_once(url)
    said = str(err.value)
    assert f"SGLang at {url}: the answer to /generate is over 64 KiB (reading stopped" in said
    assert "QQQQ" not in said and "QQQQ" not in caplog.text
    assert seen == ["/generate"] * 2


def test_an_engine_error_body_of_megabytes_is_cut_in_records_and_logs(tiny_model, tmp_path):
    """A real generate against a server whose every generation is a 400 with a 5 MiB body: read
    up to 256 KiB, shown and recorded as its first 500 characters; the games end as errors."""
    out = tmp_path / "g"
    body = b'{"error": "' + b"Q" * (5 << 20) + b'"}'
    with stub_server([Reply(body=ANSWER), Reply(400, body)]) as (url, seen):
        cmd = [sys.executable, "-m", "selfplay", "generate", "--engine", "sglang",
               "--engine-url", url, "--model", str(tiny_model), "--out", str(out),
               "--num-games", "2", "--table-size", "3"]  # fmt: skip
        started = time.monotonic()
        res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
        spent = time.monotonic() - started
    assert res.returncode == 0, res.stderr[-3000:]
    records = read(out / "games.jsonl")
    assert [r.outcome for r in records] == [Outcome.ERROR] * 2
    for r in records:
        assert "SGLang refused a request: HTTP 400: " in r.error, r.error
        assert r.error.endswith("..."), r.error
        assert len(r.error) < 700, len(r.error)
    run = "Q" * 600
    assert run not in res.stdout + res.stderr
    assert _files_containing(tmp_path, run.encode()) == []
    assert spent < 120, spent
    assert seen == ["/generate"] * 3  # the probe, then one request a game: a 400 is not retried
