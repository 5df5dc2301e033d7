"""The test split, played once at the end of a run: the run's start and final models and the
game's held-out baselines on ``test_scenarios`` scenarios of the test seed space
(``seeds.heldout_scenario_seed("test", ...)``), which no round, recipe choice or per-round curve
ever saw. Greedy, on the run's engine, the same eval code as ``selfplay eval --split test``.

Rows (``Manifest.test``): ``warm_start`` (or ``initial`` without a warm start), ``final`` (the
model after the last round) and one per baseline (``proposer`` included); every game is kept in
``data/RUN/test/games/`` (``games_file``), paired by scenario across rows.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from selfplay.iterate.child import isolated
from selfplay.iterate.config import IterateConfig, IterateError
from selfplay.iterate.heldout import eval_config, held_out
from selfplay.manifest import Manifest, StageRecord, TestInfo
from selfplay.metrics import HeldOut

log = logging.getLogger(__name__)

FINAL = "final"
START_ROWS = ("warm_start", "initial")  # the start model's row: with a warm start, or without
MODEL_ROWS = (*START_ROWS, FINAL)  # every other row is a baseline's


def games_file(folder: str | Path, row: str) -> Path:
    """Where the test split's evaluation, written to ``folder`` (its rows' ``HeldOut.path``),
    keeps ``row``'s games: ``evaluate.run`` names a model's file model-LABEL.jsonl and a
    baseline's baseline-NAME.jsonl. The report, the multi-seed report and publish_run.py all
    find the files here."""
    kind = "model" if row in MODEL_ROWS else "baseline"
    return Path(folder) / "games" / f"{kind}-{row}.jsonl"


def start_label(cfg: IterateConfig) -> str:
    """The test row of the model the run started from."""
    return "warm_start" if cfg.warm_start is not None else "initial"


def test_models(cfg: IterateConfig, start: str, final: str) -> dict[str, str]:
    """Row label -> model of the test split's model rows (one row when no round changed it)."""
    return {start_label(cfg): start} if final == start else {start_label(cfg): start, FINAL: final}


def _test_eval(cfg: IterateConfig, models: dict[str, str], out: Path) -> dict[str, HeldOut]:
    """In a child: every row of the test split, by label (models) or name (baselines)."""
    import asyncio

    from selfplay.evaluate.run import run_eval_async

    config = eval_config(cfg, models, out, True, num_scenarios=cfg.test_scenarios, split="test")
    result = asyncio.run(run_eval_async(config))
    rows: dict[str, HeldOut] = {}
    for row in result.rows:
        if row.kind not in ("model", "baseline"):
            continue
        if row.error:
            raise IterateError(f"test-split evaluation of {row.name} failed: {row.error}")
        rows[row.name] = held_out(row, out)
    return rows


def test_stage(
    cfg: IterateConfig, manifest: Manifest, start: str, final: str
) -> StageRecord | None:
    """The test split's stage: its rows (``TestInfo``), or None when the run plays none
    (``test_scenarios`` 0) or played it already (a finished run keeps its first test result: the
    split is played once)."""
    if cfg.test_scenarios == 0 or manifest.test:
        return None
    started = time.time()
    out = cfg.run_dir / "test"
    models = test_models(cfg, start, final)
    log.info(
        "test split: %s and %d baselines on %d scenarios (played once)",
        ", ".join(models),
        len(cfg.game.heldout_baselines),
        cfg.test_scenarios,
    )
    rows, rss = isolated(_test_eval, cfg, models, out)
    return StageRecord.since(started, info=TestInfo(rows=rows, peak_rss_mb=rss))
