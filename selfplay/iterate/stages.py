"""The stages of the run's table (``loop.table``): a round's generate, convert and train, the
held-out evaluation beside a generate, and ``Stages``, which runs any row of the table for the
run as it stands (the model a row plays with is read from the manifest); checkpoint pruning."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from selfplay.convert import ConvertConfig, ConvertOptions, NoSignalError, convert
from selfplay.engines import ServerEngineConfig
from selfplay.generate.config import GenerateConfig, GenerateOptions
from selfplay.iterate.child import Generate, StageChild, default_generate, hold_if_asked, isolated
from selfplay.iterate.config import IterateConfig
from selfplay.iterate.heldout import heldout_due, heldout_recorded, heldout_stage, warm_start_stage
from selfplay.iterate.resume import Row, Run
from selfplay.iterate.test_split import test_stage
from selfplay.iterate.track import round_metrics
from selfplay.manifest import (
    ConvertInfo,
    GenerateInfo,
    HeldoutInfo,
    Manifest,
    RoundRecord,
    StageRecord,
    TrainInfo,
)
from selfplay.train.config import TrainConfig, TrainerOptions

log = logging.getLogger(__name__)


def _reload_attached(engine_cfg: ServerEngineConfig, model: str) -> None:
    """Point an attached server (SGLang, vLLM) at the new weights instead of restarting it."""
    import asyncio

    from selfplay.engines import open_engine

    async def go() -> None:
        engine = open_engine(engine_cfg)
        try:
            await engine.start()
            await engine.load_weights(model)
        finally:
            await engine.aclose()

    asyncio.run(go())


def _generate_configs(cfg: IterateConfig, k: int, model: str):
    """Round ``k``'s generate config (its folder made) and the engine config of ``model``."""
    rdir = cfg.round_dir(k)
    rdir.mkdir(parents=True, exist_ok=True)
    gen_cfg = GenerateConfig(
        out=rdir,
        num_games=cfg.games_per_iter,
        model=model,
        games_per_scenario=cfg.games_per_scenario,
        round=k,
        **cfg.model_dump(include=set(GenerateOptions.model_fields)),
    )
    return gen_cfg, cfg.engine.model_copy(update={"model": model})


def beside_possible(cfg: IterateConfig, generate: Generate) -> bool:
    """Whether a held-out evaluation may play beside the next round's generate on one engine:
    asked for (``eval_beside_generate``), an in-process engine (hf), games not held to one at a
    time (``concurrency`` 1 decodes each request alone, so that sampling does not depend on which
    requests share a batch: the held-out games would join them), and the loop's own generate."""
    return (
        cfg.eval_beside_generate
        and cfg.engine.kind == "hf"
        and cfg.concurrency != 1
        and generate is default_generate
    )


def _beside(cfg: IterateConfig, model: str, out: Path, baselines: bool, gen_cfg, engine_cfg):
    """In the stage child: the held-out games of ``model`` and round ``gen_cfg.round``'s games
    played at once on one engine, so that their requests share batches (a greedy held-out game
    and a sampled training game differ only in their requests' temperature). Both finish or
    neither counts: a failure of one cancels the other (generate keeps its finished games)."""
    import asyncio

    from selfplay.engines import open_engine
    from selfplay.generate.runner import run_generate_async
    from selfplay.iterate.child import stage_progress
    from selfplay.iterate.heldout import heldout_eval_async

    progress = stage_progress(f"round {gen_cfg.round} generate")

    async def both():
        engine = open_engine(engine_cfg)
        try:
            await engine.start()
            evaluate = heldout_eval_async(cfg, model, out, baselines, engine)
            play = run_generate_async(gen_cfg, engine_cfg, progress, engine=engine)
            jobs = (asyncio.ensure_future(evaluate), asyncio.ensure_future(play))
            try:
                held, _ = await asyncio.gather(*jobs)
            except BaseException:  # the first failure as it is (a GamesWriteError stays one)
                for job in jobs:
                    job.cancel()
                await asyncio.gather(*jobs, return_exceptions=True)
                raise
            return held
        finally:
            await engine.aclose()

    return asyncio.run(both())


def generate_beside_heldout(
    cfg: IterateConfig, k: int, model: str, out: Path, baselines: bool, child: StageChild
) -> tuple[StageRecord, StageRecord]:
    """The held-out evaluation of ``model`` (into ``out``) and round ``k``'s generate with it,
    played together in ``child`` (closed after, as ``generate_stage`` does): the held-out stage's
    record (with the baselines when asked) and generate's, whose seconds both span the two."""
    started = time.time()
    gen_cfg, engine_cfg = _generate_configs(cfg, k, model)
    log.info(
        "held-out evaluation of %s on %d scenarios beside round %d's %d games",
        model,
        cfg.eval_scenarios,
        k,
        cfg.games_per_iter,
    )
    with child:
        (result, base), rss = child.run(_beside, cfg, model, out, baselines, gen_cfg, engine_cfg)
    heldout_recorded(cfg, k, model, result)
    held = HeldoutInfo(result=result, baselines=base, peak_rss_mb=rss)
    games = GenerateInfo(peak_rss_mb=rss, with_heldout=True)
    return (
        StageRecord.since(started, info=held),
        StageRecord.since(started, artifacts={"games": str(gen_cfg.games_path)}, info=games),
    )


def generate_stage(
    cfg: IterateConfig,
    k: int,
    model: str,
    done: dict[str, StageRecord],
    generate: Generate = default_generate,
    child: StageChild | None = None,
) -> StageRecord:
    """Round ``k``'s games with ``model`` (resumes game by game), in a child process: ``child``
    when given (the one the held-out evaluation of ``model`` ran in; closed here once the games
    are done, so that it holds no memory through train), else one of its own."""
    started = time.time()
    gen_cfg, engine_cfg = _generate_configs(cfg, k, model)
    # an attached server holds the weights it was started with (the run's initial model) or the
    # last ones loaded: any other model (a trained round, a warm start) is loaded into it first
    if (
        isinstance(engine_cfg, ServerEngineConfig)
        and engine_cfg.url
        and (k > 0 or model != cfg.model)
    ):
        _reload_attached(engine_cfg, model)
    log.info("round %d: generating %d games with %s", k, cfg.games_per_iter, model)
    info = GenerateInfo()
    with child or StageChild() as run_in:
        if generate is default_generate:
            _, rss = run_in.run(generate, gen_cfg, engine_cfg)
            info = GenerateInfo(peak_rss_mb=rss)
        else:  # a caller's own function (tests) runs here
            generate(gen_cfg, engine_cfg)
    return StageRecord.since(started, artifacts={"games": str(gen_cfg.games_path)}, info=info)


def convert_stage(
    cfg: IterateConfig, k: int, model: str, done: dict[str, StageRecord]
) -> StageRecord:
    """Round ``k``'s games -> its training rows; skipped (with the reason) when no group has a
    signal."""
    from selfplay.iterate.guided import guide_active, write_guided_games

    started = time.time()
    hold_if_asked(cfg.run_dir, "convert")
    rdir = cfg.round_dir(k)
    games, guided = rdir / "games.jsonl", ConvertInfo()
    if guide_active(cfg, k):
        games, guided = write_guided_games(cfg, k, model)
    conv_cfg = ConvertConfig(
        games=games,
        out=rdir,
        **cfg.model_dump(include=set(ConvertOptions.model_fields)),
    )
    try:
        summary = convert(conv_cfg)
    except NoSignalError as e:
        log.warning("round %d: %s; skipping the update, the model carries forward", k, e)
        return StageRecord.since(started, skip_reason=str(e), info=guided)
    flat = summary.groups_train_with_signal == 0
    return StageRecord.since(
        started,
        # --keep-degenerate with only equal-reward groups: rows written, nothing to learn
        skip_reason="every kept group has equal rewards (advantage 0)" if flat else None,
        artifacts={"train": summary.train_path, "val": summary.val_path},
        info=ConvertInfo(
            rows_train=summary.rows_train,
            rows_written=summary.rows_written,
            groups_written=summary.groups_written,
            groups_degenerate_dropped=summary.groups_degenerate_dropped,
            **guided.model_dump(),  # the guide's games, when the round has them
        ),
    )


def train_stage(
    cfg: IterateConfig, k: int, model: str, done: dict[str, StageRecord]
) -> StageRecord:
    """GRPO on round ``k``'s rows from ``model`` into ``checkpoint_dir(k)``, in a child (with
    ``--algorithm expert-iteration``: the SFT loss on the kept games' rows)."""
    started = time.time()
    hold_if_asked(cfg.run_dir, "train")
    if done["convert"].skip_reason:
        return StageRecord.since(started, skip_reason="no training signal", info=TrainInfo())
    out = cfg.checkpoint_dir(k)  # the loop cleared the way (Run.claim: its own leftovers only)
    options = cfg.train.model_dump(include=set(TrainerOptions.model_fields))
    options["save_verl_checkpoint"] = cfg.train.keep_checkpoints != "none"
    if options["mini_batch_size"] is None and options["batch_size"] is None:
        rows = done["convert"].info.rows_train
        micro = cfg.train.micro_batch_size
        # whole micro-batches per update (a mini-batch of 5 would force micro-batches of 1)
        per_update = rows // cfg.train.updates_per_round
        options["mini_batch_size"] = max(min(micro, rows), per_update // micro * micro)
    tcfg = TrainConfig(
        data=Path(done["convert"].artifacts["train"]),
        model=model,
        out=out,
        epochs=cfg.epochs_per_iter,
        seed=cfg.seed + k,
        max_length=cfg.max_length,
        **options,
    )
    log.info("round %d: training on %s (%s)", k, tcfg.data, cfg.algorithm)
    result, rss = isolated(_train_sft if cfg.algorithm == "expert-iteration" else _train, tcfg)
    from selfplay.train.model_card import annotate

    annotate(out, name=cfg.name, round=k)
    return StageRecord.since(
        started,
        artifacts={"model": str(result.model_dir), "metrics": str(result.metrics_path)},
        info=TrainInfo(**_train_info(result.steps), updates=result.updates, peak_rss_mb=rss),
    )


class Finished(NamedTuple):
    """A stage's record for the row it finished, and the folder it claimed (see ``Run.claim``)."""

    row: Row
    record: StageRecord
    made: Path | None = None


class Stages:
    """The stage of each row of the run's table, run for the run as it stands: the model a row
    plays with is read from the manifest (the warm start's, or the previous round's train), so
    any row can be the first of a resume. ``play`` returns the records; the loop records them.

    Heavy stages run in ``child`` where they share it: a held-out evaluation keeps it for the next
    round's generate with the same model, which closes it before the round trains."""

    def __init__(self, cfg: IterateConfig, run: Run, generate: Generate, child: StageChild):
        from selfplay.iterate.expert import select_stage

        self.cfg, self.run, self.generate, self.child = cfg, run, generate, child
        self.convert = select_stage if cfg.algorithm == "expert-iteration" else convert_stage

    def model(self, k: int | None) -> str:
        """The model after ``k`` rounds (None: the initial model, before the warm start)."""
        m = self.run.manifest
        if k is None or (k == 0 and self.cfg.warm_start is None):
            return self.cfg.model
        if k == 0:
            assert m.warm_start is not None, "the table runs the warm start before round 0"
            return m.warm_start.artifacts["model"]
        return next_model(m.rounds[k - 1])

    def enter(self, row: Row) -> None:
        """Before ``row``: a round's record, created or checked against the model it starts from
        (a resumed round must start from the model the round before it gave)."""
        if row.stage == "generate":
            self.run.start_round(row.at, self.model(row.at))

    def play(self, row: Row) -> list[Finished]:
        """Run ``row``'s stage; its record (two with the held-out evaluation beside generate, none
        when it has nothing to do)."""
        cfg, run, k = self.cfg, self.run, row.at
        if row.stage == "heldout":
            return self._heldout(row)
        if row.stage == "warm_start":
            made = cfg.warm_start_dir if cfg.warm_start.startswith("scripted:") else None
            if made is not None:
                run.claim(made, "warm start")
            return [Finished(row, warm_start_stage(cfg), made)]
        if row.stage == "test":
            rec = test_stage(cfg, run.manifest, self.model(0), self.model(cfg.iterations))
            return [] if rec is None else [Finished(row, rec)]
        done, model = run.manifest.rounds[k].stages, run.manifest.rounds[k].model
        if row.stage == "generate":
            return [Finished(row, generate_stage(cfg, k, model, done, self.generate, self.child))]
        if row.stage == "convert":
            return [Finished(row, self.convert(cfg, k, model, done))]
        if row.stage == "train":
            run.claim(made := cfg.checkpoint_dir(k), f"round {k} train")
            return [Finished(row, train_stage(cfg, k, model, done), made)]
        raise AssertionError(f"no stage for {row}")

    def _heldout(self, row: Row) -> list[Finished]:
        """The held-out stage at ``row``: beside its round's generate (one child, one engine)
        when the table placed it there and the games are still to play, else alone."""
        cfg, run, k = self.cfg, self.run, row.at
        model, baselines = self.model(k), not run.manifest.baselines
        out = heldout_due(cfg, k, model, run.manifest)
        beside = Row("generate", k)
        if row.beside and out is not None and not run.done(beside):
            run.start_round(k, model)  # checks a resumed round's model before the work
            held, games = generate_beside_heldout(cfg, k, model, out, baselines, self.child)
            return [Finished(row, held), Finished(beside, games)]
        # the loop's child is kept for the next round's generate with this model; the initial
        # model's (a warm start trains next) and the last one's play in a child of their own
        child = self.child if k is not None and k < cfg.iterations else None
        rec = heldout_stage(cfg, k, model, run.manifest, child)
        return [] if rec is None else [Finished(row, rec)]

    def leave(self, row: Row) -> None:
        """After ``row``, done now or before: generate's child closed (a resumed round may have
        skipped it); after train, the checkpoints pruned and the round's metrics recorded."""
        if row.stage == "generate":
            self.child.close()
        elif row.stage == "train":
            prune_checkpoints(self.cfg, self.run.manifest)
            rnd = self.run.manifest.rounds[row.at]
            if rnd.metrics is None:
                games = self.cfg.round_dir(row.at) / "games.jsonl"
                self.run.record_round_metrics(row.at, round_metrics(rnd, games))


def next_model(rnd: RoundRecord) -> str:
    """The model a finished round hands on: its trained checkpoint, or the one it started from."""
    return rnd.stages["train"].artifacts.get("model", rnd.model)


def prune_checkpoints(cfg: IterateConfig, manifest: Manifest) -> list[Path]:
    """Remove the verl checkpoints ``--keep-checkpoints`` does not keep (none: every one; last:
    all but the newest trained round's); return the folders removed. HF models stay."""
    from selfplay.train.trainer import CHECKPOINT_DIRNAME

    keep = cfg.train.keep_checkpoints
    if keep == "all":
        return []
    trained = sorted(
        k
        for k, r in manifest.rounds.items()
        if "train" in r.stages and not r.stages["train"].skip_reason
    )
    kept = set(trained[-1:]) if keep == "last" else set()
    removed = []
    for k in trained:
        path = cfg.checkpoint_dir(k) / CHECKPOINT_DIRNAME
        if k not in kept and path.exists():
            shutil.rmtree(path)
            removed.append(path)
            log.info("removed %s (--keep-checkpoints %s)", path, keep)
    return removed


def _train(tcfg: TrainConfig):
    from selfplay.train import train

    return train(tcfg)  # it logs a line per optimizer update


def _train_sft(tcfg: TrainConfig):
    from selfplay.train.sft import train_sft

    return train_sft(tcfg)


def _train_info(steps) -> dict[str, float]:
    if not steps:
        return {}

    def mean(attr):
        vals = [v for s in steps if (v := getattr(s, attr, None)) is not None]
        return float(np.mean(vals)) if vals else None

    return {
        "steps": len(steps),
        "loss": mean("loss"),  # expert iteration: the SFT loss
        "pg_loss": mean("pg_loss"),
        "kl": mean("kl"),
        "ppo_kl": mean("ppo_kl"),
        "clip_frac": mean("clip_frac"),
        "grad_norm": mean("grad_norm"),
        "entropy": mean("entropy"),
        "tokens_per_s": mean("tokens_per_s"),
    }
