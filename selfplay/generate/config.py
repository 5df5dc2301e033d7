"""Configuration of the generate stage (``selfplay generate``), validated with fixable messages.

The engine's own config (``selfplay.engines.EngineConfig``) is separate: the runner never sees it.
The partner options (``selfplay.players.partners``) are stored canonicalised; an API partner's
key is never a field, only the name of the environment variable that holds it. ``PlayOptions``
(how a game is played) and ``GenerateOptions`` (what a run plays) are the option groups that
iterate's config is composed of too; each field's ``description`` is its command-line help.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from selfplay.game import DEFAULT_GAME, GAMES, GameField, game_of
from selfplay.game.api import MAX_ACTIONS, MAX_INVALID, TABLE_SIZE
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


def size_of_the_game(size: int, info: ValidationInfo) -> int:
    """A ``table_size`` validator: the size must be one of the model's ``game`` (declared before
    it); no game (its own error is reported): the size passes."""
    game = game_of(info)
    if game is not None and not game.min_size <= size <= game.max_size:
        raise ValueError(
            f"the {game.name} game's sizes are {game.min_size} to {game.max_size}, not {size}"
        )
    return size


SIZE_HELP = "Table size n (matching: n reviewers x n papers, 3 to 8; another game: its own sizes)."


class PlayOptions(BaseModel):
    """How one game is played: its table and its limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    game: GameField = Field(
        DEFAULT_GAME,
        validate_default=True,
        description=f"The game to play: {', '.join(sorted(GAMES))} (selfplay.game).",
    )
    table_size: int = Field(TABLE_SIZE, description=SIZE_HELP)
    max_actions: int = Field(
        MAX_ACTIONS,
        ge=1,
        description="Actions per game; a game that reaches it ends unagreed.",
        json_schema_extra={"envvar": "MAX_LENGTH"},
    )
    max_invalid: int = Field(
        MAX_INVALID, ge=1, description="Consecutive invalid actions of one seat that end a game."
    )

    @field_validator("table_size")
    @classmethod
    def _size(cls, size: int, info: ValidationInfo) -> int:
        return size_of_the_game(size, info)


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
