"""A quiet console: `selfplay iterate` shows its own lines; what verl, torch and transformers
print from the stages goes to the run's log file (data/RUN/run.log), whose path it says once;
`-v` shows everything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

NOISE = ("FSDP", "Monkey patch", "NUMA", "is_fx_tracing", "Loading weights", "model shards")


def test_library_output_goes_to_the_run_log_and_the_console_keeps_ours(primed_model, tmp_path):
    cmd = [
        sys.executable, "-m", "selfplay", "iterate", "--name", "quiet",
        "--data-root", str(tmp_path / "data"), "--checkpoint-root", str(tmp_path / "ck"),
        "--model", str(primed_model), "--iterations", "1", "--games-per-iter", "8",
        "--games-per-scenario", "4", "--table-size", "3", "--max-new-tokens", "24",
        "--max-actions", "6", "--micro-batch-size", "4", "--eval-scenarios", "2",
        "--old-log-probs", "rollout", "--temperature", "1.0", "--no-report",
    ]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    console = res.stdout + res.stderr
    assert not [n for n in NOISE if n in console], console[-3000:]
    log = tmp_path / "data" / "quiet" / "run.log"
    assert console.count(str(log)) == 1
    kept = log.read_text()
    assert "FSDP" in kept  # verl's own lines are kept in the file
    assert "selfplay.train" in console and "held-out" in console  # our lines stay on the console
