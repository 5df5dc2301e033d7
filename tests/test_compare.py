"""`selfplay compare`: held-out games of runs, published runs and files, paired by scenario."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from typer.testing import CliRunner

from selfplay.cli import app
from selfplay.evaluate.compare import CompareError, compare, games_path, markdown
from selfplay.game.matching.rules import generate_scenario
from selfplay.records import ActionRecord, GameRecord, SeatConfig, dump_record

SEAT = SeatConfig(kind="scripted", name="x")


def _game(seed: int, reward: float, *, n: int = 3, ask: bool = False) -> GameRecord:
    s = generate_scenario(seed, n, max_tables=10)
    text = "What is Ava Li's score for BLEU?" if ask else "Okay."
    action = ActionRecord(seat=0, text=f"[message] {text}", kind="message", valid=True)
    return GameRecord(
        game_id=f"g{seed}", scenario_id=s.id, seed=seed, scenario=s, seats=(SEAT, SEAT),
        actions=[action], outcome="accepted", score=0, reward=reward,
    )  # fmt: skip


def _write(path: Path, games: list[GameRecord]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = b"".join(dump_record(g) for g in games)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def _run(root: Path, name: str, rounds: dict[int, list[GameRecord]]) -> Path:
    """A run folder as iterate leaves it: manifest held-out entries whose paths are relative to
    the folder above the data root, each with its games file."""
    run = root / "data" / name
    held = {}
    for k, games in rounds.items():
        folder = Path("data") / name / "eval" / f"after_{k}_rounds"
        _write(root / folder / "games" / "model-model.jsonl", games)
        held[str(k)] = {"path": str(folder)}
    run.mkdir(parents=True, exist_ok=True)
    (run / "manifest.json").write_text(json.dumps({"heldout": held}))
    return run


def test_pairs_by_scenario_with_the_t_interval(tmp_path, monkeypatch):
    seeds = [3, 5, 8, 13, 21]
    base = [0.2, 0.5, 0.4, 0.9, 0.1]
    after = [0.6, 0.5, 0.9, 1.0, 0.4]
    run = _run(
        tmp_path,
        "r",
        {
            0: [_game(s, w) for s, w in zip(seeds, base, strict=True)],
            2: [_game(s, w, ask=s > 8) for s, w in zip(seeds, after, strict=True)],
        },
    )
    # a games file of another policy on three of the scenarios, two games on one of them
    other = _write(
        tmp_path / "other.jsonl.gz", [_game(3, 1.0), _game(3, 0.0), _game(8, 0.3), _game(21, 0.3)]
    )
    monkeypatch.chdir(tmp_path / "data")  # the run resolves by name under --data-root
    sets, pairs = compare([f"{run}@start", "r", str(other)], data_root=tmp_path / "data")

    d = np.subtract(after, base)
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    assert pairs[0].scenarios == 5
    assert pairs[0].mean == pytest.approx(d.mean())
    assert (pairs[0].low, pairs[0].high) == pytest.approx((d.mean() - half, d.mean() + half))
    # only the shared scenarios count; a scenario's games are averaged first
    d2 = np.array([0.5 - 0.2, 0.3 - 0.4, 0.3 - 0.1])
    assert pairs[1].scenarios == 3 and pairs[1].mean == pytest.approx(d2.mean())
    assert sets[1].asking_share == pytest.approx(2 / 5)
    assert sets[1].summary.direct_questions_per_game == pytest.approx(2 / 5)
    assert sets[0].summary.reward_mean == pytest.approx(np.mean(base))
    text = markdown(sets, pairs)
    assert f"| r - {run}@start | 5 | {d.mean():+.3f}" in text


def test_published_runs_and_which_model(tmp_path):
    pub = tmp_path / "docs" / "runs" / "p"
    _write(pub / "heldout" / "warm_start.jsonl.gz", [_game(1, 0.1)])
    _write(pub / "heldout" / "final.jsonl.gz", [_game(1, 0.7)])
    (pub / "manifest.json").write_text(json.dumps({"heldout": {"0": {"path": "gone"}}}))
    assert games_path(str(pub)).name == "final.jsonl.gz"
    assert games_path(f"{pub}@start").name == "warm_start.jsonl.gz"
    _, pairs = compare([f"{pub}@start", str(pub)])
    assert pairs[0].mean == pytest.approx(0.6)
    with pytest.raises(CompareError, match="not on disk"):
        games_path(f"{pub}@0")  # the manifest's own folders were not published
    with pytest.raises(CompareError, match="use @start, @final or a round count"):
        games_path(f"{pub}@7")
    with pytest.raises(CompareError, match="not a games file's"):
        games_path(f"{pub / 'heldout' / 'final.jsonl.gz'}@start")
    with pytest.raises(CompareError, match="neither a games file nor a run folder"):
        games_path(str(tmp_path / "nothing"))


def test_refuses_sets_that_cannot_be_paired(tmp_path):
    a = _write(tmp_path / "a.jsonl", [_game(1, 0.5), _game(2, 0.5)])
    b = _write(tmp_path / "b.jsonl", [_game(3, 0.5)])
    with pytest.raises(CompareError, match="share no scenario"):
        compare([str(a), str(b)])
    # the same seed at another table size: the same id, another scenario
    c = _write(tmp_path / "c.jsonl", [_game(1, 0.5, n=4)])
    with pytest.raises(CompareError, match="different scenarios"):
        compare([str(a), str(c)])
    with pytest.raises(CompareError, match="two or more"):
        compare([str(a)])


def test_cli_prints_both_tables_and_names_a_bad_argument(tmp_path):
    a = _write(tmp_path / "a.jsonl", [_game(1, 0.25), _game(2, 0.5)])
    b = _write(tmp_path / "b.jsonl", [_game(1, 0.75), _game(2, 0.5)])
    result = CliRunner().invoke(app, ["compare", str(a), str(b), "--markdown"])
    assert result.exit_code == 0, result.output
    assert "| 0.375 [" in result.output and "| +0.250 [" in result.output
    result = CliRunner().invoke(app, ["compare", str(a), str(tmp_path / "missing")])
    assert result.exit_code != 0
    assert "missing: neither a games file nor a run folder" in result.output
