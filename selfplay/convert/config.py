"""The options of the convert stage: ``ConvertOptions`` (what ``selfplay convert`` shares with
every round of ``selfplay iterate``) and ``ConvertConfig`` (those plus one run's files and I/O
settings), one frozen model that the cut and the driver both read. Each field's ``description``
is its command-line help."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from selfplay.reward import CREDITS, SHAPINGS, GroupBy, check_credit, check_shaping
from selfplay.train.config import MaxLength


class ConvertOptions(BaseModel):
    """How games become training rows: the options ``selfplay convert`` and every round of
    ``selfplay iterate`` share."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    group_by: GroupBy = Field(
        GroupBy.SCENARIO,
        description="GRPO groups: scenario (all games of a scenario, both seats) or scenario-seat.",
    )
    val_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Share of scenarios (by hash) written to val.parquet instead of "
        "train.parquet; training never reads them, so 0 (the default) trains on every game.",
    )
    max_length: MaxLength = 4096
    keep_degenerate: bool = Field(
        False,
        description="Write groups whose rewards are all equal too (advantage 0: they add no "
        "gradient; an iterate round with nothing else still skips its update).",
    )
    # a seat whose invalid actions ended the game (outcome "invalid") gets -invalid_penalty
    # instead of the shared 0; its partner keeps 0 (a per-seat format penalty, as in SPIRAL)
    invalid_penalty: float = Field(
        0.0,
        ge=0.0,
        description="Reward -P (instead of 0) for the seat whose invalid actions ended a game; "
        "its partner keeps 0.",
    )
    reward_shaping: str = Field(
        "none",
        description="The shaping applied to every row's reward after the penalty, by name "
        f"(selfplay/reward/shaping.py; built in: {', '.join(sorted(SHAPINGS))}).",
    )
    credit: str = Field(
        "episode",
        description="Where the advantage lands: "
        + "; ".join(f"{c.name}: {c.help}" for c in CREDITS.values())
        + " (selfplay/reward/credit.py).",
    )

    @field_validator("reward_shaping")
    @classmethod
    def _known_shaping(cls, name: str) -> str:
        return check_shaping(name)

    @field_validator("credit")
    @classmethod
    def _known_credit(cls, name: str) -> str:
        return check_credit(name)


class ConvertConfig(ConvertOptions):
    """Options of the convert stage (``selfplay convert``): the shared options plus the files."""

    games: Path = Field(description="games.jsonl to read")
    out: Path = Field(description="directory for train.parquet, val.parquet, convert_summary.json")
    validate_records: bool = Field(False, description="full pydantic validation (slower)")
    batch_rows: int = Field(256, ge=1, description="rows per parquet row group")
    compression: Literal["zstd", "lz4", "snappy", "none"] = "zstd"
    data_source: str = "selfplay/dialop-matching"
