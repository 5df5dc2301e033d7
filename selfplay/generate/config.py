"""Configuration of the generate stage (``selfplay generate``), validated with fixable messages.

The engine's own config (``selfplay.engines.EngineConfig``) is separate: the runner never sees it.
The partner options (``selfplay.players.partners``) are stored canonicalised; an API partner's
key is never a field, only the name of the environment variable that holds it. ``PlayOptions``
(how a game is played) and ``GenerateOptions`` (what a run plays) are the option groups that
iterate's config is composed of too; each field's ``description`` is its command-line help.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from selfplay.game import DEFAULT_GAME, GAMES, GameName, game_of
from selfplay.game.matching.rules import MAX_N, MIN_N
from selfplay.players import partners
from selfplay.records import SamplingParams

# Options that decide *which* games a folder holds; a resume must not change them.
IDENTITY_FIELDS = (
    "game",
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
ADDED_LATER = {"policy_seat": 1, "partner_base_url": None, "game": DEFAULT_GAME}


TableSize = Annotated[  # the matching game's sizes (sft's teacher games are matching games)
    int, Field(ge=MIN_N, le=MAX_N, description="Table size n (n reviewers x n papers).")
]


class PlayOptions(BaseModel):
    """How one game is played: its table and its limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    game: GameName = Field(
        DEFAULT_GAME, description=f"The game to play: {', '.join(sorted(GAMES))} (selfplay.game)."
    )
    table_size: int = Field(
        8,
        description=f"Table size n (n reviewers x n papers, {MIN_N} to {MAX_N}); another game: "
        "its own size.",
    )
    max_actions: int = Field(
        30,
        ge=1,
        description="Actions per game; a game that reaches it ends unagreed.",
        json_schema_extra={"envvar": "MAX_LENGTH"},
    )
    max_invalid: int = Field(
        3, ge=1, description="Consecutive invalid actions of one seat that end a game."
    )

    @field_validator("table_size")
    @classmethod
    def _size_of_the_game(cls, size: int, info: ValidationInfo) -> int:
        game = game_of(info)  # None: the game's own error is reported
        if game is not None and not game.min_size <= size <= game.max_size:
            raise ValueError(
                f"the {game.name} game's sizes are {game.min_size} to {game.max_size}, not {size}"
            )
        return size


class GenerateOptions(partners.PartnerOptions, PlayOptions):
    """The games one generate run (or one round of iterate) plays, and how they are sampled."""

    sampling: SamplingParams = SamplingParams()
    concurrency: int | None = Field(
        None, ge=1, description="Games in flight at most (default: all of them)."
    )
    seed: int = Field(
        0, ge=0, description="Run seed: scenarios, sampling and shuffling derive from it."
    )


class GenerateConfig(GenerateOptions):
    model_config = ConfigDict(frozen=True, extra="forbid")

    out: Path = Field(description="Output folder (games.jsonl).")
    num_games: int = Field(
        ge=1, description="Games in total.", json_schema_extra={"envvar": "NUM_GAMES"}
    )
    model: str = Field(description="What the seats are recorded as playing (a path or an HF id).")
    games_per_scenario: int = Field(
        4,
        ge=1,
        description="Games per scenario: convert's GRPO groups compare them (1 suits games "
        "for sft --games, not GRPO; iterate needs at least 2).",
    )
    round: int = Field(0, ge=0, description="Iteration round (part of every seed).")
    partner_concurrency: int = Field(8, ge=1, description="Partner requests in flight at most.")

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
