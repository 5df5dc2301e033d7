"""The self-play loop: generate -> convert -> train per round, resumable from a run manifest.

Layout of a run named RUN:

    data/RUN/manifest.json            finished stages, artifacts, resolved config, versions, commit
    data/RUN/metrics.jsonl            one line per finished round (rewritten from the manifest)
    data/RUN/round_K/games.jsonl      generate (resumes game by game)
    data/RUN/round_K/train.parquet    convert (atomic; val.parquet and convert_summary.json beside)
    data/RUN/round_K/eval/            held-out evaluation of the model round K starts from
    checkpoints/RUN/warm_start/       the warm start (SFT) before round 0, when asked for
    checkpoints/RUN/round_K/          train: the HF model of round K+1 (and verl's checkpoint)

The heavy stages (warm start, evaluation, generate, train) run in a fresh child process each, so
the loop's own memory stays flat across rounds and no stage inherits another's torch settings
(the hf engine sets torch's thread count; the trainer must not run on what it left).

Each stage is recorded in the manifest only after it finished, and the manifest is replaced
atomically, so a kill at any point resumes at the first unfinished stage: generate keeps its
finished games, convert and train start over (their outputs are only ever renamed into place).
"""

from __future__ import annotations

import logging

from selfplay.fileio import folder_lock
from selfplay.iterate.child import Generate, _default_generate, isolated
from selfplay.iterate.config import IterateConfig
from selfplay.iterate.heldout import _heldout_eval, heldout, warm_start
from selfplay.iterate.resume import Run
from selfplay.iterate.stages import run_round
from selfplay.iterate.track import track_round

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
    run = Run(config, force=force)
    if config.warm_start is not None and config.eval_scenarios and not run.manifest.heldout_initial:
        out = config.run_dir / "eval" / "initial"
        (run.manifest.heldout_initial, base), _ = isolated(
            _heldout_eval, config, config.model, out, not run.manifest.baselines
        )
        run.manifest.baselines = run.manifest.baselines or base
        run.save()
    model = warm_start(run)
    from selfplay.tracking import open_tracker

    with open_tracker(
        config.loggers,
        project="selfplay",
        name=config.name,
        run_dir=config.run_dir,
        config=config.model_dump(mode="json"),
    ) as tracker:
        for k in range(config.iterations):
            heldout(run, k, model)
            model = run_round(run, k, model, generate)
            heldout(run, k + 1, model)
            if tracker is not None:
                track_round(run, tracker, k)
    log.info("run %s: %d round(s) done; latest model %s", config.name, config.iterations, model)
    return run
