"""The self-play loop: the run's table of stages (``table``), run row by row, resumable from the
run's manifest. Every stage is a row that returns a typed record (``manifest.STAGE_INFO``):

    heldout (initial model)   only with a warm start (and ``eval_initial``)
    warm_start
    per round K:
      heldout (after K rounds)  the model round K starts from; beside its generate when it can
      generate, convert, train
    heldout (after the last round)
    test                      the test split, played once (``test_scenarios``)

A held-out row is left out when the run has no held-out scenarios, the test row when it plays no
test split.

Layout of a run named RUN:

    data/RUN/manifest.json            finished stages, artifacts, resolved config, versions, commit
    data/RUN/metrics.jsonl            one line per finished round (rewritten from the manifest)
    data/RUN/round_K/games.jsonl      generate (resumes game by game)
    data/RUN/round_K/train.parquet    convert (atomic; val.parquet and convert_summary.json beside)
    data/RUN/round_K/selected.jsonl   expert iteration: the games its convert kept (iterate/expert)
    data/RUN/round_K/guide.jsonl      --guide: the guide's games (iterate/guided)
    data/RUN/eval/after_K_rounds/     held-out evaluation of the model round K starts from
    checkpoints/RUN/warm_start/       the warm start (SFT) before round 0, when asked for
    checkpoints/RUN/round_K/          train: the HF model of round K+1 (and verl's checkpoint)

The heavy stages (warm start, evaluation, generate, train) run in child processes, so the loop's
own memory stays flat across rounds and no stage inherits another's torch settings (the hf engine
sets torch's thread count; the trainer must not run on what it left). The one exception: a
model's held-out evaluation and the next round's generate, which play with the same weights,
share one child (one start, one model load) and, on the hf engine, one engine: their games play
at once and their requests share batches (``eval_beside_generate``); the child ends before the
round trains.

Each stage is recorded in the manifest only after it finished, and the manifest is replaced
atomically, so a kill at any point resumes at the first unfinished stage: generate keeps its
finished games, convert and train start over (their outputs are only ever renamed into place).
"""

from __future__ import annotations

import logging
import os

from selfplay.fileio import folder_lock
from selfplay.iterate.child import STAGE_LOG_ENV, Generate, StageChild, default_generate
from selfplay.iterate.config import IterateConfig
from selfplay.iterate.resume import ROUND_STAGES, Row, Run
from selfplay.iterate.stages import Stages, beside_possible
from selfplay.iterate.track import track_finished
from selfplay.tracking import open_tracker

log = logging.getLogger(__name__)


def table(cfg: IterateConfig, beside: bool = False) -> list[Row]:
    """The run's stages in the order they run, each at its placement. ``beside``: a round's
    held-out evaluation plays beside its generate (``stages.beside_possible``)."""
    held = cfg.eval_scenarios > 0
    rows: list[Row] = []
    if cfg.warm_start is not None:
        if held and cfg.eval_initial:
            rows.append(Row("heldout", None))  # the initial model, before the warm start
        rows.append(Row("warm_start"))
    for k in range(cfg.iterations):
        if held:
            rows.append(Row("heldout", k, beside=beside))  # the model round k starts from
        rows += [Row(name, k) for name in ROUND_STAGES]
    if held:
        rows.append(Row("heldout", cfg.iterations))  # the last model
    if cfg.test_scenarios:
        rows.append(Row("test"))
    return rows


def iterate(
    config: IterateConfig, *, force: bool = False, generate: Generate = default_generate
) -> Run:
    """Run (or resume, or extend) ``config.iterations`` rounds; return the run.

    Holds the run folder's lock throughout: a second iterate of the same run is refused at once.
    """
    with folder_lock(config.run_dir, f"selfplay iterate --name {config.name}"):
        return _iterate_locked(config, force, generate)


def _iterate_locked(config: IterateConfig, force: bool, generate: Generate) -> Run:
    run = Run(config, force=force)  # the manifest: only this loop records into it
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:  # -v: everything on the console
        stage_log = config.run_dir / "run.log"
        os.environ[STAGE_LOG_ENV] = str(stage_log)
        log.info("the stages' library output (verl, torch, transformers) goes to %s", stage_log)
    # the held-out evaluation of a model and the next round's generate with it share a child
    # process (one start, one model load); generate closes it before the round trains
    child = StageChild()
    with (
        child,
        open_tracker(
            config.loggers,
            project="selfplay",
            name=config.name,
            run_dir=config.run_dir,
            config=config.model_dump(mode="json"),
        ) as tracker,
    ):
        stages = Stages(config, run, generate, child)
        for row in table(config, beside_possible(config, generate)):
            stages.enter(row)
            if not run.done(row):
                for finished in stages.play(row):
                    run.record(*finished)
            stages.leave(row)
            if tracker is not None:  # a round is sent once its model's held-out result is in
                track_finished(run, tracker)
        model = stages.model(config.iterations)
    log.info("run %s: %d round(s) done; latest model %s", config.name, config.iterations, model)
    return run
