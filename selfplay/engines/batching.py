"""Gather concurrent ``generate`` calls into batches run by a synchronous function in a thread.

Many games call ``generate`` at nearly the same time; the batcher waits until no new request
arrives within one turn of the event loop (so every game that is ready joins), takes up to
``max_batch_size`` requests, and hands them to ``run_batch`` in a worker thread. ``run_batch``
answers each request through its ``reply`` callback as soon as that row is finished, so a game
can think about its next move while the rest of the batch is still decoding, and ``run_batch``
may take requests that arrived since (``take_waiting``) into the batch it is running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from selfplay.engines import EngineFailure, Generation, GenerationRequest

log = logging.getLogger(__name__)

Reply = Callable[[Generation | BaseException], None]
RunBatch = Callable[[list[GenerationRequest], list[Reply]], None]


@dataclass
class _Item:
    request: GenerationRequest
    future: asyncio.Future


class Batcher:
    """A queue plus one worker task; ``submit`` is what an engine's ``generate`` awaits."""

    def __init__(self, run_batch: RunBatch, *, max_batch_size: int, name: str = "engine") -> None:
        self._run_batch = run_batch
        self._max = max_batch_size
        self._name = name
        self._pending: list[_Item] = []
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._closed = False
        self.stopping = threading.Event()  # run_batch checks it between steps to stop early
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: list[_Item] = []  # the batch being decoded, joined requests included
        self.batches = 0  # statistics, for benchmarks
        self.rows = 0
        self.joined = 0  # rows taken into a running batch (``take_waiting``)

    async def submit(self, request: GenerationRequest) -> Generation:
        if self._closed:
            raise EngineFailure(f"{self._name} is closed")
        loop = asyncio.get_running_loop()
        if self._worker is None:
            self._loop = loop
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._work(), name=f"{self._name}-batcher")
        future = loop.create_future()
        self._pending.append(_Item(request, future))
        assert self._wake is not None
        self._wake.set()
        return await future

    async def _gather(self) -> list[_Item]:
        # Let every game that is about to submit do so: wait until the queue stops growing.
        seen = -1
        for _ in range(64):
            if len(self._pending) == seen or len(self._pending) >= self._max:
                break
            seen = len(self._pending)
            await asyncio.sleep(0)
        live = [it for it in self._pending if not it.future.done()]
        batch, self._pending = live[: self._max], live[self._max :]
        return batch

    @property
    def waiting(self) -> int:
        """Requests waiting for a batch (a hint: read without a lock from any thread)."""
        return len(self._pending)

    def take_waiting(self, limit: int) -> tuple[list[GenerationRequest], list[Reply]]:
        """Called by ``run_batch`` (in the worker thread): up to ``limit`` waiting requests and
        their reply callbacks, now part of the running batch."""

        async def take() -> list[_Item]:
            live = [it for it in self._pending if not it.future.done()]
            taken, self._pending = live[:limit], live[limit:]
            self._running += taken
            return taken

        if limit < 1 or self._loop is None or self._closed or self.stopping.is_set():
            return [], []
        try:
            items = asyncio.run_coroutine_threadsafe(take(), self._loop).result()
        except RuntimeError:  # the loop is closed: the engine is going away
            return [], []
        self.rows += len(items)
        self.joined += len(items)
        return [it.request for it in items], [_replier(self._loop, it.future) for it in items]

    async def _work(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch = await self._gather()
            if self._pending:
                self._wake.set()
            if not batch:
                continue
            self.batches += 1
            self.rows += len(batch)
            self._running = list(batch)
            replies = [_replier(loop, it.future) for it in batch]
            try:
                await asyncio.to_thread(self._run_batch, [it.request for it in batch], replies)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the engine itself broke: every waiting game must hear it
                log.exception("%s: batch of %d failed", self._name, len(self._running))
                failure = EngineFailure(f"{self._name} failed on a batch: {type(e).__name__}: {e}")
                for it in self._running:
                    if not it.future.done():
                        it.future.set_exception(failure)
            # a row the batch forgot to answer is a bug; never leave a game hanging
            for it in self._running:
                if not it.future.done():
                    it.future.set_exception(EngineFailure(f"{self._name} did not answer a request"))
            self._running = []

    async def aclose(self) -> None:
        self._closed = True
        self.stopping.set()
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._worker
            self._worker = None
        for it in self._pending:
            if not it.future.done():
                it.future.set_exception(EngineFailure(f"{self._name} was closed"))
        self._pending = []


def _replier(loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> Reply:
    """A thread-safe callback that resolves ``future`` on the event loop (once)."""

    def resolve(result: Generation | BaseException) -> None:
        if future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    def reply(result: Generation | BaseException) -> None:
        # RuntimeError: the loop is gone (shut down while a batch was running)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(resolve, result)

    return reply
