"""Fake engines and helpers the tests share (one place, imported like code)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from selfplay.engines import Generation, GenerationRequest
from selfplay.game.matching.rules import format_proposal
from selfplay.game.matching.turns import PROPOSAL_CHOICES
from selfplay.players.llm import ChatFormat


class MovesEngine:
    """A token engine that plays valid matching moves: ``first_move``, then a proposal of the
    identity assignment; it accepts any proposal it is shown."""

    max_context = None

    def __init__(
        self,
        chat: ChatFormat,
        n: int = 3,
        *,
        first_move: str = "[message] Hello! What do you know about Ava Li?",
        latency: float = 0.0,
        name: str = "moves",
    ) -> None:
        self.chat, self.n, self.first_move, self.latency, self.name = (
            chat,
            n,
            first_move,
            latency,
            name,
        )
        self.requests = 0
        self.generated_tokens = 0

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def generate(self, request: GenerationRequest) -> Generation:
        self.requests += 1
        await asyncio.sleep(self.latency)
        text = self.chat.decode(list(request.prompt_ids))
        last_user = text[text.rfind("<|im_start|>user") :]
        spoken = text.count("<|im_start|>assistant") - 1
        if PROPOSAL_CHOICES in last_user:
            action = "[accept]"
        elif spoken:
            action = "[propose] " + format_proposal([(i, i) for i in range(self.n)], self.n)
        else:
            action = self.first_move
        ids = [*self.chat.encode(action), self.chat.stop_token_ids[0]]
        self.generated_tokens += len(ids)
        return Generation(ids, [-0.25] * len(ids), "stop")


def mask_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The runs of mask-1 tokens of a seat's token list, in order (one per own action)."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


# The API partner stand-in's key variable, key and model name (tests/chat_standin.py).
PARTNER_KEY_ENV = "SELFPLAY_TEST_PARTNER_KEY"
PARTNER_SECRET = "sk-test-SECRET-d41d8cd98f00"
PARTNER_MODEL = "standin-model"


def generate_beside_api_partner(
    model: Path, out: Path, url: str, *, verbose: bool = False, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`selfplay generate` of 2 short 3x3 games, the model in seat 2 beside the API partner
    stand-in at ``url`` (its key in the environment): what the partner fault tests run."""
    cmd = [
        sys.executable, "-m", "selfplay", *(["-v"] if verbose else []), "generate",
        "--model", str(model), "--out", str(out), "--num-games", "2", "--concurrency", "1",
        "--table-size", "3", "--max-new-tokens", "16", "--max-actions", "4",
        "--partner", f"openai:{PARTNER_MODEL}", "--policy-seat", "2",
        "--partner-base-url", url, "--partner-key-env", PARTNER_KEY_ENV,
    ]  # fmt: skip
    env = {**os.environ, PARTNER_KEY_ENV: PARTNER_SECRET, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
