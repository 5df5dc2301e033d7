"""`selfplay generate` as a process: killed with SIGKILL and re-run; Ctrl-C stops the server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from tests.sglang_standin import install_fake_sglang

TESTS = Path(__file__).resolve().parent

SELFPLAY = Path(sys.executable).parent / "selfplay"


def _default_sigint() -> None:
    # a test run started in the background of a non-interactive shell ignores SIGINT, and
    # children inherit that; the command under test must see Ctrl-C as a user's terminal sends it
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [str(SELFPLAY), "generate", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_default_sigint,
        **kw,
    )


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def wait_for_games(path: Path, proc: subprocess.Popen, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while lines(path) < n:
        if proc.poll() is not None:
            pytest.fail(f"generate exited early ({proc.returncode}): {proc.stdout.read()}")
        assert time.monotonic() < deadline, "no games written in time"
        time.sleep(0.05)


def test_sigkill_mid_run_then_rerun_gives_exactly_num_games_unique_games(tiny_model, tmp_path):
    out = tmp_path / "run"
    games = out / "games.jsonl"
    args = ["--num-games", "24", "--out", str(out), "--model", str(tiny_model)]
    args += ["--table-size", "3", "--max-new-tokens", "16", "--concurrency", "2"]
    proc = cli(args)
    wait_for_games(games, proc, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = lines(games)
    assert 3 <= before < 24
    rerun = cli(args)
    output, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, output
    ids = [orjson.loads(x)["game_id"] for x in games.read_bytes().splitlines()]
    assert len(ids) == len(set(ids)) == 24
    assert "played now / kept" in output


def test_ctrl_c_shuts_the_launched_server_down_and_keeps_finished_games(tiny_model, tmp_path):
    from tests.servers import free_port

    out = tmp_path / "run"
    games = out / "games.jsonl"
    pid_file = tmp_path / "server.pid"
    env = dict(os.environ, PYTHONPATH=str(install_fake_sglang(tmp_path / "fake")))
    args = ["--num-games", "5000", "--out", str(out), "--model", str(tiny_model)]
    args += ["--engine", "sglang", "--sglang-python", sys.executable]
    args += ["--sglang-port", str(free_port()), f"--sglang-arg=--pid-file={pid_file}"]
    args += ["--table-size", "3", "--max-new-tokens", "16", "--concurrency", "2"]
    proc = cli(args, env=env)
    wait_for_games(games, proc, 2, timeout=180)
    server = int(pid_file.read_text())
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=300)  # a loaded machine shuts the server down slowly
    assert proc.returncode == 130, output
    assert "interrupted" in output and "re-run the same command" in output
    with pytest.raises(ProcessLookupError):
        os.kill(server, 0)
    ids = [orjson.loads(x)["game_id"] for x in games.read_bytes().splitlines()]
    assert 2 <= len(ids) == len(set(ids)) < 5000
    assert (out / "sglang.log").exists()
