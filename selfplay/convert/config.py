"""The options of the convert stage, one frozen model that the cut and the driver both read."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from selfplay.convert.grouping import GroupBy


class ConvertConfig(BaseModel):
    """Options of the convert stage (``selfplay convert``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    games: Path = Field(description="games.jsonl to read")
    out: Path = Field(description="directory for train.parquet, val.parquet, convert_summary.json")
    group_by: GroupBy = GroupBy.SCENARIO
    val_fraction: float = Field(0.0, ge=0.0, lt=1.0)  # training never reads val rows
    max_length: int = Field(4096, ge=2, description="rows with more prompt+response tokens drop")
    keep_degenerate: bool = False
    # a seat whose invalid actions ended the game (outcome "invalid") gets -invalid_penalty
    # instead of the shared 0; its partner keeps 0 (a per-seat format penalty, as in SPIRAL)
    invalid_penalty: float = Field(0.0, ge=0.0)
    validate_records: bool = Field(False, description="full pydantic validation (slower)")
    batch_rows: int = Field(256, ge=1, description="rows per parquet row group")
    compression: Literal["zstd", "lz4", "snappy", "none"] = "zstd"
    data_source: str = "selfplay/dialop-matching"
