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

import concurrent.futures
import logging
import multiprocessing
import os
import platform
import shutil
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import numpy as np
import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from selfplay.convert import ConvertConfig, ConvertOptions, NoSignalError, convert
from selfplay.engines import EngineConfig, SGLangEngineConfig
from selfplay.errors import UserError
from selfplay.game import DEFAULT_GAME, MATCHING, game_of, get_game
from selfplay.generate_config import GenerateConfig, GenerateOptions, PlayOptions
from selfplay.locks import folder_lock
from selfplay.manifest import Manifest, RoundRecord, StageRecord, read_manifest
from selfplay.metrics import HeldOut, RoundMetrics, summarize
from selfplay.model_card import git_commit
from selfplay.partners import PartnerOptions
from selfplay.records import SamplingParams, iter_game_records
from selfplay.train.config import TrainConfig, TrainerOptions

log = logging.getLogger(__name__)

STAGES = ("generate", "convert", "train")
# A testing aid for kill tests: with SELFPLAY_HOLD_BEFORE=convert (or train) the run touches
# data/RUN/holding_<stage> when that stage starts and waits there until it is killed.
HOLD_ENV = "SELFPLAY_HOLD_BEFORE"


def _hold(run_dir: Path, stage: str) -> None:
    if os.environ.get(HOLD_ENV) == stage:
        (run_dir / f"holding_{stage}").touch()
        log.warning("%s=%s: holding before %s until killed", HOLD_ENV, stage, stage)
        while True:
            time.sleep(1)


class IterateError(UserError, ValueError):
    """The run cannot go on as asked (conflicting config, missing artifact); says what to do."""


class TrainOptions(TrainerOptions):
    """The train-stage options that stay the same every round (data, model and out vary)."""

    updates_per_round: int = Field(
        4, ge=1, description="Optimizer updates per round when --mini-batch-size is not given."
    )
    # The HF model of every round is always kept; it is what the next round starts from, so a
    # resume works whatever is kept (a killed train starts over).
    keep_checkpoints: Literal["none", "last", "all"] = Field(
        "none",
        description="verl's checkpoint (weights + optimizer state, about 4x the model) of which "
        "rounds to keep: none, last or all. Each round's HF model is always kept; resume needs "
        "only it.",
    )

    @model_validator(mode="after")
    def _cluster(self) -> TrainOptions:
        if self.ray_address and self.gpus == 0:
            raise ValueError("ray_address: training on a Ray cluster needs --gpus (per node)")
        if self.nodes > 1 and not self.ray_address:
            raise ValueError("nodes: several nodes need --ray-address (an existing Ray cluster)")
        return self


class IterateConfig(GenerateOptions, ConvertOptions):
    """Everything one run needs; stored in the manifest and compared on every resume.

    Per round: ``GenerateOptions`` (sampling, play, partner; partner_max_calls is per round),
    ``ConvertOptions`` and ``train`` are passed on to that stage's config as they are."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Run name: data/NAME, checkpoints/NAME.",
        json_schema_extra={"envvar": "EXP_NAME"},
    )
    iterations: int = Field(
        ge=1, description="Rounds in total.", json_schema_extra={"envvar": "NUM_ITERATIONS"}
    )
    model: str = Field(description="The initial model: a local HF directory or an HF id.")
    games_per_iter: int = Field(
        200,
        ge=2,
        description="Games generated per round.",
        json_schema_extra={"envvar": "GAMES_PER_ITER"},
    )
    epochs_per_iter: int = Field(
        1,
        ge=1,
        description="Passes over a round's rows.",
        json_schema_extra={"envvar": "EPOCHS_PER_ITER"},
    )
    data_root: Path = Field(Path("data"), description="Where data/NAME goes.")
    checkpoint_root: Path = Field(Path("checkpoints"), description="Where checkpoints/NAME goes.")
    engine: EngineConfig = Field(
        description="The engine of every generate stage; its model is replaced every round."
    )
    games_per_scenario: int = Field(
        4, ge=2, description="Games per scenario: a GRPO group compares them (at least 2)."
    )
    train: TrainOptions = TrainOptions()
    warm_start: str | None = Field(
        None,
        description="Before round 0: scripted:NAME:GAMES (behaviour cloning of a scripted policy "
        "on GAMES games, e.g. scripted:cooperative:400) or a model dir to start from.",
    )
    warm_start_lr: float = Field(1e-4, gt=0.0, description="Warm start: SFT learning rate.")
    warm_start_epochs: int = Field(1, ge=1, description="Warm start: passes over its rows.")
    warm_start_mini_batch_size: int = Field(
        4, ge=1, description="Warm start: rows per optimizer update."
    )
    eval_scenarios: int = Field(
        30, ge=0, description="Held-out scenarios each round's model plays greedily (0: none)."
    )
    eval_seed: int = Field(7, ge=0, description="Picks the held-out scenarios.")
    loggers: tuple[str, ...] = Field(
        (), description="Experiment trackers, as verl names them: console, tensorboard, wandb..."
    )

    @field_validator("loggers")
    @classmethod
    def _loggers_known(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        from selfplay.tracking import parse_loggers

        return parse_loggers(",".join(v))

    @field_validator("warm_start")
    @classmethod
    def _warm_start_form(cls, v: str | None, info: ValidationInfo) -> str | None:
        game = game_of(info)
        if v is not None and game is not None and game is not MATCHING:
            raise ValueError(
                "the warm start clones the matching game's scripted players (selfplay sft); "
                f"--game {game.name} has no teacher games yet: drop --warm-start"
            )
        if v is not None and v.startswith("scripted:"):
            parse_warm_start(v)
        return v

    @property
    def warm_start_dir(self) -> Path:
        return self.checkpoint_root / self.name / "warm_start"

    @property
    def run_dir(self) -> Path:
        return self.data_root / self.name

    def round_dir(self, k: int) -> Path:
        return self.run_dir / f"round_{k}"

    def checkpoint_dir(self, k: int) -> Path:
        return self.checkpoint_root / self.name / f"round_{k}"

    def identity(self) -> dict:
        """What a resume must not change (raising --iterations extends a run)."""
        return config_identity(self.model_dump(mode="json"))


# Options a resume may change: more rounds, a higher partner call cap, another key variable.
RESUMABLE = ("iterations", "partner_max_calls", "partner_key_env", "loggers")
# Options added after the first runs, with the value those runs had: a manifest written before
# them still resumes when they are left at it.
ADDED_LATER = {
    "policy_seat": 1,
    "partner_base_url": None,
    "invalid_penalty": 0.0,
    "warm_start": None,
    "warm_start_lr": 1e-4,
    "warm_start_epochs": 1,
    "warm_start_mini_batch_size": 4,
    "eval_scenarios": 0,
    "eval_seed": 7,
    "game": DEFAULT_GAME,
}


TRAIN_ADDED_LATER = {
    "nodes": 1,
    "updates_per_round": 4,
    "entropy_coef": 0.0,
    "dtype": "auto",  # older runs stored None, read as auto
}
# Train options a resume may change (what is kept on disk, not what is trained).
TRAIN_RESUMABLE = ("keep_checkpoints", "save_verl_checkpoint")  # the latter: its earlier name


def config_identity(dump: dict[str, Any]) -> dict[str, Any]:
    """The part of a config dump (new or from a manifest) that a resume must keep."""
    out = {k: v for k, v in dump.items() if k not in RESUMABLE}
    for name, old in ADDED_LATER.items():
        if out.get(name, old) == old:
            out.pop(name, None)
    for name in ("data_root", "checkpoint_root"):  # the same folder however it was written
        if out.get(name) is not None:
            out[name] = str(Path(out[name]).resolve())
    train = {k: v for k, v in (out.get("train") or {}).items() if k not in TRAIN_RESUMABLE}
    if "dtype" in train and train["dtype"] is None:  # before auto had a name
        train["dtype"] = "auto"
    for name, old in TRAIN_ADDED_LATER.items():
        if train.get(name, old) == old:
            train.pop(name, None)
    out["train"] = train
    return out


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("selfplay", "torch", "transformers", "verl", "numpy", "pyarrow", "sglang"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    return out


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class Run:
    """A run on disk: its manifest, loaded or created, and the loop that advances it."""

    def __init__(self, config: IterateConfig, *, force: bool = False) -> None:
        self.config = config
        self.path = config.run_dir / "manifest.json"
        config.run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self.manifest = read_manifest(self.path)
            self._check_same(force)
        else:
            self.manifest = Manifest(
                name=config.name,
                config=config.model_dump(mode="json"),
                created_at=time.time(),
                versions=package_versions(),
                git_commit=git_commit(),
            )
            self.save()

    def _check_same(self, force: bool) -> None:
        old = config_identity(self.manifest.config)
        new = self.config.identity()
        diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        if diff and not self.started():
            log.info(
                "run %s had not produced anything yet: taking the new options", self.config.name
            )
            self.manifest.rounds = {}
        elif diff and not force:
            details = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff)
            raise IterateError(
                f"run {self.config.name!r} was started with another configuration ({details}). "
                "Use the same options to resume, another --name for a new run, or --force to "
                "continue with the new options."
            )
        if diff:
            log.warning("--force: continuing run %s with changed %s", self.config.name, diff)
        self.manifest.config = self.config.model_dump(mode="json")
        self.save()

    def started(self) -> bool:
        """Whether the run has produced anything: a finished stage or a played game (until then
        a corrected command may change the options)."""
        m = self.manifest
        if m.warm_start or m.heldout or m.heldout_initial:
            return True
        for k, r in m.rounds.items():
            games = self.config.round_dir(k) / "games.jsonl"
            if r.stages or (games.exists() and games.stat().st_size > 0):
                return True
        return False

    def save(self) -> None:
        _atomic_write(self.path, orjson.dumps(self.manifest.model_dump(mode="json")))

    def finish(self, k: int, stage: str, started: float, **fields) -> StageRecord:
        rec = StageRecord(finished_at=time.time(), seconds=time.time() - started, **fields)
        self.manifest.rounds[k].stages[stage] = rec
        self.save()
        return rec

    def write_metrics(self) -> None:
        """metrics.jsonl: per finished round its games' statistics, its training, and the
        held-out results of the model it started from (``heldout``) and of the one it produced
        (``heldout_after``, once evaluated)."""
        held = self.manifest.heldout
        lines = [
            orjson.dumps(
                RoundMetrics(
                    round=k, **r.metrics, heldout=held.get(k), heldout_after=held.get(k + 1)
                ).model_dump(mode="json")
            )
            for k, r in sorted(self.manifest.rounds.items())
            if r.metrics is not None
        ]
        _atomic_write(self.config.run_dir / "metrics.jsonl", b"".join(x + b"\n" for x in lines))


def _dump(model: BaseModel | None) -> dict | None:
    return None if model is None else model.model_dump(mode="json")


Generate = Callable[[GenerateConfig, Any], Any]


class _LogProgress:
    """A stage's progress as log lines, about every tenth of the way (a stage runs in a child
    whose stderr may be a log file; a terminal gets a progress bar instead)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.shown = -1

    def start(self, stats) -> None:
        self.shown = stats.done

    def update(self, stats) -> None:
        step = max(1, -(-stats.total // 10))  # ceil: at most ten lines, then the last
        if stats.done // step > self.shown // step or stats.done == stats.total:
            self.shown = stats.done
            log.info(
                "%s: %d/%d games, %.2f games/s, %.0f tokens/s, reward %.3f",
                self.label,
                stats.done,
                stats.total,
                stats.games_per_s,
                stats.tokens_per_s,
                stats.mean_reward,
            )

    def stop(self, stats) -> None:
        if self.shown != stats.done:
            self.update(stats)


def _stage_progress(label: str):
    import sys

    if sys.stderr.isatty():
        from rich.console import Console

        from selfplay.runner import RichProgress

        return RichProgress(Console(stderr=True))
    return _LogProgress(label)


def _default_generate(gen_cfg: GenerateConfig, engine_cfg) -> None:
    from selfplay.runner import run_generate

    run_generate(gen_cfg, engine_cfg, _stage_progress(f"round {gen_cfg.round} generate"))


def _child_logging(level: int) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level > logging.DEBUG:  # as the CLI does: verl's notes on engines it lacks are noise
        import warnings

        warnings.filterwarnings("ignore", message=r".* engine is not available")
        warnings.filterwarnings("ignore", category=DeprecationWarning)


def _measured(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    import resource

    result = fn(*args)
    return result, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB


def isolated(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` in a fresh (spawned) child process; its result or its exception comes back.

    A stage's memory (models, KV caches, allocator arenas) is returned to the system when the
    child exits, so a run's memory does not grow round by round, and process-wide settings a
    stage makes (torch's thread count, the process group) end with it. Returns the result and
    the child's peak resident memory in MiB.
    """
    level = logging.getLogger().getEffectiveLevel()
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_child_logging,
        initargs=(level,),
    ) as pool:
        return pool.submit(_measured, fn, *args).result()


def parse_warm_start(spec: str) -> tuple[str, int]:
    """``scripted:NAME:GAMES`` -> (NAME, GAMES); ValueError naming the accepted forms."""
    from selfplay.game.matching_scripted import SCRIPTED_NAMES

    parts = spec.split(":")
    if len(parts) != 3 or parts[1] not in SCRIPTED_NAMES or not parts[2].isdigit():
        raise ValueError(
            f"warm start {spec!r} must be scripted:NAME:GAMES (NAME one of "
            f"{', '.join(SCRIPTED_NAMES)}, e.g. scripted:cooperative:1000) or a model directory"
        )
    if int(parts[2]) < 1:
        raise ValueError(f"warm start {spec!r}: GAMES must be at least 1")
    return parts[1], int(parts[2])


def _heldout_baselines(name: str) -> tuple[str, ...]:
    """The held-out baseline rows: eval's default ones, and for the matching game inquisitive too
    (the asking reference, the upper bound beside a shy partner)."""
    from selfplay.evaluate import default_baselines

    game = get_game(name)
    names = default_baselines(game)
    return (*names, "inquisitive") if game is MATCHING else names


def _warm_start_sft(cfg: IterateConfig) -> dict[str, Any]:
    """The warm-start stage's work (in a child): behaviour cloning of the scripted teacher."""
    from selfplay.sft import SFTConfig, sft

    assert cfg.warm_start is not None
    name, games = parse_warm_start(cfg.warm_start)
    result = sft(
        SFTConfig(
            model=cfg.model,
            out=cfg.warm_start_dir,
            teacher=f"scripted:{name}",
            num_games=games,
            lr=cfg.warm_start_lr,
            epochs=cfg.warm_start_epochs,
            mini_batch_size=cfg.warm_start_mini_batch_size,
            **cfg.model_dump(include={"table_size", "max_actions", "seed", "max_length"}),
            **cfg.train.model_dump(include={"dtype", "micro_batch_size", "gpus", "ray_address"}),
        )
    )
    losses = [s.loss for s in result.steps]
    return {
        "rows": result.rows,
        "updates": result.steps[-1].step if result.steps else 0,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "tokens_per_s": float(np.mean([s.tokens_per_s for s in result.steps])),
    }


def warm_start(run: Run) -> str:
    """The model round 0 starts from: the warm-start stage's (run or resumed) or the initial."""
    cfg = run.config
    if cfg.warm_start is None:
        return cfg.model
    if not cfg.warm_start.startswith("scripted:"):
        if run.manifest.warm_start is None:
            run.manifest.warm_start = StageRecord(
                finished_at=time.time(), seconds=0.0, artifacts={"model": cfg.warm_start}
            )
            run.save()
        return cfg.warm_start
    if run.manifest.warm_start is None:
        started = time.time()
        out = cfg.warm_start_dir
        if out.exists():  # a warm start killed mid-way: its output never counted
            log.warning("removing the unfinished warm start %s", out)
            shutil.rmtree(out)
        _hold(cfg.run_dir, "warm_start")
        log.info("warm start: behaviour cloning %s into %s", cfg.warm_start, out)
        info, rss = isolated(_warm_start_sft, cfg)
        from selfplay.model_card import annotate

        annotate(out, name=f"{cfg.name} (warm start)")
        run.manifest.warm_start = StageRecord(
            finished_at=time.time(),
            seconds=time.time() - started,
            artifacts={"model": str(out)},
            info={**info, "peak_rss_mb": rss},
        )
        run.save()
    return run.manifest.warm_start.artifacts["model"]


def _heldout_eval(
    cfg: IterateConfig, model: str, out: Path, baselines: bool
) -> tuple[HeldOut, dict[str, HeldOut]]:
    """Greedy games of ``model`` on the run's held-out scenarios (in a child), and the scripted
    baselines on the same scenarios when asked."""
    from selfplay.evaluate import EvalConfig, ModelSpec, run_eval

    # the run's own engine: hf on its device and dtype, or SGLang (an attached server loads the
    # evaluated weights with update_weights_from_disk, as the next round would)
    where = {"engine": cfg.engine}
    result = run_eval(
        EvalConfig(
            models=(ModelSpec(label="model", model=model),),
            num_scenarios=cfg.eval_scenarios,
            seed=cfg.eval_seed,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=cfg.sampling.max_new_tokens),
            baselines=_heldout_baselines(cfg.game) if baselines else (),
            **where,
            out=out,
            **cfg.model_dump(
                include=set(PlayOptions.model_fields) | set(PartnerOptions.model_fields)
            ),
        )
    )
    fields = set(HeldOut.model_fields) - {"model"}

    fields -= {"path"}

    def held(row) -> HeldOut:
        return HeldOut(model=row.model or row.name, path=str(out), **row.model_dump(include=fields))

    row = result.row("model", "model")
    if row.error:
        raise IterateError(f"held-out evaluation of {model} failed: {row.error}")
    return held(row), {r.name: held(r) for r in result.rows if r.kind == "baseline"}


def heldout(run: Run, k: int, model: str) -> None:
    """Evaluate the model that has had ``k`` rounds (once; a model a skipped round carried
    forward keeps its result) and rewrite metrics.jsonl."""
    cfg = run.config
    held = run.manifest.heldout
    if cfg.eval_scenarios == 0 or k in held:
        return
    if k > 0 and (k - 1) in held and held[k - 1].model == model:
        held[k] = held[k - 1]
    else:
        log.info("held-out evaluation of %s on %d scenarios", model, cfg.eval_scenarios)
        out = cfg.run_dir / "eval" / f"after_{k}_rounds"
        (result, base), _ = isolated(_heldout_eval, cfg, model, out, not run.manifest.baselines)
        held[k] = result
        if base:
            run.manifest.baselines = base
        from selfplay.model_card import add_heldout

        add_heldout(
            model,
            {
                "scenarios": cfg.eval_scenarios,
                "table_size": cfg.table_size,
                "eval_seed": cfg.eval_seed,
                "partner": cfg.partner,
                **result.model_dump(
                    include={"reward_mean", "reward_ci_low", "reward_ci_high", "agreement_rate"}
                ),
            },
        )
        log.info(
            "held-out after %d round(s): reward %.3f [%.3f, %.3f], agreement %.2f",
            k,
            result.reward_mean or 0.0,
            result.reward_ci_low or 0.0,
            result.reward_ci_high or 0.0,
            result.agreement_rate or 0.0,
        )
    run.save()
    run.write_metrics()


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
            from selfplay.model_card import annotate

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


ROUND_KEYS = (
    "games",
    "reward_mean",
    "reward_ci_low",
    "reward_ci_high",
    "agreement_rate",
    "invalid_action_rate",
    "mean_actions",
    "questions_per_game",
    "direct_questions_per_game",
    "general_questions_per_game",
)
HELDOUT_KEYS = (
    "reward_mean",
    "reward_ci_low",
    "reward_ci_high",
    "agreement_rate",
    "invalid_action_rate",
    "questions_per_game",
    "direct_questions_per_game",
)


def track_round(run: Run, tracker: Any, k: int) -> None:
    """Send round ``k`` (its training steps, then its metrics) to the trackers, once."""
    from selfplay.tracking import flat

    rnd = run.manifest.rounds[k]
    if rnd.tracked or rnd.metrics is None:
        return
    metrics_path = rnd.stages["train"].artifacts.get("metrics")
    if metrics_path and Path(metrics_path).exists():
        for step in orjson.loads(Path(metrics_path).read_bytes())["steps"]:
            run.manifest.tracker_step += 1
            tracker.log(flat("train", {**step, "round": k}), step=run.manifest.tracker_step)
    m = rnd.metrics
    values = {key: m.get(key) for key in ROUND_KEYS}
    for key, j in (("heldout_before", k), ("heldout", k + 1)):  # the round's start and result
        if (h := run.manifest.heldout.get(j)) is not None:
            values[key] = h.model_dump(include=set(HELDOUT_KEYS))
    values["trained"] = 0.0 if m.get("skip_reason") else 1.0
    run.manifest.tracker_step += 1
    tracker.log(flat("round", {**values, "round": k}), step=run.manifest.tracker_step)
    rnd.tracked = True
    run.save()


def round_metrics(rnd: RoundRecord, games: Path) -> dict[str, Any]:
    """The metrics.jsonl line of a finished round: game statistics, training, stage times."""
    summary = summarize(iter_game_records(games))
    train = rnd.stages["train"]
    return {
        **summary.model_dump(exclude={"partner"}),
        "model": rnd.model,
        "train": train.info or None,
        "skip_reason": train.skip_reason,
        "seconds": {name: rec.seconds for name, rec in rnd.stages.items()},
        # resident memory (MiB): the loop's own now, and each stage's peak (its own process)
        "rss_mb": {
            "loop": _rss_mb(),
            **{n: r.info["peak_rss_mb"] for n, r in rnd.stages.items() if "peak_rss_mb" in r.info},
        },
    }


def _rss_mb() -> float | None:
    """This process's resident memory now, in MiB (Linux; None elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


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
