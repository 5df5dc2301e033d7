"""Configuration of the generate stage (``selfplay generate``), validated with fixable messages.

The engine's own config (``selfplay.engines.EngineConfig``) is separate: the runner never sees it.
The partner options (``selfplay.partners``) are stored canonicalised; an API partner's key is
never a field, only the name of the environment variable that holds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from selfplay import partners
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
    "policy_seat",
    "partner_base_url",
)
# Identity fields added after the first runs, with the value those runs had: left out of the
# identity at that value, so folders written before them still resume.
ADDED_LATER = {"policy_seat": 1, "partner_base_url": None}


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
    # None: self-play; a scripted name ("shy"); "openai:MODEL" (see selfplay.partners)
    partner: str | None = None
    policy_seat: Literal[1, 2] = 1  # the model's seat with a partner (2: the partner moves first)
    partner_base_url: str | None = None  # openai partners; None: api.openai.com
    partner_key_env: str = partners.DEFAULT_KEY_ENV  # the variable's NAME; the key is never stored
    partner_max_calls: int | None = Field(None, ge=1)  # paid partner calls in this run at most
    partner_concurrency: int = Field(8, ge=1)  # partner requests in flight at most

    @field_validator("partner")
    @classmethod
    def _known_partner(cls, v: str | None) -> str | None:
        return partners.canonical_partner(v)

    @field_validator("policy_seat")
    @classmethod
    def _policy_seat(cls, v: int, info: ValidationInfo) -> int:
        return partners.check_policy_seat(v, info.data["partner"]) if "partner" in info.data else v

    @field_validator("partner_base_url", "partner_max_calls")
    @classmethod
    def _api_only(cls, v, info: ValidationInfo):
        if "partner" not in info.data:
            return v
        option = "--" + str(info.field_name).replace("_", "-")
        return partners.check_api_only(v, info.data["partner"], option)

    @field_validator("partner_key_env")
    @classmethod
    def _key_env(cls, v: str) -> str:
        return partners.check_key_env(v)

    @property
    def games_path(self) -> Path:
        return self.out / "games.jsonl"

    @property
    def snapshot_path(self) -> Path:
        return self.out / "generate.json"

    @property
    def partner_cache_path(self) -> Path:
        return self.out / "partner_cache.jsonl"

    @property
    def partner_usage_path(self) -> Path:
        return self.out / "partner_usage.jsonl"

    def identity(self) -> dict:
        ident = self.model_dump(mode="json", include=set(IDENTITY_FIELDS))
        for name, old in ADDED_LATER.items():
            if ident[name] == old:
                del ident[name]
        return ident
