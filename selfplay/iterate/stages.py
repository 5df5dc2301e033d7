"""A round's stages: generate, convert, train; checkpoint pruning."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import numpy as np

from selfplay.convert import ConvertConfig, ConvertOptions, NoSignalError, convert
from selfplay.engines import SGLangEngineConfig
from selfplay.generate.config import GenerateConfig, GenerateOptions
from selfplay.iterate.child import Generate, _default_generate, _hold, isolated
from selfplay.iterate.config import IterateError
from selfplay.iterate.resume import Run
from selfplay.iterate.track import round_metrics
from selfplay.manifest import RoundRecord
from selfplay.train.config import TrainConfig, TrainerOptions

log = logging.getLogger(__name__)


STAGES = ("generate", "convert", "train")


def _reload_attached(engine_cfg: SGLangEngineConfig, model: str) -> None:
    """Point an attached SGLang server at the new weights instead of restarting it."""
    import asyncio

    from selfplay.engines import open_engine

    async def go() -> None:
        engine = open_engine(engine_cfg)
        try:
            await engine.start()
            await engine.update_weights_from_disk(model)
        finally:
            await engine.aclose()

    asyncio.run(go())


def run_round(run: Run, k: int, model: str, generate: Generate = _default_generate) -> str:
    """Advance round ``k`` through its unfinished stages; return the next round's model."""
    cfg = run.config
    rnd = run.manifest.rounds.setdefault(k, RoundRecord(model=model))
    if rnd.model != model:
        raise IterateError(
            f"round {k} was generated with {rnd.model}, but the previous round now gives {model}"
        )
    run.save()
    rdir = cfg.round_dir(k)
    rdir.mkdir(parents=True, exist_ok=True)

    if "generate" not in rnd.stages:
        started = time.time()
        engine_cfg = cfg.engine.model_copy(update={"model": model})
        if isinstance(engine_cfg, SGLangEngineConfig) and engine_cfg.url and k > 0:
            _reload_attached(engine_cfg, model)
        gen_cfg = GenerateConfig(
            out=rdir,
            num_games=cfg.games_per_iter,
            model=model,
            games_per_scenario=cfg.games_per_scenario,
            round=k,
            **cfg.model_dump(include=set(GenerateOptions.model_fields)),
        )
        log.info("round %d: generating %d games with %s", k, cfg.games_per_iter, model)
        info = {}
        if generate is _default_generate:
            _, info["peak_rss_mb"] = isolated(generate, gen_cfg, engine_cfg)
        else:  # a caller's own function (tests) runs here
            generate(gen_cfg, engine_cfg)
        run.finish(k, "generate", started, artifacts={"games": str(gen_cfg.games_path)}, info=info)

    if "convert" not in rnd.stages:
        started = time.time()
        _hold(cfg.run_dir, "convert")
        conv_cfg = ConvertConfig(
            games=rdir / "games.jsonl",
            out=rdir,
            **cfg.model_dump(include=set(ConvertOptions.model_fields)),
        )
        try:
            summary = convert(conv_cfg)
        except NoSignalError as e:
            log.warning("round %d: %s; skipping the update, the model carries forward", k, e)
            run.finish(k, "convert", started, skip_reason=str(e))
        else:
            flat = summary.groups_train_with_signal == 0
            run.finish(
                k,
                "convert",
                started,
                # --keep-degenerate with only equal-reward groups: rows written, nothing to learn
                skip_reason="every kept group has equal rewards (advantage 0)" if flat else None,
                artifacts={"train": summary.train_path, "val": summary.val_path},
                info={
                    "rows_train": summary.rows_train,
                    "rows_written": summary.rows_written,
                    "groups_written": summary.groups_written,
                    "groups_degenerate_dropped": summary.groups_degenerate_dropped,
                },
            )

    if "train" not in rnd.stages:
        started = time.time()
        _hold(cfg.run_dir, "train")
        skip = rnd.stages["convert"].skip_reason
        if skip:
            run.finish(k, "train", started, skip_reason="no training signal", info={})
        else:
            out = cfg.checkpoint_dir(k)
            if out.exists():  # a train killed mid-way: its output never counted
                log.warning("round %d: removing the unfinished checkpoint %s", k, out)
                shutil.rmtree(out)
            options = cfg.train.model_dump(include=set(TrainerOptions.model_fields))
            options["save_verl_checkpoint"] = cfg.train.keep_checkpoints != "none"
            if options["mini_batch_size"] is None and options["batch_size"] is None:
                rows = rnd.stages["convert"].info.get("rows_train", 0)
                micro = cfg.train.micro_batch_size
                # whole micro-batches per update (a mini-batch of 5 would force micro-batches of 1)
                per_update = rows // cfg.train.updates_per_round
                options["mini_batch_size"] = max(min(micro, rows), per_update // micro * micro)
            tcfg = TrainConfig(
                data=Path(rnd.stages["convert"].artifacts["train"]),
                model=model,
                out=out,
                epochs=cfg.epochs_per_iter,
                seed=cfg.seed + k,
                max_length=cfg.max_length,
                **options,
            )
            log.info("round %d: training on %s", k, tcfg.data)
            result, rss = isolated(_train, tcfg)
            from selfplay.train.model_card import annotate

            annotate(out, name=cfg.name, round=k)
            run.finish(
                k,
                "train",
                started,
                artifacts={"model": str(result.model_dir), "metrics": str(result.metrics_path)},
                info={
                    **_train_info(result.steps),
                    "updates": result.updates,
                    "peak_rss_mb": rss,
                },
            )

    prune_checkpoints(run)
    if rnd.metrics is None:
        rnd.metrics = round_metrics(rnd, rdir / "games.jsonl")
        run.save()
        run.write_metrics()
    return rnd.stages["train"].artifacts.get("model", model)


def prune_checkpoints(run: Run) -> list[Path]:
    """Remove the verl checkpoints ``--keep-checkpoints`` does not keep (none: every one; last:
    all but the newest trained round's); return the folders removed. HF models stay."""
    from selfplay.train.trainer import CHECKPOINT_DIRNAME

    keep = run.config.train.keep_checkpoints
    if keep == "all":
        return []
    trained = sorted(
        k
        for k, r in run.manifest.rounds.items()
        if "train" in r.stages and not r.stages["train"].skip_reason
    )
    kept = set(trained[-1:]) if keep == "last" else set()
    removed = []
    for k in trained:
        path = run.config.checkpoint_dir(k) / CHECKPOINT_DIRNAME
        if k not in kept and path.exists():
            shutil.rmtree(path)
            removed.append(path)
            log.info("removed %s (--keep-checkpoints %s)", path, keep)
    return removed


def _train(tcfg: TrainConfig):
    from selfplay.train import train

    return train(tcfg)  # it logs a line per optimizer update


def _train_info(steps) -> dict[str, float]:
    if not steps:
        return {}

    def mean(attr):
        vals = [getattr(s, attr) for s in steps if getattr(s, attr) is not None]
        return float(np.mean(vals)) if vals else None

    return {
        "steps": len(steps),
        "pg_loss": mean("pg_loss"),
        "kl": mean("kl"),
        "ppo_kl": mean("ppo_kl"),
        "clip_frac": mean("clip_frac"),
        "grad_norm": mean("grad_norm"),
        "entropy": mean("entropy"),
        "tokens_per_s": mean("tokens_per_s"),
    }
