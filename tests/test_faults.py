"""Faults a user meets, each a real subprocess on the tiny primed model, killed the way a user's
run would be. The README's fault table names these tests.

- The iterate process alone killed (SIGKILL, as by the OOM killer or a closed terminal) or
  stopped (SIGTERM, as by a scheduler) during generate: no stage process outlives it by more
  than 30 s, and the same command then runs to the end (nothing holds the run's lock).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

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
