"""Faults a user meets, each a real subprocess on the tiny primed model, killed the way a user's
run would be. The README's fault table names these tests.

- generate: games.jsonl ends in plan order whatever order the games finished in, so a resumed
  run writes the same file (rows, model) as an uninterrupted one; a write that fails (a full disk,
  a file-size limit) stops generate at once, keeping the games written before.
- The iterate process alone killed (SIGKILL, as by the OOM killer or a closed terminal) or
  stopped (SIGTERM, as by a scheduler) during generate: no stage process outlives it by more
  than 30 s, and the same command then runs to the end (nothing holds the run's lock).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from test_iterate import _cmd, _env, _lines, _run

pytestmark = pytest.mark.slow

SURVIVAL_S = 30  # what the README promises: no stage process outlives the loop by longer


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_no_stage_outlives_the_iterate_process(primed_model, tmp_path, sig):
    cmd = _cmd(tmp_path, primed_model, "orphan")
    cmd[cmd.index("--iterations") + 1] = "1"
    cmd[cmd.index("--games-per-iter") + 1] = "48"  # generate outlasts the kill by far
    games = tmp_path / "data" / "orphan" / "round_0" / "games.jsonl"
    proc = subprocess.Popen(
        cmd,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # the signal goes to the parent alone, never to its group
    )
    deadline = time.time() + 600
    while _lines(games) < 2:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "generate never wrote a game"
        time.sleep(0.2)
    stage = _descendants(proc.pid)
    assert stage, "generate runs in a child process"
    os.kill(proc.pid, sig)  # the parent alone
    stderr = proc.communicate(timeout=120)[1].decode()
    if sig == signal.SIGTERM:
        assert proc.returncode == 130 and "interrupted" in stderr, stderr[-3000:]
    stopped = time.time()
    while any(_alive(p) for p in stage) and time.time() - stopped < SURVIVAL_S + 5:
        time.sleep(0.5)
    survivors = [p for p in stage if _alive(p)]
    for p in survivors:  # leave nothing behind, whatever the outcome
        os.kill(p, signal.SIGKILL)
    assert not survivors, f"stage processes outlived the iterate process: {survivors}"
    assert time.time() - stopped < SURVIVAL_S
    kept = _lines(games)
    assert 2 <= kept < 48
    _run(cmd)  # the same command resumes and finishes: nothing holds the run's lock
    assert _lines(games) == 48


# --- generate: the file does not depend on when games finished; a failed write stops at once --


def _generate_cmd(out: Path, model: Path, games: int, concurrency: int) -> list[str]:
    return [
        sys.executable, "-m", "selfplay", "generate", "--out", str(out), "--model", str(model),
        "--num-games", str(games), "--games-per-scenario", "4", "--concurrency", str(concurrency),
        "--table-size", "3", "--max-new-tokens", "24", "--max-actions", "6", "--seed", "1",
        "--temperature", "1.0",
    ]  # fmt: skip


def _ids(path: Path) -> list[str]:
    return [orjson.loads(line)["game_id"] for line in path.read_bytes().splitlines()]


def _plan_ids(out: Path, model: Path, games: int) -> list[str]:
    from selfplay.generate.config import GenerateConfig
    from selfplay.generate.output import plan_games

    cfg = GenerateConfig(out=out, num_games=games, model=str(model), seed=1, table_size=3)
    return [spec.game_id for spec in plan_games(cfg)]


def test_games_are_kept_in_plan_order_whatever_order_they_finished_in(tiny_model, tmp_path):
    """Eight games at a time finish in any order; the file ends in plan order, and a resumed
    run (the kept games' lines first in another order, one game missing) ends byte for byte
    the same but for the game played again."""
    out = tmp_path / "a"
    res = subprocess.run(_generate_cmd(out, tiny_model, 16, 8), env=_env(), capture_output=True)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    games = out / "games.jsonl"
    plan = _plan_ids(out, tiny_model, 16)
    assert _ids(games) == plan
    lines = games.read_bytes().splitlines(keepends=True)
    resumed = tmp_path / "b"
    resumed.mkdir()
    (resumed / "generate.json").write_bytes((out / "generate.json").read_bytes())
    (resumed / "games.jsonl").write_bytes(b"".join(reversed(lines[:5] + lines[6:])))
    cmd = _generate_cmd(resumed, tiny_model, 16, 8)
    res = subprocess.run(cmd, env=_env(), capture_output=True)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    again = (resumed / "games.jsonl").read_bytes().splitlines(keepends=True)
    assert _ids(resumed / "games.jsonl") == plan
    assert again[:5] + again[6:] == lines[:5] + lines[6:]


def test_a_failed_write_stops_generate_at_once(tiny_model, tmp_path):
    """A file-size limit at a tenth of the games file (as a full disk would): the write fails,
    generate stops within a wave of games with one line naming the file and the free space, and
    the games written before are kept."""
    import resource

    full = tmp_path / "full"
    start = time.perf_counter()
    res = subprocess.run(_generate_cmd(full, tiny_model, 400, 8), env=_env(), capture_output=True)
    whole = time.perf_counter() - start
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    limit = (full / "games.jsonl").stat().st_size // 10

    def limited() -> None:  # in the child, before it runs generate
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "limited"
    start = time.perf_counter()
    res = subprocess.run(
        _generate_cmd(out, tiny_model, 400, 8), env=_env(), capture_output=True, preexec_fn=limited
    )
    stopped = time.perf_counter() - start
    err = res.stderr.decode()
    assert res.returncode == 1, err[-3000:]
    assert "games.jsonl failed (File too large)" in err and "MiB are free there" in err, err
    assert "Traceback" not in err
    kept = [line for line in (out / "games.jsonl").read_bytes().splitlines() if line.strip()]
    assert 0 < len(kept) <= 400 // 10 + 8  # a tenth of the file, give or take a wave
    assert f"{len(kept)} finished games are kept" in err or f"{len(kept) - 1} finished" in err
    assert stopped < 0.6 * whole, (stopped, whole)
