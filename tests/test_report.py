"""`selfplay report`: plots and REPORT.md from a run's metrics (and games, when present)."""

from __future__ import annotations

import orjson
import pytest
from typer.testing import CliRunner

from selfplay.cli import app
from selfplay.evaluate.scripted import play_scripted
from selfplay.game.matching import MATCHING
from selfplay.iterate.report import ReportError, write_report
from selfplay.metrics import summarize
from selfplay.records import append_records


def test_report_from_a_run_directory(tmp_path):
    run = tmp_path / "run"
    lines = []
    for k in range(2):
        games = play_scripted(MATCHING, ("cooperative", "shy"), num_games=4, seed=k, n=3)
        (run / f"round_{k}").mkdir(parents=True)
        append_records(run / f"round_{k}" / "games.jsonl", games)
        train = {"pg_loss": 0.01, "kl": None, "clip_frac": 0.1, "tokens_per_s": 100.0}
        lines.append(orjson.dumps({"round": k, **summarize(games).model_dump(), "train": train}))
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    baselines = {"cooperative": 0.9, "no-talk": 0.8, "random": 0.6}
    out = write_report(run, n=3, baselines=baselines)
    text = out.read_text()
    assert text.count("\n| 0 |") == 1 and text.count("\n| 1 |") == 1
    # the humans played 8x8 tables: named with their size, not a line beside a 3x3 run
    assert "humans (8x8) reference 0.921 (134 games), on 8x8 tables: not drawn beside 3x3." in text
    for name in ("reward", "agreement", "actions", "invalid", "questions", "reward_vs_questions"):
        png = run / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png.name})" in text


def test_report_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(ReportError, match=r"metrics\.jsonl does not exist"):
        write_report(tmp_path)
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 1 and "selfplay iterate" in result.output


def test_metrics_lines_are_read_as_round_metrics(tmp_path):
    import math

    from selfplay.iterate.report import ReportError, read_metrics
    from selfplay.metrics import RoundMetrics

    (tmp_path / "metrics.jsonl").write_bytes(
        orjson.dumps({"round": 1, "games": 2, "reward_mean": None}) + b"\n"
        + orjson.dumps({"round": 0, "games": 3, "reward_mean": 0.5}) + b"\n"
    )  # fmt: skip
    rows = read_metrics(tmp_path)
    assert all(isinstance(r, RoundMetrics) for r in rows)
    assert [r.round for r in rows] == [0, 1] and math.isnan(rows[1].reward_mean)
    # a misspelt statistic is not silently dropped
    (tmp_path / "metrics.jsonl").write_bytes(orjson.dumps({"round": 0, "reward_meen": 1}) + b"\n")
    with pytest.raises(ReportError, match=r"metrics\.jsonl"):
        read_metrics(tmp_path)


def test_report_pairs_the_final_model_with_the_start_and_the_baselines(tmp_path, monkeypatch):
    """REPORT.md's paired table: the final model minus the start and minus each baseline over the
    scenarios both played (as `selfplay compare` pairs them); a baseline drawn at another table
    size (same ids, other scenarios) and one whose games are gone are left out."""
    from selfplay.iterate.report import paired_differences
    from selfplay.manifest import Manifest
    from selfplay.metrics import HeldOut, mean_ci
    from tests.test_compare import _game, _write

    monkeypatch.chdir(tmp_path)  # held-out paths are relative to where iterate ran
    sets = {
        "after_0": [_game(s, 0.1 * (s % 4)) for s in range(6)],
        "after_2": [_game(s, 0.5 + 0.1 * (s % 3)) for s in range(6)],
        "coop": [_game(s, 0.4 + 0.05 * s) for s in range(2, 8)],  # 4 scenarios in common
        "other-size": [_game(s, 0.9, n=4) for s in range(6)],
    }
    for folder, games in sets.items():
        name = "model-model" if folder.startswith("after") else f"baseline-{folder}"
        _write(tmp_path / "eval" / folder / "games" / f"{name}.jsonl", games)
    fields = dict.fromkeys(HeldOut.model_fields, None) | {"model": "m", "games": 6}
    fields.pop("outcomes"), fields.pop("seconds")

    def held(folder):
        return HeldOut(**{**fields, "path": f"eval/{folder}"})

    manifest = Manifest(
        name="r", config={}, created_at=0.0, versions={}, git_commit=None,
        heldout={0: held("after_0"), 2: held("after_2")},
        baselines={"coop": held("coop"), "other-size": held("other-size"), "gone": held("gone")},
    )  # fmt: skip
    final = {g.scenario_id: g.reward for g in sets["after_2"]}
    rows = paired_differences(tmp_path, manifest)
    assert [r[:2] for r in rows] == [
        ("after 2 rounds - start (after 0 rounds)", 6),
        ("after 2 rounds - scripted coop", 4),
    ]
    for (_, _, *got), games in zip(rows, (sets["after_0"], sets["coop"])):
        want = mean_ci([final[g.scenario_id] - g.reward for g in games if g.scenario_id in final])
        assert got == pytest.approx(list(want))
