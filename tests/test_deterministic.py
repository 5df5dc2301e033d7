"""`--deterministic`: games that do not depend on timing. With several games in flight on the hf
engine, which requests share a decoding step changes from run to run, and with it the float sums
of a row's logits; deterministic mode decodes each request alone, so two runs of one command, or
a run killed in generate and resumed, play the same games and train the same weights."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import orjson
import pytest

pytestmark = pytest.mark.slow


def _cmd(root, model) -> list[str]:
    return [
        sys.executable, "-m", "selfplay", "iterate", "--name", "det",
        "--data-root", str(root / "data"), "--checkpoint-root", str(root / "checkpoints"),
        "--model", str(model), "--iterations", "1", "--games-per-iter", "16",
        "--games-per-scenario", "4", "--table-size", "3", "--temperature", "1.0",
        "--max-new-tokens", "32", "--max-actions", "8", "--lr", "1e-4",
        "--micro-batch-size", "4", "--seed", "5", "--concurrency", "4", "--deterministic",
        "--eval-scenarios", "2", "--old-log-probs", "rollout", "--no-report",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false"}


def _games(root) -> bytes:
    """games.jsonl as written (deterministic mode keeps no wall-clock seconds in a record)."""
    return (root / "data" / "det" / "round_0" / "games.jsonl").read_bytes()


def _weights(root) -> str:
    path = root / "checkpoints" / "det" / "round_0" / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_deterministic_runs_play_the_same_games_and_train_the_same_weights(primed_model, tmp_path):
    """Two uninterrupted runs at --concurrency 4 --deterministic: byte-identical games.jsonl
    (tokens, log-probs and texts bit for bit; no wall-clock seconds in the records) and the same
    weights; a third run killed with SIGKILL mid-generate and resumed: the same again."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for root in (a, b):
        res = subprocess.run(_cmd(root, primed_model), env=_env(), capture_output=True,
                             text=True, timeout=900)  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
    assert _games(a) == _games(b) and len(_games(a).splitlines()) == 16
    assert all(orjson.loads(x)["timings"] == {} for x in _games(a).splitlines())
    assert _weights(a) == _weights(b)
    proc = subprocess.Popen(_cmd(c, primed_model), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    games = c / "data" / "det" / "round_0" / "games.jsonl"
    deadline = time.time() + 600
    while not (games.exists() and len(games.read_bytes().splitlines()) >= 5):
        assert proc.poll() is None and time.time() < deadline, "no kill point reached"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    res = subprocess.run(_cmd(c, primed_model), env=_env(), capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert _games(c) == _games(a) and _weights(c) == _weights(a)


def test_deterministic_means_one_request_a_step_and_no_prefix_cache():
    from selfplay.engines import HFEngineConfig

    cfg = HFEngineConfig(model="m", deterministic=True, max_batch_size=64)
    assert (cfg.max_batch_size, cfg.prefix_cache_tokens) == (1, 0)
    assert HFEngineConfig(model="m").max_batch_size == 64


def test_a_launched_server_gets_its_batch_invariant_mode_from_deterministic(monkeypatch):
    """--deterministic on a server engine: SGLang is launched with
    --enable-deterministic-inference, vLLM with VLLM_BATCH_INVARIANT=1; without it, neither."""
    from selfplay.engines import SGLangEngineConfig, VLLMEngineConfig
    from selfplay.engines.sglang import SGLangEngine
    from selfplay.engines.vllm import VLLMEngine

    for on in (True, False):
        cmd = SGLangEngine(SGLangEngineConfig(model="m", deterministic=on)).command()
        assert ("--enable-deterministic-inference" in cmd) is on
        env = VLLMEngine(VLLMEngineConfig(model="m", deterministic=on)).environment()
        assert (env.get("VLLM_BATCH_INVARIANT") == "1") is on
