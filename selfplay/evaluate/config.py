"""What an evaluation is asked (``EvalConfig``, ``ModelSpec``) and what it returns (``EvalRow``,
``CrossPlay``, ``EvalResult``, eval.json).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from selfplay.engines import (
    EngineConfig,
    HFEngineConfig,
    ServerEngineConfig,
)
from selfplay.errors import UserError
from selfplay.fileio import atomic_write
from selfplay.game import game_of
from selfplay.generate.config import PlayOptions
from selfplay.hardware import ComputeDtype
from selfplay.metrics import GameSummary
from selfplay.players.partners import PartnerOptions, SelfPlay
from selfplay.records import SamplingParams
from selfplay.seeds import EVAL_SEED
from selfplay.seeds import EVAL_SPACE as EVAL_SPACE  # re-exports: the held-out seed space
from selfplay.seeds import eval_game_seed as eval_game_seed  # lived here before selfplay.seeds

log = logging.getLogger(__name__)


EVAL_SCHEMA_VERSION = 1


# validation context of a stored eval.json: checks of files the evaluation read are skipped
STORED = "stored"


class EvalError(UserError, ValueError):
    """The evaluation cannot give a result as asked; says what to do.

    ``result`` holds what was evaluated before the failure (baselines, human row, errors), if any.
    """

    def __init__(self, message: str, result: EvalResult | None = None) -> None:
        super().__init__(message)
        self.result = result


Split = Literal["dev", "test"]  # seeds.SPLITS


class ModelSpec(BaseModel):
    """A model to evaluate: its label in the table and what to load (dir, HF id, ``embedded``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str = Field(min_length=1)
    model: str = Field(min_length=1)


def _scripted_name(name: str, names: Sequence[str]) -> str:
    if name not in names:
        raise ValueError(f"{name!r} is not a scripted policy; choose from {', '.join(names)}")
    return name


DEFAULT_MAX_BATCH = HFEngineConfig.model_fields["max_batch_size"].default


class EvalConfig(PartnerOptions, PlayOptions):
    """Everything one evaluation needs (``selfplay eval`` builds it from its options; each
    field's ``description`` is its option's help). The table and limits of a game are
    generate's ``PlayOptions``, so eval plays exactly the games generate plays."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    models: tuple[ModelSpec, ...] = Field(
        min_length=1,
        description="Models to evaluate: HF dirs or ids, or 'embedded'; each with its label in "
        "the table.",
    )
    num_scenarios: int = Field(
        100, ge=1, description="Held-out scenarios; every row plays the same ones."
    )
    games_per_scenario: int = Field(1, ge=1, description="Games per scenario (needs sampling).")
    seed: int = Field(
        EVAL_SEED, ge=0, description="Eval seed: picks the held-out scenarios (odd seeds)."
    )
    split: Split = Field(
        "dev",
        description="Held-out split: dev (per-round curves, what recipes are tuned on) or test "
        "(a separate seed space, played once at the end of a run; report it as the headline).",
    )
    sampling: SamplingParams = Field(
        SamplingParams(temperature=0.0),
        description="The models' sampling: temperature (0: greedy, deterministic), top-p and "
        "tokens per action at most.",
    )
    baselines: tuple[str, ...] | None = Field(
        None,
        validate_default=True,  # None becomes the game's baselines
        description="Scripted baseline rows (empty for none; default: cooperative, no-talk, "
        "random; another game: its scripted players).",
    )
    cross_play: bool = Field(
        False, description="Also play every ordered pair of models; matrix and gaps."
    )
    concurrency: int | None = Field(
        None, ge=1, description="Games in flight per row (default: all of them)."
    )
    engine: EngineConfig | None = Field(
        None,
        description="Engine template of every model (hf or sglang, by its kind); its model is "
        "replaced by each model's path. Default: hf on --device with --max-batch-size.",
    )
    device: str | None = Field(
        None, description="hf: cpu, cuda, cuda:1 (default: cuda if any). Without --engine only."
    )
    max_batch_size: int = Field(
        DEFAULT_MAX_BATCH,
        ge=1,
        description="hf: requests decoded together at most. Without --engine only.",
    )
    dtype: ComputeDtype = "auto"
    human_data: Path | None = Field(
        None,
        description="DialOp optimization.jsonl for the human row, shown beside 8x8 results only "
        "(default: $SELFPLAY_HUMAN_DATA, else the copy shipped with selfplay).",
    )
    out: Path | None = Field(
        None,
        description="Output folder: every game is kept in OUT/games/<row>.jsonl (and an API "
        "partner's cache and usage); default: games are not kept.",
    )

    @field_validator("baselines")
    @classmethod
    def _baselines_known(cls, v: tuple[str, ...] | None, info: ValidationInfo) -> tuple[str, ...]:
        game = game_of(info)
        if game is None:  # the game was refused, and said so
            return v
        if v is None:
            return game.baselines
        return tuple(_scripted_name(b, game.scripted_names) for b in v)

    @field_validator("models")
    @classmethod
    def _labels_unique(cls, v: tuple[ModelSpec, ...]) -> tuple[ModelSpec, ...]:
        labels = [m.label for m in v]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"each model must be named once; repeated: {', '.join(dup)}")
        return v

    @field_validator("human_data")
    @classmethod
    def _human_data_exists(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        # a stored eval.json names the file it was run with; reading it back needs no file
        if v is not None and not (info.context or {}).get(STORED) and not v.is_file():
            raise ValueError(
                f"{v} does not exist; point it at DialOp's optimization.jsonl or leave it "
                "unset to use the copy shipped with selfplay"
            )
        return v

    @model_validator(mode="after")
    def _consistent(self) -> EvalConfig:
        if self.games_per_scenario > 1 and self.sampling.temperature == 0:
            raise ValueError(
                "games_per_scenario: several games per scenario only differ when sampled; "
                "set a temperature above 0 or play 1 game per scenario"
            )
        if self.cross_play and not isinstance(self.partner, SelfPlay):
            raise ValueError(
                "cross_play: cross-play pairs the models with each other; drop the partner"
            )
        if self.cross_play and len(self.models) < 2:
            raise ValueError("cross_play: needs at least two models")
        if self.engine is not None and (
            self.device is not None
            or self.max_batch_size != DEFAULT_MAX_BATCH
            or self.dtype != "auto"
        ):
            raise ValueError(
                "device: device, dtype and max_batch_size configure the default hf engine; with an "
                "engine config, set them on it (engine.device, engine.max_batch_size)"
            )
        if self.cross_play and isinstance(self.engine, ServerEngineConfig) and self.engine.url:
            raise ValueError(
                "cross_play: an attached server holds one model at a time and cross-play "
                "needs every model at once; launch the servers (no engine url) or use hf"
            )
        return self

    def engine_for(self, model: str, index: int = 0) -> EngineConfig:
        """The engine config of ``model``, the ``index``-th of ``models``: the template with the
        model's path (a launched server on port + index)."""
        if self.engine is None:
            return HFEngineConfig(
                model=model,
                device=self.device,
                max_batch_size=self.max_batch_size,
                dtype=self.dtype,
            )
        update: dict = {"model": model}
        if isinstance(self.engine, ServerEngineConfig) and not self.engine.url:
            update["port"] = self.engine.port + index
        return self.engine.model_copy(update=update)


Kind = Literal["model", "baseline", "human", "cross"]


class EvalRow(BaseModel):
    """One line of the table: who played which seat and metrics.summarize of their games.

    Metric fields are None where they do not apply (a model that failed to load; the invalid
    rate of humans, whose interface allowed only valid moves). Unknown fields are refused.
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    kind: Kind
    # who sat where, numbered as the records number seats (0 moves first), as the metrics' seat0
    seat0: str
    seat1: str
    model: str | None = None  # the resolved model path of a model row
    error: str | None = None
    source: str | None = None  # where a human row's numbers come from
    games: int = 0
    reward_mean: float | None = None
    reward_ci_low: float | None = None
    reward_ci_high: float | None = None
    reward_std: float | None = None
    agreement_rate: float | None = None
    mean_actions: float | None = None
    mean_words: float | None = None
    invalid_action_rate: float | None = None
    optimal_rate: float | None = None
    same_proposal_share: float | None = None  # the most common first proposal's share of games
    stated_value_accuracy: float | None = None  # stated own values that match the speaker's view
    questions_per_game: float | None = None
    direct_questions_per_game: float | None = None  # naming a reviewer and a paper
    general_questions_per_game: float | None = None
    outcomes: dict[str, int] = {}
    seconds: float = 0.0

    @model_validator(mode="before")
    @classmethod
    def _seats_numbered_from_one(cls, data: Any) -> Any:
        """An eval.json written before the seats were numbered from 0 (``seat1``, ``seat2``)
        reads as today's (``seat0``, ``seat1``)."""
        if isinstance(data, dict) and "seat2" in data and "seat0" not in data:
            first, second = data.get("seat1"), data["seat2"]
            data = {k: v for k, v in data.items() if k != "seat2"} | {
                "seat0": first,
                "seat1": second,
            }
        return data


# metrics.summarize keys without a column in the table, on purpose: per-seat question counts and
# the question/reward correlation belong to a run's report (rounds), not to this table.
NOT_IN_ROW = frozenset(
    {"questions_per_game_seat0", "questions_per_game_seat1", "question_reward_corr"}
)


def summary_fields(summary: GameSummary) -> dict:
    """The EvalRow fields of a ``metrics.summarize`` result (NaN becomes None). Every key is a
    row field or in ``NOT_IN_ROW``; any other key raises, so a new metric is never dropped."""
    fields = summary.model_dump(exclude={*NOT_IN_ROW, "partner"})
    unknown = sorted(fields.keys() - EvalRow.model_fields.keys())
    if unknown:
        raise TypeError(
            f"metrics.summarize returned {', '.join(unknown)}, which EvalRow does not have: add "
            "a field to EvalRow or the key to evaluate.NOT_IN_ROW"
        )
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in fields.items()}


class CrossPlay(BaseModel):
    """Rewards of every ordered model pair: ``reward[i][j]`` has ``models[i]`` in seat 1 and
    ``models[j]`` in seat 2; the diagonal is self-play. ``gap`` = self-play minus the mean of the
    model's cross-play rewards in both seats."""

    models: list[str]
    reward: list[list[float | None]]  # None: that pair failed
    games: list[list[int]]
    self_play: dict[str, float | None]
    cross_play_mean: dict[str, float | None]
    gap: dict[str, float | None]


class EvalResult(BaseModel):
    """What ``run_eval`` found; ``save_result`` writes it as eval.json, ``load_result`` reads it."""

    schema_version: Literal[1] = EVAL_SCHEMA_VERSION
    config: EvalConfig
    scenario_seeds: list[int]
    rows: list[EvalRow]
    cross_play: CrossPlay | None = None
    errors: dict[str, str] = {}
    seconds: float = 0.0

    def row(self, name: str, kind: Kind | None = None) -> EvalRow:
        for r in self.rows:
            if r.name == name and (kind is None or r.kind == kind):
                return r
        raise KeyError(f"no row named {name!r} in this evaluation")


def load_result(path: str | Path) -> EvalResult:
    """Read an eval.json written by ``save_result``. The files the evaluation read (the human
    data) need not exist any more, and config fields this version no longer has are dropped with
    a warning, so an eval.json of an older selfplay still reads."""
    data = json.loads(Path(path).read_text())
    config = data.get("config")
    if isinstance(config, dict):
        gone = sorted(set(config) - set(EvalConfig.model_fields))
        if gone:
            log.warning("%s: ignoring config fields of an older selfplay: %s", path, gone)
            data["config"] = {k: v for k, v in config.items() if k not in gone}
    try:
        return EvalResult.model_validate(data, context={STORED: True})
    except ValidationError as e:
        raise EvalError(f"{path} is not an eval.json this selfplay can read: {e}") from None


def save_result(result: EvalResult, path: str | Path) -> Path:
    """Write eval.json (replaced atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, json.dumps(result.model_dump(mode="json"), indent=2) + "\n")
