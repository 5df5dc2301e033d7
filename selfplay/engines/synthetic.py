"""A synthetic engine for benchmarks and tests: every batch is answered after a fixed latency.

It answers every request with the same token ids (log-prob -1.0 each), so a run's wall time
against ``actions x latency`` measures the overhead of the runner, the players and the batching,
not of a model. Two modes:

- ``serial``: batches exactly like the hf engine (the same ``Batcher``): one batch at a time, so
  the games' own work between two batches adds to the wall time.
- ``server``: like an SGLang server with continuous batching: a request is answered ``latency``
  after it arrives, whatever else is in flight, so the games' work overlaps the engine's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from selfplay.engines import Generation, GenerationRequest
from selfplay.engines.batching import Batcher, Reply


class SyntheticEngine:
    def __init__(
        self,
        reply_ids: Sequence[int],
        *,
        latency_s: float = 0.1,
        max_batch_size: int = 1_000_000,
        name: str = "synthetic",
        max_context: int | None = None,
        mode: str = "serial",
    ) -> None:
        if mode not in ("serial", "server"):
            raise ValueError(f"mode must be serial or server, got {mode!r}")
        self.mode = mode
        self.name = name
        self.max_context = max_context
        self.reply_ids = list(reply_ids)
        self.latency_s = latency_s
        self._batcher = Batcher(self._run_batch, max_batch_size=max_batch_size, name=name)
        self.generated_tokens = 0

    @property
    def batches(self) -> int:
        return self._batcher.batches

    async def start(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> Generation:
        if self.mode == "server":
            await asyncio.sleep(self.latency_s)
            return self._answer(request)
        return await self._batcher.submit(request)

    async def aclose(self) -> None:
        await self._batcher.aclose()

    def _run_batch(self, requests: list[GenerationRequest], replies: list[Reply]) -> None:
        time.sleep(self.latency_s)
        for r, reply in zip(requests, replies):
            reply(self._answer(r))

    def _answer(self, r: GenerationRequest) -> Generation:
        ids: list[int] = []
        for token in self.reply_ids[: r.max_new_tokens]:  # up to a stop token, kept
            ids.append(token)
            if token in r.stop_token_ids:
                break
        stop = bool(ids) and ids[-1] in r.stop_token_ids
        self.generated_tokens += len(ids)
        return Generation(
            token_ids=list(ids),
            logprobs=[-1.0] * len(ids),
            finish_reason="stop" if stop else "length",
            prompt_tokens=len(r.prompt_ids),
        )
