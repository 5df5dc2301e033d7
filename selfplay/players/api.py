"""The API partner: a fixed partner played by a chat model behind an OpenAI-compatible endpoint.

``ApiPartner`` is the seat (the ``Player`` protocol): it keeps its own chat, the game's shy
persona (``DialogueGame.partner_persona``) as the system prompt and each observation as a user
turn, and returns the model's reply as its action. It has no tokens (``tokens()`` is None), so it
never becomes training rows.

``PartnerClient`` is the managed resource every API seat of a run shares:

- bounded concurrency (a semaphore around the engine; the engine retries 429/5xx with backoff,
  within ``deadline_s`` per answer, and refuses an answer over its size cap: that game ends with
  outcome ``error`` and nothing of the answer reaches the record or the cache);
- a reply cache keyed by a SHA-256 of (model, sampling, system prompt and the dialogue so far),
  persisted as append-only JSONL (``OUT/partner_cache.jsonl``; a torn last line is dropped), so
  a resumed or repeated run replays answers it already paid for; identical requests in flight at
  once share one call;
- a call cap (``max_calls``): the call that would exceed it raises ``PartnerCallCap``, an
  ``EngineFailure``, so the runner stops like on a dead engine: finished games are kept, games in
  flight are not recorded, and a re-run with a higher cap resumes (cached answers cost nothing);
- usage counts (calls, cache hits, retries, tokens) for the run summary, and on close one line
  per run in ``usage_path`` (``OUT/partner_usage.jsonl``: counts only, never a key or a prompt).

Calls run as their own tasks: a game cancelled while its partner waits does not cancel the call,
and ``aclose`` waits (up to ``drain_s``) for answers already paid for, so they reach the cache.
The API key lives only in the engine's request header; nothing here stores or logs it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson
from pydantic import BaseModel, ConfigDict, Field

from selfplay.engines import ChatEngine, EngineFailure
from selfplay.fileio import open_output
from selfplay.players.partners import (
    DEFAULT_BASE_URL,
    DEFAULT_KEY_ENV,
    OpenAIPartner,
    PartnerOptions,
)
from selfplay.records import (
    SamplingParams,
    SeatConfig,
    SeatTokens,
    iter_jsonl,
    repair_jsonl_tail,
)

log = logging.getLogger(__name__)


class PartnerCallCap(EngineFailure):
    """The run's partner call cap is spent: stop like an engine failure, keep finished games."""


class ApiPartnerConfig(BaseModel):
    """An API partner of one run (the engine's transport settings plus the resource limits)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    base_url: str = DEFAULT_BASE_URL
    api_key_env: str = DEFAULT_KEY_ENV  # the variable's name, never its value
    system_prompt: str = Field(min_length=1)  # the game's partner_persona
    temperature: float = Field(0.0, ge=0.0)  # greedy: a partner that answers the same way
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(256, ge=1)
    concurrency: int = Field(8, ge=1)  # requests in flight at most
    max_calls: int | None = Field(None, ge=1)  # paid calls per run; None: no cap
    cache_path: Path | None = None  # None: no persistent cache (in-memory only)
    usage_path: Path | None = None  # on close, one JSON line of this run's PartnerUsage
    retries: int = Field(5, ge=0)
    backoff_s: float = Field(1.0, ge=0.0)
    request_timeout_s: float = Field(120.0, gt=0)  # one attempt, sent and read whole
    deadline_s: float = Field(300.0, gt=0)  # one answer: every attempt and wait together
    drain_s: float = Field(30.0, ge=0.0)  # on close, wait this long for paid answers in flight

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_tokens
        )


@dataclass
class PartnerUsage:
    """What the partner cost this run; ``calls`` are paid requests (retries not counted)."""

    calls: int = 0
    cache_hits: int = 0
    shared: int = 0  # answers shared with an identical request already in flight
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    capped: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def cache_key(model: str, sampling: SamplingParams, messages: list[dict[str, str]]) -> str:
    """SHA-256 of the model, its sampling and the whole chat (system prompt included)."""
    payload = {
        "model": model,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_new_tokens,
        "messages": messages,
    }
    return hashlib.sha256(orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)).hexdigest()


class ReplyCache:
    """{key: reply text}, mirrored to an append-only JSONL file when a path is given.

    Loading drops a torn last line (a write cut off by a crash) and skips corrupt lines with a
    warning: a lost entry only means that answer is paid for again.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._replies: dict[str, str] = {}
        if path is None or not path.exists():
            return
        repair_jsonl_tail(path)
        for lineno, obj, _ in iter_jsonl(path):
            try:
                self._replies[obj["key"]] = str(obj["text"])
            except (KeyError, TypeError):  # not JSON (obj None) or not a cache entry
                log.warning("%s:%d: skipping a corrupt cache line", path, lineno)

    def __len__(self) -> int:
        return len(self._replies)

    def get(self, key: str) -> str | None:
        return self._replies.get(key)

    def put(self, key: str, model: str, text: str) -> None:
        self._replies[key] = text
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # one small write per line: lines never interleave, and flush makes it survive a kill
        with open_output(self.path, "ab") as f:
            f.write(orjson.dumps({"key": key, "model": model, "text": text}) + b"\n")
            f.flush()


class PartnerClient:
    """The run's API partner resource: concurrency, cache, call cap and usage (see the module)."""

    def __init__(self, config: ApiPartnerConfig, engine: ChatEngine) -> None:
        self.config = config
        self.engine = engine
        self.cache = ReplyCache(config.cache_path)
        self.usage = PartnerUsage()
        self._sem = asyncio.Semaphore(config.concurrency)
        self._inflight: dict[str, asyncio.Task] = {}
        if self.cache:
            log.info("partner cache %s: %d answers", config.cache_path, len(self.cache))

    @property
    def name(self) -> str:
        return self.config.model

    async def reply(self, messages: list[dict[str, str]]) -> str:
        """The model's answer to a chat (system prompt first); cached, capped, shared."""
        c = self.config
        key = cache_key(c.model, c.sampling, messages)
        cached = self.cache.get(key)
        if cached is not None:
            self.usage.cache_hits += 1
            return cached
        task = self._inflight.get(key)
        if task is not None:
            self.usage.shared += 1
        else:
            if c.max_calls is not None and self.usage.calls >= c.max_calls:
                self.usage.capped = True
                raise PartnerCallCap(
                    f"the partner call cap ({c.max_calls} calls to {c.model}) is spent; re-run "
                    "with a higher --partner-max-calls to play the missing games (answers "
                    "already paid for are cached and replayed for free)"
                )
            self.usage.calls += 1
            task = asyncio.get_running_loop().create_task(self._call(key, messages))
            self._inflight[key] = task
        # shielded: a cancelled game leaves the paid call running so that it reaches the cache
        return await asyncio.shield(task)

    async def _call(self, key: str, messages: list[dict[str, str]]) -> str:
        c = self.config
        try:
            async with self._sem:
                text, _finish = await self.engine.chat(
                    messages, temperature=c.temperature, top_p=c.top_p, max_tokens=c.max_tokens
                )
            self.cache.put(key, c.model, text)
            return text
        finally:
            self._inflight.pop(key, None)
            self._sync_usage()

    def _sync_usage(self) -> None:
        for name in ("retries", "prompt_tokens", "completion_tokens"):
            setattr(self.usage, name, int(getattr(self.engine, name, 0)))

    async def aclose(self) -> None:
        """Wait (up to ``drain_s``) for paid calls in flight, then close the engine."""
        pending = list(self._inflight.values())
        if pending:
            log.warning(
                "waiting up to %.0f s for %d partner answer(s) already paid for, so that they "
                "reach the cache (Ctrl-C again to stop at once)",
                self.config.drain_s,
                len(pending),
            )
            _done, late = await asyncio.wait(pending, timeout=self.config.drain_s)
            for t in late:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self._sync_usage()
        await self.engine.aclose()
        if self.config.usage_path is not None:
            line = {"time": time.time(), "model": self.name, **self.usage.as_dict()}
            with open_output(self.config.usage_path, "ab") as f:
                f.write(orjson.dumps(line) + b"\n")
        log.info("partner %s: %s", self.name, self.usage.as_dict())


def api_partner_config(
    options: PartnerOptions, out: Path | None, *, concurrency: int = 8
) -> ApiPartnerConfig | None:
    """The API partner of a run's partner options (None for self-play and scripted partners);
    its cache and usage files go in ``out`` (None: an in-memory cache only)."""
    game, spec = options.game, options.partner
    if not isinstance(spec, OpenAIPartner):
        return None
    if game.partner_persona is None:
        raise ValueError(
            f"--partner openai:{spec.model}: the game {game.name!r} has no partner persona "
            "(DialogueGame.partner_persona) for an API model to play"
        )
    extra = {"base_url": options.partner_base_url} if options.partner_base_url else {}
    return ApiPartnerConfig(
        model=spec.model,
        api_key_env=options.partner_key_env,
        concurrency=concurrency,
        max_calls=options.partner_max_calls,
        deadline_s=options.partner_deadline,
        system_prompt=game.partner_persona,
        cache_path=out / "partner_cache.jsonl" if out is not None else None,
        usage_path=out / "partner_usage.jsonl" if out is not None else None,
        **extra,
    )


def open_partner_client(config: ApiPartnerConfig) -> PartnerClient:
    """A PartnerClient over an OpenAI-compatible engine (the key is read from the environment)."""
    import os

    from selfplay.engines.openai import OpenAIEngine, OpenAIEngineConfig

    if not os.environ.get(config.api_key_env):
        log.warning(
            "$%s is not set: requests to %s go without an API key",
            config.api_key_env,
            config.base_url,
        )
    engine = OpenAIEngine(
        OpenAIEngineConfig(
            # model, base_url, api_key_env (the variable's name), timeout, retries, backoff
            **config.model_dump(include=set(OpenAIEngineConfig.model_fields) - {"kind"}),
            max_connections=config.concurrency,
        )
    )
    return PartnerClient(config, engine)


class ApiPartner:
    """A partner seat played by an API chat model with the client's system prompt (shy)."""

    def __init__(self, client: PartnerClient) -> None:
        self.client = client
        self.config = SeatConfig(
            kind="api", name=client.name, trained=False, sampling=client.config.sampling
        )
        self._messages: list[dict[str, str]] = [
            {"role": "system", "content": client.config.system_prompt}
        ]

    async def act(self, observation: str) -> str:
        self._messages.append({"role": "user", "content": observation})
        text = (await self.client.reply(list(self._messages))).strip()
        self._messages.append({"role": "assistant", "content": text})
        return text

    def tokens(self) -> SeatTokens | None:
        return None
