"""Configuration of the generate stage (``selfplay generate``), validated with fixable messages.

The engine's own config (``selfplay.engines.EngineConfig``) is separate: the runner never sees it.
The partner options (``selfplay.partners``) are stored canonicalised; an API partner's key is
never a field, only the name of the environment variable that holds it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ConfigDict, Field

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


class GenerateConfig(partners.PartnerOptions):
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
    partner_concurrency: int = Field(8, ge=1)  # partner requests in flight at most

    @property
    def games_path(self) -> Path:
        return self.out / "games.jsonl"

    @property
    def snapshot_path(self) -> Path:
        return self.out / "generate.json"

    def identity(self) -> dict:
        ident = self.model_dump(mode="json", include=set(IDENTITY_FIELDS))
        for name, old in ADDED_LATER.items():
            if ident[name] == old:
                del ident[name]
        return ident
