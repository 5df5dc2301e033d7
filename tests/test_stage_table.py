"""The run's table of stages (``iterate.loop.table``) and the typed records of its manifest: where
the held-out stage is placed, that a manifest written before the records were typed still reads,
counts its stages as done and resumes without redoing them, and that every published run's
manifest reads through the typed models, the report and the scripts as it did."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from selfplay.iterate.config import IterateConfig
from selfplay.iterate.loop import iterate, table
from selfplay.iterate.resume import Row
from selfplay.iterate.stages import Finished, Stages
from selfplay.manifest import (
    STAGE_INFO,
    HeldoutInfo,
    RoundStats,
    StageRecord,
    TrainInfo,
    WarmStartInfo,
    read_manifest,
)
from selfplay.metrics import HeldOut, RoundMetrics

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
PUBLISHED = sorted((ROOT / "docs" / "runs").glob("**/manifest.json"))
# written before the stage table and its typed records: `make demo` at 0b2e6d4, and the
# published ask-advice run (expert iteration, a warm start, held-out games beside generate)
OLD = [DATA / "manifest_demo_0b2e6d4.json", DATA / "manifest_ask-advice_published.json"]


def _config(tmp_path: Path, **extra) -> IterateConfig:
    return IterateConfig(
        name="t", model="m", engine={"kind": "hf", "model": "m"}, iterations=2, games_per_iter=2,
        data_root=tmp_path, checkpoint_root=tmp_path, **extra,
    )  # fmt: skip


def test_the_table_places_one_heldout_stage_at_each_model_of_the_run(tmp_path):
    """Held-out evaluation is one stage placed in the table: the initial model before the warm
    start, the model each round starts from (beside its generate when asked), the last model;
    then the test split once. A run without held-out scenarios or a test split has none."""
    cfg = _config(tmp_path, warm_start="scripted:cooperative:4", eval_scenarios=4, test_scenarios=8)
    rows = [(r.stage, r.at, r.beside) for r in table(cfg, beside=True)]
    assert rows == [
        ("heldout", None, False),
        ("warm_start", None, False),
        ("heldout", 0, True),
        ("generate", 0, False),
        ("convert", 0, False),
        ("train", 0, False),
        ("heldout", 1, True),
        ("generate", 1, False),
        ("convert", 1, False),
        ("train", 1, False),
        ("heldout", 2, False),  # the last model: no round to play beside
        ("test", None, False),
    ]
    quiet = cfg.model_copy(update={"eval_initial": False, "test_scenarios": 0})
    assert [r for r in table(quiet) if r.stage in ("heldout", "test")] == [
        Row("heldout", 0),
        Row("heldout", 1),
        Row("heldout", 2),
    ]
    bare = _config(tmp_path, eval_scenarios=0)
    assert [(r.stage, r.at) for r in table(bare)] == [
        (s, k) for k in range(2) for s in ("generate", "convert", "train")
    ]


def test_stage_infos_are_chosen_by_the_stage_name_and_read_by_attribute():
    """A stage's info JSON reads as its stage's model (the same keys as another stage's would
    not): what the loop and the report read as attributes."""
    convert = StageRecord.of("convert", {"finished_at": 1, "seconds": 2, "info": {"rows_train": 7}})
    assert type(convert.info).__name__ == "ConvertInfo" and convert.info.rows_train == 7
    train = StageRecord.of("train", {"finished_at": 1, "seconds": 2, "info": {"steps": 3}})
    assert isinstance(train.info, TrainInfo) and train.info.steps == 3
    # written back with the keys it was given only (no nulls for the other stages' fields)
    assert json.loads(convert.model_dump_json())["info"] == {"rows_train": 7}
    assert set(STAGE_INFO) == {"warm_start", "heldout", "generate", "convert", "train", "test"}


def _moved(old: Path, tmp_path: Path) -> tuple[IterateConfig, Path]:
    """``old`` as the manifest of a run under ``tmp_path`` (its folders moved there), and the
    config that resumes it."""
    data = json.loads(old.read_text())
    data["config"] |= {"data_root": str(tmp_path / "data"), "checkpoint_root": str(tmp_path)}
    cfg = IterateConfig(**data["config"] | {"loggers": []})
    path = cfg.run_dir / "manifest.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    return cfg, path


def _no_games(*args):
    raise AssertionError("a finished run played games again")


@pytest.mark.parametrize("old", OLD, ids=lambda p: p.stem)
def test_a_manifest_from_before_the_typed_records_resumes_without_redoing_a_stage(
    old, tmp_path, monkeypatch
):
    """A finished run's old manifest: its stages read with their typed infos and count as done,
    so iterate plays no row; its records come back unchanged. With its last round's train and
    the last held-out result taken out, a re-run plays exactly those two rows."""
    cfg, path = _moved(old, tmp_path)
    before = json.loads(path.read_text())
    played: list[Row] = []
    monkeypatch.setattr(Stages, "play", lambda self, row: played.append(row) or [])
    iterate(cfg, generate=_no_games)
    assert played == []
    after = json.loads(path.read_text())
    for key in ("rounds", "warm_start"):
        assert after[key] == before[key], key
    manifest = read_manifest(path)
    assert manifest.heldout == read_manifest(old).heldout
    if manifest.warm_start is not None:
        assert isinstance(manifest.warm_start.info, WarmStartInfo)
    for rnd in manifest.rounds.values():
        assert isinstance(rnd.metrics, RoundStats)
        assert [type(r.info).__name__ for r in rnd.stages.values()] == [
            "GenerateInfo",
            "ConvertInfo",
            "TrainInfo",
        ]
        assert rnd.stages["convert"].info.rows_train > 0

    last = cfg.iterations - 1
    del before["rounds"][str(last)]["stages"]["train"]
    del before["heldout"][str(cfg.iterations)]
    path.write_text(json.dumps(before))
    held = HeldOut.model_validate(after["heldout"][str(cfg.iterations)])

    def replay(self, row):
        played.append(row)
        if row.stage == "train":
            rec = manifest.rounds[last].stages["train"]
            return [Finished(row, rec, cfg.checkpoint_dir(last))]
        return [Finished(row, StageRecord(finished_at=0, seconds=0, info=HeldoutInfo(result=held)))]

    monkeypatch.setattr(Stages, "play", replay)
    iterate(cfg, generate=_no_games)
    assert played == [Row("train", last), Row("heldout", cfg.iterations)]
    assert json.loads(path.read_text())["rounds"] == after["rounds"]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_every_published_manifest_reads_typed_and_as_the_report_and_scripts_read_it(path, tmp_path):
    """Each docs/runs manifest: every stage's info is its stage's model with no key left over
    (the models know every key a published run wrote), each round's metrics build its
    metrics.jsonl line, the report's warm-start line is the one the run published, and written
    back the JSON is what runs_index and publish_run (which read it raw) read before."""
    from selfplay.iterate import report
    from selfplay.iterate.resume import Run

    manifest = read_manifest(path)
    for k, rnd in manifest.rounds.items():
        for name, rec in rnd.stages.items():
            assert type(rec.info) is STAGE_INFO[name] and not rec.info.model_extra, (k, name)
        if rnd.metrics is not None:
            held = manifest.heldout.get(k)
            line = RoundMetrics(round=k, **rnd.metrics.model_dump(), heldout=held)
            assert line.games == rnd.metrics.games > 0
    if manifest.warm_start is not None:
        assert type(manifest.warm_start.info) is WarmStartInfo
        assert not manifest.warm_start.info.model_extra
    published = (path.parent / "REPORT.md").read_text().splitlines()
    for line in report._heldout_table(manifest):
        if line.startswith("Warm start:"):
            assert line in published

    original = json.loads(path.read_text())
    copy = tmp_path / "manifest.json"
    shutil.copy(path, copy)
    run = Run.__new__(Run)  # the manifest as the loop writes it back, without a config
    run.path, run.manifest = copy, read_manifest(copy)
    run.save()
    written = json.loads(copy.read_text())
    for key in ("rounds", "warm_start"):
        assert written[key] == original[key], key
    index, publish = _script("runs_index"), _script("publish_run")
    assert index.stage_seconds(written) == index.stage_seconds(original) > 0
    # Which game files the test split publishes (the files themselves stay in the run's data/,
    # not in docs/runs: the copy is replaced by naming it).
    publish._gzip = lambda games, out: (games.name, out)
    assert publish.publish_test(path.parent, tmp_path / "dest", written) == (
        publish.publish_test(path.parent, tmp_path / "dest", original)
    )


def test_the_gpu_iterate_check_reads_the_manifest_typed(monkeypatch):
    """scripts/check_gpu_iterate.py (run on a GPU only) reads its run's manifest through the
    typed records: on the published expert-iteration run (a warm start, held-out games beside
    generate) every round's checks pass, the held-out counts are checked, and the stage table
    holds each stage's seconds and note."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # its `from check_gpu_train import ...`
    check = _script("check_gpu_iterate")
    manifest = read_manifest(DATA / "manifest_ask-advice_published.json")
    report = check.Report(cuda=False)
    for k in range(2):
        check.check_round(report, manifest, k)
    check.check_heldout(report, manifest, 2, 96)
    check.check_heldout(report, manifest, 2, 8)  # another count: the check fails
    assert [ok for _, ok, _ in report.checks] == [True] * 5 + [False]
    assert report.checks[1][2] == "kept 26 of 128, 26 rows"
    rows = check.stage_rows(manifest, 2)
    assert [r[0] for r in rows] == [
        "warm start", "r0 generate", "r0 convert", "r0 train",
        "r1 generate", "r1 convert", "r1 train", "heldout 0", "heldout 1", "heldout 2",
    ]  # fmt: skip
    assert rows[0][4] == "48 rows" and rows[1][4] == "with the held-out evaluation"
    assert rows[-1][4] == "reward 0.707, 96 games"
