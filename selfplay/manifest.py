"""A run's manifest.json: the typed record of what an iterate run has finished.

``iterate`` writes it (after every stage, replaced atomically); the report and ``selfplay eval
--run`` read it through ``read_manifest``, so every reader sees the same model. The resolved
``IterateConfig`` is kept as the dict it was dumped to (a resume compares it key by key, and a run
started by an older selfplay must still read); readers that need a few settings of it take them
through ``RunSettings``, a typed view that ignores the rest.

Each stage's ``info`` is a typed model chosen by the stage's name (``STAGE_INFO``): the JSON on
disk is the flat object it always was, so a manifest written before the models existed reads (and
resumes) as it is. A round's ``metrics`` is a ``RoundStats``. The held-out and test-split stages
return a ``HeldoutInfo`` / ``TestInfo`` that ``Run.record`` keeps where readers look for them
(``heldout``, ``heldout_initial``, ``baselines``, ``test``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_serializer,
)

from selfplay.errors import UserError, first_problem
from selfplay.game import DEFAULT_GAME, GameField
from selfplay.game.api import TABLE_SIZE
from selfplay.metrics import NAN, GameSummary, HeldOut

MANIFEST_VERSION = 1
MANIFEST_FILE = "manifest.json"


class ManifestError(UserError, ValueError):
    """A manifest.json that cannot be read; says what to do."""


def _given(model: BaseModel, handler) -> dict[str, Any]:
    """``model`` dumped with the keys it was given (or read with) only."""
    given = model.model_fields_set | set(model.model_extra or {})
    return {k: v for k, v in handler(model).items() if k in given}


class StageInfo(BaseModel):
    """What a stage records beside its times and artifacts; each stage has its own subclass
    (``STAGE_INFO``). A key another selfplay version wrote and this one does not know is kept as
    it was (``extra="allow"``): an old run must still resume, and its manifest is rewritten."""

    model_config = ConfigDict(extra="allow")

    peak_rss_mb: float | None = None  # the stage's child process's peak resident memory (MiB)

    @model_serializer(mode="wrap")
    def _as_given(self, handler) -> dict[str, Any]:
        """The keys the stage gave (or the file held) only: a GRPO convert's JSON does not list
        expert iteration's counts as nulls, and an old manifest is written back as it was."""
        return _given(self, handler)


class WarmStartInfo(StageInfo):
    """The warm start: behaviour cloning of a scripted teacher (empty for a model given as is)."""

    rows: int | None = None
    rows_by_source: dict[str, int] = {}
    updates: int | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    tokens_per_s: float | None = None


class GenerateInfo(StageInfo):
    """A round's games."""

    with_heldout: bool = False  # played beside a held-out evaluation (its seconds span both)


class ConvertInfo(StageInfo):
    """A round's training rows. GRPO's convert fills the group counts; expert iteration's
    (``expert.select_stage``) the kept games; ``--guide`` adds the guide's games."""

    rows_train: int = 0
    rows_written: int | None = None
    groups_written: int | None = None
    groups_degenerate_dropped: int | None = None
    # expert iteration
    games: int | None = None
    games_kept: int | None = None
    games_replayed: int | None = None
    scenarios: int | None = None
    reward_mean_all: float | None = None
    reward_mean_kept: float | None = None
    rows_too_long: int | None = None
    invalid_turns_skipped: int | None = None
    # --guide
    guide_games: int | None = None
    guide_reward_mean: float | None = None
    guided_scenarios: int | None = None


class TrainInfo(StageInfo):
    """A round's update: means over its optimizer steps (None: not measured, or no steps)."""

    steps: int | None = None
    updates: int | None = None
    loss: float | None = None  # expert iteration: the SFT loss
    pg_loss: float | None = None
    kl: float | None = None
    ppo_kl: float | None = None
    clip_frac: float | None = None
    grad_norm: float | None = None
    entropy: float | None = None
    tokens_per_s: float | None = None


class HeldoutInfo(StageInfo):
    """A held-out evaluation of one model: its result, the baselines when they were played with
    it, and whether the result was carried from the previous round (a skipped round handed the
    model on unchanged, so nothing was played)."""

    result: HeldOut
    baselines: dict[str, HeldOut] = {}
    carried: bool = False


class TestInfo(StageInfo):
    """The test split (``iterate.test_split``): its rows by label (models) or name (baselines)."""

    __test__ = False  # not a pytest class

    rows: dict[str, HeldOut]


# a stage's name -> its info model (the held-out and test-split stages' records are kept in the
# manifest's own fields, see ``Run.record``)
STAGE_INFO: dict[str, type[StageInfo]] = {
    "warm_start": WarmStartInfo,
    "generate": GenerateInfo,
    "convert": ConvertInfo,
    "train": TrainInfo,
    "heldout": HeldoutInfo,
    "test": TestInfo,
}


class StageRecord(BaseModel):
    finished_at: float
    seconds: float
    artifacts: dict[str, str] = {}
    skip_reason: str | None = None
    info: SerializeAsAny[StageInfo] = StageInfo()

    @classmethod
    def since(cls, started: float, **fields: Any) -> StageRecord:
        """The record of a stage that started at ``started`` (time.time()) and finished now."""
        now = time.time()
        return cls(finished_at=now, seconds=now - started, **fields)

    @classmethod
    def of(cls, stage: str, data: Any) -> StageRecord:
        """``data`` (a record, or the JSON object of one) with its info read as ``stage``'s."""
        if isinstance(data, dict) and not isinstance(data.get("info"), StageInfo):
            info = STAGE_INFO.get(stage, StageInfo).model_validate(data.get("info") or {})
            data = {**data, "info": info}
        return cls.model_validate(data)


class RoundStats(GameSummary):
    """A finished round's line of metrics.jsonl before the held-out results are added
    (``RoundMetrics``): its games' statistics, its convert and train info, stage times and
    memory. A statistic JSON holds as null (NaN) reads back as NaN."""

    model: str | None = None
    train: TrainInfo | None = None
    convert: ConvertInfo | None = None
    skip_reason: str | None = None
    seconds: dict[str, float] = Field(default_factory=dict)  # per stage
    # the loop's own and each stage's peak
    rss_mb: dict[str, float | None] = Field(default_factory=dict)

    @field_validator(
        *[k for k, f in GameSummary.model_fields.items() if f.annotation is float], mode="before"
    )
    @classmethod
    def _null_is_nan(cls, v):
        return NAN if v is None else v

    @model_serializer(mode="wrap")
    def _as_given(self, handler) -> dict[str, Any]:
        """The keys the round gave (or the file held) only: an old round's metrics are written
        back as they were (a statistic added since stays absent, and reads as NaN)."""
        return _given(self, handler)


class RoundRecord(BaseModel):
    model: str  # the model this round generates with
    stages: dict[str, StageRecord] = {}  # by name: generate, convert, train
    metrics: RoundStats | None = None
    tracked: bool = False  # sent to the experiment trackers

    @field_validator("stages", mode="before")
    @classmethod
    def _typed_info(cls, stages: Any) -> Any:
        if not isinstance(stages, dict):
            return stages
        return {name: StageRecord.of(name, rec) for name, rec in stages.items()}


class RunSettings(BaseModel):
    """The settings of a run that its readers use (a view of the manifest's config; the other
    keys are ignored, and a key an older run lacks takes the value such runs had)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str | None = None
    game: GameField = Field(DEFAULT_GAME, validate_default=True)  # a name in, the game out
    table_size: int = TABLE_SIZE
    partner: str | None = None
    policy_seat: Literal[1, 2] = 1
    eval_scenarios: int = 0
    eval_seed: int = 7  # what runs before the option had (iterate.config.ADDED_LATER)
    warm_start: str | None = None


class Manifest(BaseModel):
    manifest_version: Literal[1] = MANIFEST_VERSION
    name: str
    config: dict[str, Any]
    created_at: float
    versions: dict[str, str]
    git_commit: str | None
    warm_start: StageRecord | None = None
    heldout_initial: HeldOut | None = None  # the initial model, before the warm start
    # held-out results by the number of GRPO rounds behind the model (0: the starting model)
    heldout: dict[int, HeldOut] = {}
    baselines: dict[str, HeldOut] = {}  # scripted pairs on the same held-out scenarios
    # the test split, played once after the last round (iterate.test_split): start, final and
    # baselines by row name; empty before it was played or in runs without one
    test: dict[str, HeldOut] = {}
    rounds: dict[int, RoundRecord] = {}
    tracker_step: int = 0  # the last step sent to the experiment trackers (steps only grow)
    # output folders a stage of this run began to write and has not finished (resolved paths):
    # the only folders a resume may remove; anything else in a stage's way is refused
    unfinished: list[str] = []

    @field_validator("warm_start", mode="before")
    @classmethod
    def _warm_start_info(cls, rec: Any) -> Any:
        return None if rec is None else StageRecord.of("warm_start", rec)

    @property
    def settings(self) -> RunSettings:
        return RunSettings.model_validate(self.config)


def read_manifest(path: Path) -> Manifest:
    """Read a manifest.json (a path to the file, or to the run folder that holds it)."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_FILE
    try:
        manifest = Manifest.model_validate(orjson.loads(path.read_bytes()))
    except orjson.JSONDecodeError as e:
        problem = f"not JSON: {e}"
    except ValidationError as e:
        problem = first_problem(e)
    else:
        return manifest
    raise ManifestError(
        f"{path} is not a readable run manifest ({problem}); "
        "restore it from a backup, or start another run with --name"
    ) from None
