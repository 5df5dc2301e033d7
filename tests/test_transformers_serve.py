"""The API partner against a real OpenAI-compatible server: `transformers serve` (from the
transformers package, its `serving` extra), started here on 127.0.0.1 with the tiny test model.

The hand-written stand-in (tests/chat_standin.py) checks the wire format in detail; this checks
that the same client works with a real server's chat completions: the persona is sent, answers
are cached (a repeated run pays nothing), the call cap stops the run cleanly, and the key is
sent as a bearer token but never written to any file or the output.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from selfplay.cli import app
from selfplay.records import iter_game_records
from tests.servers import free_port, wait_healthy

pytestmark = pytest.mark.slow

KEY_ENV = "SERVE_TEST_KEY"
SECRET = "sk-serve-test-0123456789abcdef"


def _serving_missing() -> str | None:
    try:
        import fastapi  # noqa: F401
        import openai  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return f"the transformers serving extra is not installed ({e.name} missing)"
    cli = Path(sys.executable).with_name("transformers")
    return None if cli.exists() or shutil.which("transformers") else "no `transformers` CLI"


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """(base URL, model name) of `transformers serve` pinned to the tiny model."""
    reason = _serving_missing()
    if reason:
        pytest.skip(reason)
    port = free_port()
    cli = Path(sys.executable).with_name("transformers")
    log = (tmp_path_factory.mktemp("serve") / "serve.log").open("wb")
    proc = subprocess.Popen(
        [str(cli if cli.exists() else "transformers"), "serve", str(tiny_model),
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=180)  # its log has why, if it exits
        yield f"{url}/v1", str(tiny_model)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _files_containing(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_api_partner_against_transformers_serve(served, primed_model, tmp_path):
    url, model = served
    out = tmp_path / "run"
    args = [
        "generate", "--model", str(primed_model), "--out", str(out), "--device", "cpu",
        "--num-games", "4", "--games-per-scenario", "2", "--table-size", "3",
        "--max-new-tokens", "32", "--max-actions", "6", "--temperature", "0.5",
        "--partner", f"openai:{model}", "--partner-base-url", url, "--partner-key-env", KEY_ENV,
    ]  # fmt: skip
    env = {KEY_ENV: SECRET, "TOKENIZERS_PARALLELISM": "false"}
    runner = CliRunner()
    capped = runner.invoke(app, [*args, "--partner-max-calls", "1"], env=env)
    assert capped.exit_code == 1 and "--partner-max-calls" in capped.output
    done = runner.invoke(app, args, env=env)
    assert done.exit_code == 0, done.output
    records = list(iter_game_records(out / "games.jsonl"))
    assert len(records) == 4
    assert all(r.seats[1].kind == "api" and r.seats[1].name == model for r in records)
    assert any(a.seat == 1 for r in records for a in r.actions)  # the served model played
    usage = [json.loads(x) for x in (out / "partner_usage.jsonl").read_text().splitlines()]
    assert [u["capped"] for u in usage] == [True, False]
    assert usage[0]["calls"] == 1 and usage[1]["calls"] >= 1
    # the same games again from scratch: every answer comes from the cache, none from the server
    (out / "games.jsonl").unlink()
    again = runner.invoke(app, args, env=env)
    assert again.exit_code == 0, again.output
    last = json.loads((out / "partner_usage.jsonl").read_text().splitlines()[-1])
    assert last["calls"] == 0 and last["cache_hits"] >= 1
    for result in (capped, done, again):
        assert SECRET not in result.output
    assert _files_containing(tmp_path, SECRET.encode()) == []


def test_iterate_against_a_served_partner(served, primed_model, tmp_path):
    """The shy-partner recipe with an API partner: a round of GRPO against the served model and
    the held-out evaluation against the same partner; the key reaches no file."""
    url, model = served
    args = [
        "iterate", "--name", "served", "--data-root", str(tmp_path / "data"),
        "--checkpoint-root", str(tmp_path / "ckpt"), "--model", str(primed_model),
        "--device", "cpu", "--iterations", "1", "--games-per-iter", "4",
        "--games-per-scenario", "2", "--table-size", "3", "--max-new-tokens", "24",
        "--max-actions", "6", "--temperature", "1.0", "--micro-batch-size", "2",
        "--eval-scenarios", "2", "--partner", f"openai:{model}", "--partner-base-url", url,
        "--partner-key-env", KEY_ENV, "--policy-seat", "2",  # the served partner moves first
    ]  # fmt: skip
    env = {KEY_ENV: SECRET, "TOKENIZERS_PARALLELISM": "false"}
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    run = tmp_path / "data" / "served"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["config"]["partner"] == f"openai:{model}"
    assert set(manifest["rounds"]["0"]["stages"]) == {"generate", "convert", "train"}
    games = list(iter_game_records(run / "round_0" / "games.jsonl"))
    assert len(games) == 4 and all(g.seats[0].kind == "api" for g in games)
    usage = [
        json.loads(x) for x in (run / "round_0" / "partner_usage.jsonl").read_text().splitlines()
    ]
    assert usage and usage[-1]["calls"] >= 1
    # held-out games before and after the round, against the same served partner
    for k in ("0", "1"):
        assert manifest["heldout"][k]["games"] == 2
    held = run / "eval" / "after_0_rounds" / "games" / "model-model.jsonl"
    assert all(g.seats[0].kind == "api" for g in iter_game_records(held))
    assert (run / "REPORT.md").exists()
    assert SECRET not in result.output
    assert _files_containing(tmp_path, SECRET.encode()) == []
