"""One seat's contract, below every game: how it samples, who plays it, and its exact tokens.

Players (``selfplay.players``, and a game's own scripted players) satisfy ``Player`` and build
``SeatConfig`` and ``SeatTokens``; ``selfplay.records`` keeps them in every ``GameRecord`` and
re-exports them. Nothing here imports a game, so a game module may import it.
"""

from __future__ import annotations

from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(
        0.7,
        ge=0.0,
        description="Sampling temperature (0: greedy).",
        json_schema_extra={"envvar": "TEMPERATURE"},
    )
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="Nucleus sampling: keep the top tokens of this mass."
    )
    max_new_tokens: int = Field(256, ge=1, description="Tokens per action at most.")
    seed: int | None = Field(None, description="The request's sampling seed (set per turn).")


class SeatConfig(BaseModel):
    """Who plays a seat: an LLM (model path or id), a scripted policy, or an API model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["llm", "scripted", "api"]
    name: str
    trained: bool = False  # whether this seat's tokens become training rows
    sampling: SamplingParams | None = None


class SeatTokens(BaseModel):
    """Exactly what one seat's model saw and produced, as one append-only token list.

    ``mask[i] == 1`` marks tokens the seat's own model generated; ``logprobs[i]`` is their behaviour
    log-probability (0.0 where mask is 0). ``messages`` is the readable chat of the same tokens.
    """

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    messages: list[dict[str, str]] = []
    tokenizer_fingerprint: str | None = None

    @model_validator(mode="after")
    def _aligned(self) -> SeatTokens:
        n = len(self.token_ids)
        if len(self.mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"token_ids ({n}), mask ({len(self.mask)}) and logprobs ({len(self.logprobs)}) "
                "must have the same length"
            )
        if not set(self.mask) <= {0, 1}:
            raise ValueError("mask values must be 0 or 1")
        return self


class Player(Protocol):
    """Given what its seat was just shown, a seat's next action text. A player knows nothing of
    the trainer; LLM players also keep their seat's exact tokens (``tokens()``)."""

    config: SeatConfig

    async def act(self, observation: str) -> str:
        """Everything shown to this seat since its last action (one or more lines) -> its action."""
        ...

    def tokens(self) -> SeatTokens | None:
        """The seat's token list (LLM players) or None (scripted and API players)."""
        ...
