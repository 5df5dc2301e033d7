"""Configuration of the generate stage (``selfplay generate``), validated with fixable messages.

The engine's own config (``selfplay.engines.EngineConfig``) is separate: the runner never sees it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from selfplay.game.matching import MAX_N, MIN_N
from selfplay.records import SamplingParams

# Options that decide *which* games a folder holds; a resume must not change them.
IDENTITY_FIELDS = (
    "seed",
    "round",
    "games_per_scenario",
    "table_size",
    "max_actions",
    "max_invalid",
    "model",
    "sampling",
    "partner",
)


class GenerateConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    out: Path
    num_games: int = Field(ge=1)
    model: str  # what the seats are recorded as playing (a path or an HF id)
    games_per_scenario: int = Field(4, ge=1)
    concurrency: int | None = Field(None, ge=1)  # None: every missing game at once
    seed: int = Field(0, ge=0)
    round: int = Field(0, ge=0)
    table_size: int = Field(8, ge=MIN_N, le=MAX_N)
    max_actions: int = Field(30, ge=1)
    max_invalid: int = Field(3, ge=1)
    sampling: SamplingParams = SamplingParams()
    partner: str | None = None  # a scripted policy for seat 2 (None: self-play)

    @field_validator("partner")
    @classmethod
    def _known_partner(cls, v: str | None) -> str | None:
        from selfplay.players.scripted import SCRIPTED_NAMES

        if v is not None and v not in SCRIPTED_NAMES:
            raise ValueError(f"partner must be one of {', '.join(SCRIPTED_NAMES)} (or omitted)")
        return v

    @property
    def games_path(self) -> Path:
        return self.out / "games.jsonl"

    @property
    def snapshot_path(self) -> Path:
        return self.out / "generate.json"

    def identity(self) -> dict:
        return self.model_dump(mode="json", include=set(IDENTITY_FIELDS))
