"""The self-play loop: generate -> convert -> train per round, resumable from a run manifest.

Layout of a run named RUN:

    data/RUN/manifest.json            finished stages, artifacts, resolved config, versions, commit
    data/RUN/metrics.jsonl            one line per finished round (rewritten from the manifest)
    data/RUN/round_K/games.jsonl      generate (resumes game by game)
    data/RUN/round_K/train.parquet    convert (atomic; val.parquet and convert_summary.json beside)
    data/RUN/round_K/selected.jsonl   expert iteration: the games its convert kept (iterate/expert)
    data/RUN/round_K/guide.jsonl      --guide: the guide's games (iterate/guided)
    data/RUN/round_K/eval/            held-out evaluation of the model round K starts from
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
from selfplay.iterate.child import STAGE_LOG_ENV, Generate, StageChild, _default_generate
from selfplay.iterate.config import IterateConfig
from selfplay.iterate.heldout import (
    heldout_due,
    heldout_recorded,
    heldout_stage,
    warm_start_stage,
)
from selfplay.iterate.resume import Run
from selfplay.iterate.stages import (
    beside_possible,
    generate_beside_heldout,
    next_model,
    prune_checkpoints,
    stages,
)
from selfplay.iterate.test_split import test_stage
from selfplay.iterate.track import round_metrics, track_round
from selfplay.tracking import open_tracker

log = logging.getLogger(__name__)


def iterate(
    config: IterateConfig, *, force: bool = False, generate: Generate = _default_generate
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
    start = config.model
    if config.warm_start is not None:
        if (held := heldout_stage(config, None, config.model, run.manifest)) is not None:
            run.record_heldout(None, *held)
        if run.manifest.warm_start is None:
            made = config.warm_start_dir if config.warm_start.startswith("scripted:") else None
            if made is not None:
                run.claim(made, "warm start")
            run.record_warm_start(warm_start_stage(config), made)
        model = start = run.manifest.warm_start.artifacts["model"]
    else:
        model = config.model
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
        for k in range(config.iterations):
            due = heldout_due(config, k, model, run.manifest)
            generated = k in run.manifest.rounds and "generate" in run.manifest.rounds[k].stages
            if due is not None and not generated and beside_possible(config, generate):
                run.start_round(k, model)  # checks a resumed round's model before the work
                held, games = generate_beside_heldout(
                    config, k, model, due, not run.manifest.baselines, child
                )
                heldout_recorded(config, k, model, held[0])
                run.record_heldout(k, *held)
                run.record(k, "generate", games)
            elif (held := heldout_stage(config, k, model, run.manifest, child)) is not None:
                run.record_heldout(k, *held)
            if k > 0 and tracker is not None:  # the last round's result is recorded now
                track_round(run, tracker, k - 1)
            rnd = run.start_round(k, model)
            if "generate" in rnd.stages:  # resumed after its games: nothing to share the child
                child.close()
            for name, stage in stages(config, generate, child):
                if name not in rnd.stages:
                    made = config.checkpoint_dir(k) if name == "train" else None
                    if made is not None:
                        run.claim(made, f"round {k} train")
                    run.record(k, name, stage(config, k, model, rnd.stages), made)
            prune_checkpoints(config, run.manifest)
            if rnd.metrics is None:
                run.record_round_metrics(k, round_metrics(rnd, config.round_dir(k) / "games.jsonl"))
            model = next_model(rnd)
            if k + 1 < config.iterations and beside_possible(config, generate):
                continue  # the new model's evaluation plays beside the next round's games
            if (held := heldout_stage(config, k + 1, model, run.manifest, child)) is not None:
                run.record_heldout(k + 1, *held)
            if tracker is not None:
                track_round(run, tracker, k)
    if (test := test_stage(config, run.manifest, start, model)) is not None:
        run.record_test(test)
    log.info("run %s: %d round(s) done; latest model %s", config.name, config.iterations, model)
    return run
