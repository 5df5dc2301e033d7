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
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from selfplay.engines import EngineFailure, Generation, GenerationRequest

log = logging.getLogger(__name__)

Reply = Callable[[Generation | BaseException], None]
RunBatch = Callable[[list[GenerationRequest], list[Reply]], None]
T = TypeVar("T")

# The one thread that runs the CPU engines' torch work in this process (``engine_thread``).
_engine_thread: concurrent.futures.ThreadPoolExecutor | None = None
_engine_thread_id: int | None = None
_engine_thread_lock = threading.Lock()


def engine_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The process's engine thread: one worker that runs every CPU engine's torch work, from
    loading the model to each batch.

    torch's CPU kernels run on GNU OpenMP, which gives each thread that starts parallel work a
    pool of its own. Two pools on a machine with as many cores as one pool has threads count as
    oversubscribed, and libgomp then lets its idle threads spin only about a hundred times
    before they sleep, so every parallel region (a product, a dtype conversion) wakes them from
    the kernel: a 57 x 576 conversion to bf16 took 68 us on a worker thread whose process had a
    pool on its main thread against 12 us on one pool, and a 64-game stage 30.0 / 31.2 s against
    24.7 / 26.5 s on one thread (the AVX-512 BF16 EPYC, alternating). asyncio's default
    executor runs each batch on whichever of its threads is free, each with a pool of its own."""
    global _engine_thread
    with _engine_thread_lock:
        if _engine_thread is None:
            _engine_thread = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="selfplay-engine", initializer=_mark_engine_thread
            )
        return _engine_thread


def _mark_engine_thread() -> None:
    global _engine_thread_id
    _engine_thread_id = threading.get_ident()


def on_engine_thread(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on the engine thread (``engine_thread``), waited for; inline when called
    there (an engine built while another one is being built, as the dtype measurement does)."""
    if threading.get_ident() == _engine_thread_id:
        return fn(*args)
    return engine_thread().submit(fn, *args).result()


@dataclass
class _Item:
    request: GenerationRequest
    future: asyncio.Future


class Batcher:
    """A queue plus one worker task; ``submit`` is what an engine's ``generate`` awaits. Batches
    run on ``executor`` (a CPU engine's: the engine thread, ``engine_thread``), else on asyncio's
    default executor."""

    def __init__(
        self,
        run_batch: RunBatch,
        *,
        max_batch_size: int,
        name: str = "engine",
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        self._run_batch = run_batch
        self._executor = executor  # where batches run (None: asyncio's default executor)
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
                requests = [it.request for it in batch]
                await loop.run_in_executor(self._executor, self._run_batch, requests, replies)
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
