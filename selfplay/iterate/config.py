"""The run's options (``IterateConfig``) and which of them a resume must keep
(``config_identity``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from selfplay.convert import ConvertOptions
from selfplay.engines import EngineConfig
from selfplay.errors import UserError
from selfplay.fileio import check_name
from selfplay.game import DEFAULT_GAME, game_of
from selfplay.game.api import DialogueGame
from selfplay.generate.config import GenerateOptions
from selfplay.seeds import EVAL_SEED
from selfplay.train.config import TrainerOptions


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
    algorithm: Literal["grpo", "expert-iteration"] = Field(
        "grpo",
        description="What a round trains on its games: grpo (every game, by its reward relative "
        "to its group) or expert-iteration (the best games of each scenario, see --ei-top-k and "
        "--ei-min-reward, cloned with the SFT loss at --lr).",
    )
    ei_top_k: int = Field(
        1, ge=1, description="expert-iteration: games kept per scenario at most (the best ones)."
    )
    ei_min_reward: float = Field(
        0.5, description="expert-iteration: a kept game's reward is at least this."
    )
    ei_above_mean: bool = Field(
        False,
        description="expert-iteration: a kept game also scores strictly above the mean of its "
        "scenario's games (a scenario whose games all scored alike gives none).",
    )
    ei_replay: int = Field(
        1,
        ge=0,
        description="expert-iteration: train on the kept games of this many latest rounds, this "
        "one included (1: this round's only; 0: every round so far; ReST's growing dataset).",
    )
    ei_invalid_turns: Literal["skip", "train"] = Field(
        "skip",
        description="expert-iteration: the kept games' turns the rules refused (a kept game "
        "can hold invalid moves before its agreement): skip (loss mask 0, not cloned) or train.",
    )
    guide: str | None = Field(
        None,
        description="GRPO: add games of a scripted guide (scripted:NAME, e.g. "
        "scripted:inquisitive) on each scenario to its group, trained off-policy with LUFFY's "
        "shaped loss (--guide-gamma).",
    )
    guide_games: int = Field(2, ge=1, description="--guide: guide games per scenario.")
    guide_when: Literal["always", "failed"] = Field(
        "always",
        description="--guide: on every scenario, or only where every own game scored 0.",
    )
    guide_rounds: int | None = Field(
        None, ge=1, description="--guide: only in the first N rounds (default: every round)."
    )
    warm_start: str | None = Field(
        None,
        description="Before round 0: scripted:NAME:GAMES (behaviour cloning of a scripted policy "
        "on GAMES games, e.g. scripted:cooperative:400; several joined by commas mix teachers: "
        "scripted:cooperative:24,scripted:inquisitive:4) or a model dir to start from.",
    )
    warm_start_partner: Literal["self", "run"] = Field(
        "self",
        description="Warm start: the teacher plays itself (both seats cloned) or the run's "
        "scripted --partner (run: only the model's seat is cloned, in the seat it will play).",
    )
    warm_start_lr: float = Field(1e-4, gt=0.0, description="Warm start: SFT learning rate.")
    warm_start_epochs: int = Field(1, ge=1, description="Warm start: passes over its rows.")
    warm_start_mini_batch_size: int = Field(
        4, ge=1, description="Warm start: rows per optimizer update."
    )
    eval_scenarios: int = Field(
        30, ge=0, description="Held-out scenarios each round's model plays greedily (0: none)."
    )
    eval_seed: int = Field(
        EVAL_SEED,
        ge=0,
        description="Picks the held-out scenarios (dev split; the test split's too).",
    )
    test_scenarios: int = Field(
        0,
        ge=0,
        description="Test-split scenarios (a seed space of their own) that the start and final "
        "models and the baselines play once after the last round: the run's headline (0: none).",
    )
    eval_initial: bool = Field(
        True,
        description="Also evaluate the initial model, before the warm start (off: one held-out "
        "pass fewer where its answer is known, such as an instruct model that never tags a reply).",
    )
    eval_beside_generate: bool = Field(
        True,
        description="Play a model's held-out evaluation and the next round's games at once on "
        "one hf engine, so that their requests share batches (off, or with --concurrency 1: one "
        "after the other, each stage's time its own).",
    )
    loggers: tuple[str, ...] = Field(
        (), description="Experiment trackers, as verl names them: console, tensorboard, wandb..."
    )

    @field_validator("name")
    @classmethod
    def _name_is_a_folder(cls, v: str) -> str:
        return check_name(v)

    @field_validator("loggers")
    @classmethod
    def _loggers_known(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        from selfplay.tracking import parse_loggers

        return parse_loggers(",".join(v))

    @field_validator("warm_start")
    @classmethod
    def _warm_start_form(cls, v: str | None, info: ValidationInfo) -> str | None:
        game = game_of(info)
        if v is not None and v.startswith("scripted:"):
            if game is not None:  # else: the game's own error is reported
                parse_warm_start(v, game)
        elif v is not None:  # a model: a mistyped directory fails here, before anything is kept
            from selfplay.models import ModelNotFound, check_weights, resolve_model

            try:
                local = Path(resolve_model(v)).expanduser()
                if local.is_dir():  # weights cut short fail here, before the manifest records them
                    check_weights(local)
            except ModelNotFound as e:
                raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _warm_start_partner(self) -> IterateConfig:
        from selfplay.players.partners import ScriptedPartner

        if self.warm_start_partner == "self":
            return self
        if not isinstance(self.partner, ScriptedPartner):
            raise ValueError(
                "warm_start_partner: run plays the teacher against the run's --partner, which "
                "must then be scripted:NAME; use self"
            )
        return self

    @model_validator(mode="after")
    def _guide(self) -> IterateConfig:
        if self.guide is None:
            return self
        from selfplay.players.partners import OpenAIPartner

        game = self.game
        kind, _, name = self.guide.partition(":")
        if kind != "scripted" or name not in game.scripted_names:
            raise ValueError(
                f"guide: {self.guide!r} must be scripted:NAME with NAME one of "
                f"{', '.join(game.scripted_names)}"
            )
        if self.algorithm != "grpo":
            raise ValueError(
                "guide: guided groups are GRPO's; drop --guide or use --algorithm grpo"
            )
        if isinstance(self.partner, OpenAIPartner):
            raise ValueError("guide: a guide plays with a scripted partner or itself, not an API")
        return self

    @model_validator(mode="after")
    def _rollout_log_probs(self) -> IterateConfig:
        """The generator's log-probs stand for the trainer's only at its policy temperature (see
        train.trainer): refused here, before a round is played, rather than at its train."""
        train = self.train
        uses = train.rollout_log_prob_uses
        t, policy = self.sampling.temperature, train.policy_temperature
        if uses and not train.scores_like(t):
            raise ValueError(
                f"{' and '.join(uses)}: the generator's log-probs at --temperature {t:g} are not "
                f"the trainer's (--policy-temperature {policy:g}); set them equal or leave the "
                "option out"
            )
        return self

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
RESUMABLE = (
    "iterations",
    "partner_max_calls",
    "partner_deadline",
    "partner_key_env",
    "loggers",
    "eval_initial",
    "eval_beside_generate",
)


# Options added after the first runs, with the value those runs had: a manifest written before
# them still resumes when they are left at it.
ADDED_LATER = {
    "policy_seat": 1,
    "partner_base_url": None,
    "invalid_penalty": 0.0,
    "reward_shaping": "none",
    "credit": "episode",
    "warm_start": None,
    "warm_start_lr": 1e-4,
    "warm_start_epochs": 1,
    "warm_start_mini_batch_size": 4,
    "eval_scenarios": 0,
    "eval_seed": 7,
    "game": DEFAULT_GAME,
    "algorithm": "grpo",
    "ei_top_k": 1,
    "ei_min_reward": 0.5,
    "ei_invalid_turns": "train",  # runs before it cloned every turn of a kept game
    "ei_replay": 1,
    "ei_above_mean": False,
    "warm_start_partner": "self",
    "guide": None,
    "guide_games": 2,
    "guide_when": "always",
    "guide_rounds": None,
    "test_scenarios": 0,
}


TRAIN_ADDED_LATER = {
    "nodes": 1,
    "updates_per_round": 4,
    "entropy_coef": 0.0,
    "dtype": "auto",  # older runs stored None, read as auto
    "guide_gamma": 0.1,
    "old_log_probs": "recompute",
    "policy_temperature": 1.0,
    "lora_rank": 0,
    "lora_alpha": 16,
}


# Train options a resume may change (what is kept on disk, not what is trained).
TRAIN_RESUMABLE = ("keep_checkpoints", "save_verl_checkpoint")  # the latter: its earlier name

# Engine options a resume may change: how fast it decodes, not what (a batch's rows, threads and
# reused KV change float rounding only, as the batches that concurrent games happen to form do).
ENGINE_RESUMABLE = (
    "max_batch_size",
    "cpu_threads",
    "prefix_cache_tokens",
    "deterministic",
    "deadline_s",
)


def config_identity(dump: dict[str, Any]) -> dict[str, Any]:
    """The part of a config dump (new or from a manifest) that a resume must keep."""
    out = {k: v for k, v in dump.items() if k not in RESUMABLE}
    if out.get("algorithm", "grpo") != "expert-iteration":
        out.pop("ei_invalid_turns", None)  # only expert iteration reads them
        out.pop("ei_replay", None)
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
    if isinstance(out.get("engine"), dict):
        out["engine"] = {k: v for k, v in out["engine"].items() if k not in ENGINE_RESUMABLE}
    return out


def parse_warm_start(spec: str, game: DialogueGame) -> tuple[tuple[str, int], ...]:
    """``scripted:NAME:GAMES[,scripted:NAME:GAMES...]`` -> ((NAME, GAMES), ...), NAME a scripted
    player of ``game``; ValueError naming the accepted forms."""
    from selfplay.generate.teacher import teacher_sources

    try:
        return teacher_sources(spec, None, game.scripted_names)
    except ValueError as e:
        raise ValueError(f"warm start: {e}; or a model directory") from None
