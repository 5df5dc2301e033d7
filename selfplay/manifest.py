"""A run's manifest.json: the typed record of what an iterate run has finished.

``iterate`` writes it (after every stage, replaced atomically); the report and ``selfplay eval
--run`` read it through ``read_manifest``, so every reader sees the same model. The resolved
``IterateConfig`` is kept as the dict it was dumped to (a resume compares it key by key, and a run
started by an older selfplay must still read); readers that need a few settings of it take them
through ``RunSettings``, a typed view that ignores the rest.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from selfplay.errors import UserError, first_problem
from selfplay.game import DEFAULT_GAME, GameField
from selfplay.metrics import HeldOut

MANIFEST_VERSION = 1
MANIFEST_FILE = "manifest.json"


class ManifestError(UserError, ValueError):
    """A manifest.json that cannot be read; says what to do."""


class StageRecord(BaseModel):
    finished_at: float
    seconds: float
    artifacts: dict[str, str] = {}
    skip_reason: str | None = None
    info: dict[str, Any] = {}

    @classmethod
    def since(cls, started: float, **fields: Any) -> StageRecord:
        """The record of a stage that started at ``started`` (time.time()) and finished now."""
        now = time.time()
        return cls(finished_at=now, seconds=now - started, **fields)


class RoundRecord(BaseModel):
    model: str  # the model this round generates with
    stages: dict[str, StageRecord] = {}
    metrics: dict[str, Any] | None = None
    tracked: bool = False  # sent to the experiment trackers


class RunSettings(BaseModel):
    """The settings of a run that its readers use (a view of the manifest's config; the other
    keys are ignored, and a key an older run lacks takes the value such runs had)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str | None = None
    game: GameField = Field(DEFAULT_GAME, validate_default=True)  # a name in, the game out
    table_size: int = 8
    partner: str | None = None
    policy_seat: Literal[1, 2] = 1
    eval_scenarios: int = 0
    eval_seed: int = 7
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
