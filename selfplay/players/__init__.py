"""Players: given what their seat was just shown, return the seat's next action text.

A player knows nothing of the trainer. LLM players also keep their seat's exact tokens
(``tokens()``); scripted and API players return None there.
"""

from __future__ import annotations

from typing import Protocol

from selfplay.records import SeatConfig, SeatTokens


class Player(Protocol):
    config: SeatConfig

    async def act(self, observation: str) -> str:
        """Everything shown to this seat since its last action (one or more lines) -> its action."""
        ...

    def tokens(self) -> SeatTokens | None:
        """The seat's token list (LLM players) or None."""
        ...
