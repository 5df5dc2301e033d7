"""The teacher player: a seat whose turns come from a teacher, recorded as a model's own turns.

Behaviour cloning needs rows that are exactly what the model would see and produce had it played
the teacher's moves. ``TeacherPlayer`` wraps any player (a scripted policy, or a replay of logged
turns) and keeps the seat's tokens through the LLM player's own ``SeatLog``: the same chat
template deltas (mask 0) and, for each teacher turn, its text tokenised once plus the template's
end-of-turn token (mask 1, log-prob 0). A row cut from such a record decodes on its mask-1 tokens
to exactly the teacher's action texts.
"""

from __future__ import annotations

from selfplay.players import Player
from selfplay.players.llm import ChatFormat, SeatLog
from selfplay.records import SeatConfig, SeatTokens


class TeacherPlayer:
    """Plays ``teacher``'s moves and records them token-exactly under ``chat`` (a trained seat)."""

    def __init__(self, teacher: Player, chat: ChatFormat) -> None:
        self.teacher = teacher
        self.chat = chat
        self.log = SeatLog(chat)
        self.config = SeatConfig(kind="scripted", name=teacher.config.name, trained=True)

    async def act(self, observation: str) -> str:
        self.log.add_prompt(self.log.prompt_delta(observation), observation)
        action = await self.teacher.act(observation)
        ids = [*self.chat.encode(action), self.chat.stop_token_ids[0]]
        return self.log.add_own(ids, [0.0] * len(ids), stopped=True)

    def tokens(self) -> SeatTokens:
        return self.log.tokens()
