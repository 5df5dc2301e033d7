"""The self-play loop: generate -> convert -> train per round, resumable from a run manifest.

Layout of a run named RUN:

    data/RUN/manifest.json            finished stages, artifacts, resolved config, versions, commit
    data/RUN/metrics.jsonl            one line per finished round (rewritten from the manifest)
    data/RUN/round_K/games.jsonl      generate (resumes game by game)
    data/RUN/round_K/train.parquet    convert (atomic; val.parquet and convert_summary.json beside)
    checkpoints/RUN/round_K/          train: the HF model of round K+1 (and verl's checkpoint)

Each stage is recorded in the manifest only after it finished, and the manifest is replaced
atomically, so a kill at any point resumes at the first unfinished stage: generate keeps its
finished games, convert and train start over (their outputs are only ever renamed into place).
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field

from selfplay import partners
from selfplay.convert import ConvertConfig, GroupBy, NoSignalError, convert
from selfplay.engines import HFEngineConfig, SGLangEngineConfig
from selfplay.generate_config import GenerateConfig
from selfplay.metrics import summarize
from selfplay.records import SamplingParams, iter_game_records
from selfplay.train.config import TrainConfig

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1
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


class IterateError(ValueError):
    """The run cannot go on as asked (conflicting config, missing artifact); says what to do."""


class TrainOptions(BaseModel):
    """The train-stage options that stay the same every round (data, model and out vary)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float = Field(1e-6, gt=0.0)
    batch_size: int | None = Field(None, ge=1)
    mini_batch_size: int | None = Field(None, ge=1)
    micro_batch_size: int = Field(4, ge=1)
    loss_agg: str = "token-mean"
    std_norm: bool = True
    kl_coef: float = Field(0.0, ge=0.0)
    rollout_is: Literal["none", "tis"] = "none"
    gpus: int = Field(0, ge=0)
    ray_address: str | None = None


class IterateConfig(partners.PartnerOptions):  # partner_max_calls: per round
    """Everything one run needs; stored in the manifest and compared on every resume."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    iterations: int = Field(ge=1)
    model: str  # the initial model: a local HF directory or an HF id
    games_per_iter: int = Field(200, ge=2)
    epochs_per_iter: int = Field(1, ge=1)
    seed: int = Field(0, ge=0)
    data_root: Path = Path("data")
    checkpoint_root: Path = Path("checkpoints")
    # generate
    engine: HFEngineConfig | SGLangEngineConfig  # its model is replaced every round
    sampling: SamplingParams = SamplingParams()
    games_per_scenario: int = Field(4, ge=2)
    concurrency: int | None = Field(None, ge=1)
    table_size: int = Field(8, ge=3, le=8)
    max_actions: int = Field(30, ge=1)
    max_invalid: int = Field(3, ge=1)
    # convert
    group_by: GroupBy = GroupBy.SCENARIO
    val_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    max_length: int = Field(4096, ge=2)
    keep_degenerate: bool = False
    # train
    train: TrainOptions = TrainOptions()

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
RESUMABLE = ("iterations", "partner_max_calls", "partner_key_env")
# Options added after the first runs, with the value those runs had: a manifest written before
# them still resumes when they are left at it.
ADDED_LATER = {"policy_seat": 1, "partner_base_url": None}


def config_identity(dump: dict[str, Any]) -> dict[str, Any]:
    """The part of a config dump (new or from a manifest) that a resume must keep."""
    out = {k: v for k, v in dump.items() if k not in RESUMABLE}
    for name, old in ADDED_LATER.items():
        if out.get(name, old) == old:
            out.pop(name, None)
    return out


class StageRecord(BaseModel):
    finished_at: float
    seconds: float
    artifacts: dict[str, str] = {}
    skip_reason: str | None = None
    info: dict[str, Any] = {}


class RoundRecord(BaseModel):
    model: str  # the model this round generates with
    stages: dict[str, StageRecord] = {}
    metrics: dict[str, Any] | None = None


class Manifest(BaseModel):
    manifest_version: Literal[1] = MANIFEST_VERSION
    name: str
    config: dict[str, Any]
    created_at: float
    versions: dict[str, str]
    git_commit: str | None
    rounds: dict[int, RoundRecord] = {}


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("selfplay", "torch", "transformers", "verl", "numpy", "pyarrow", "sglang"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    return out


def git_commit() -> str | None:
    try:
        res = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() or None


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
            self.manifest = Manifest.model_validate(orjson.loads(self.path.read_bytes()))
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
        if diff and not force:
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

    def save(self) -> None:
        _atomic_write(self.path, orjson.dumps(self.manifest.model_dump(mode="json")))

    def finish(self, k: int, stage: str, started: float, **fields) -> StageRecord:
        rec = StageRecord(finished_at=time.time(), seconds=time.time() - started, **fields)
        self.manifest.rounds[k].stages[stage] = rec
        self.save()
        return rec

    def write_metrics(self) -> None:
        lines = [
            orjson.dumps({"round": k, **r.metrics})
            for k, r in sorted(self.manifest.rounds.items())
            if r.metrics is not None
        ]
        _atomic_write(self.config.run_dir / "metrics.jsonl", b"".join(x + b"\n" for x in lines))


Generate = Callable[[GenerateConfig, Any], Any]


def _default_generate(gen_cfg: GenerateConfig, engine_cfg) -> None:
    from selfplay.runner import run_generate

    run_generate(gen_cfg, engine_cfg)


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
            concurrency=cfg.concurrency,
            seed=cfg.seed,
            round=k,
            table_size=cfg.table_size,
            max_actions=cfg.max_actions,
            max_invalid=cfg.max_invalid,
            sampling=cfg.sampling,
            **cfg.model_dump(include=set(partners.PartnerOptions.model_fields)),
        )
        log.info("round %d: generating %d games with %s", k, cfg.games_per_iter, model)
        generate(gen_cfg, engine_cfg)
        run.finish(k, "generate", started, artifacts={"games": str(gen_cfg.games_path)})

    if "convert" not in rnd.stages:
        started = time.time()
        _hold(cfg.run_dir, "convert")
        conv_cfg = ConvertConfig(
            games=rdir / "games.jsonl",
            out=rdir,
            group_by=cfg.group_by,
            val_fraction=cfg.val_fraction,
            max_length=cfg.max_length,
            keep_degenerate=cfg.keep_degenerate,
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
            from selfplay.train import train

            tcfg = TrainConfig(
                data=Path(rnd.stages["convert"].artifacts["train"]),
                model=model,
                out=out,
                epochs=cfg.epochs_per_iter,
                seed=cfg.seed + k,
                max_length=cfg.max_length,
                **cfg.train.model_dump(),
            )
            log.info("round %d: training on %s", k, tcfg.data)
            result = train(tcfg)
            run.finish(
                k,
                "train",
                started,
                artifacts={"model": str(result.model_dir), "metrics": str(result.metrics_path)},
                info=_train_info(result.steps),
            )

    if rnd.metrics is None:
        rnd.metrics = round_metrics(rnd, rdir / "games.jsonl")
        run.save()
        run.write_metrics()
    return rnd.stages["train"].artifacts.get("model", model)


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


def round_metrics(rnd: RoundRecord, games: Path) -> dict[str, Any]:
    """The metrics.jsonl line of a finished round: game statistics, training, stage times."""
    summary = summarize(iter_game_records(games))
    train = rnd.stages["train"]
    return {
        **summary,
        "model": rnd.model,
        "train": train.info or None,
        "skip_reason": train.skip_reason,
        "seconds": {name: rec.seconds for name, rec in rnd.stages.items()},
    }


def iterate(
    config: IterateConfig, *, force: bool = False, generate: Generate = _default_generate
) -> Run:
    """Run (or resume, or extend) ``config.iterations`` rounds; return the run."""
    run = Run(config, force=force)
    model = config.model
    for k in range(config.iterations):
        model = run_round(run, k, model, generate)
    log.info("run %s: %d round(s) done; latest model %s", config.name, config.iterations, model)
    return run
