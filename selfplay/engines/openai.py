"""Any OpenAI-compatible chat endpoint (POST {base_url}/chat/completions), for fixed API partners.

Messages in, one assistant text out (the ``ChatEngine`` protocol). The API key is read from an
environment variable at construction and lives only in the request header: it is never logged,
never put into an error message and never recorded. Transport errors, timeouts, 429 and 5xx
answers are retried with exponential backoff (honouring Retry-After up to a cap), each failed
attempt one warning; every attempt must be whole within ``request_timeout_s`` and the call within
``deadline_s`` (``bounded``: a server that drips its answer a byte at a time times out too). When
the retries or the deadline are spent the engine raises ``EngineFailure``. 401, 403 and 404 (a
bad key, no access, a wrong model or URL) fail every request alike, so they raise
``EngineFailure`` too; other 4xx answers raise ``EngineRequestError``, and so does an answer over
``MAX_CHAT_BYTES`` (never read further, parsed or kept: the game ends with outcome ``error``).
Every text from the server (error texts and the answers themselves) has the key, and every piece
of it, blanked out before it is cut short, logged or stored (``servertext``).
The engine counts what it spent: ``requests`` (HTTP attempts), ``retries``, ``prompt_tokens`` and
``completion_tokens`` (from the answers' ``usage``).
"""

from __future__ import annotations

import logging
import os

import httpx
from pydantic import BaseModel, ConfigDict, Field

from selfplay.engines import EngineFailure, EngineRequestError, FinishReason, bounded
from selfplay.engines.bounded import Answer, AnswerTooLarge, Attempts, fetch
from selfplay.engines.servertext import redact, server_text

log = logging.getLogger(__name__)


class OpenAIEngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = "openai"
    model: str  # e.g. gpt-4.1
    base_url: str = "https://api.openai.com/v1"
    api_key_env: str = "OPENAI_API_KEY"  # the variable's name, never its value
    request_timeout_s: float = Field(120.0, gt=0)  # one attempt, sent and read whole
    deadline_s: float = Field(300.0, gt=0)  # one call: every attempt and wait together
    retries: int = Field(5, ge=0)
    backoff_s: float = Field(1.0, ge=0)
    max_connections: int = Field(64, ge=1)


class OpenAIEngine:
    """A chat-completions client. Safe to call concurrently."""

    def __init__(
        self, config: OpenAIEngineConfig, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.config = config
        self.name = config.model
        key = os.environ.get(config.api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.AsyncClient(
            base_url=config.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(config.request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=config.max_connections),
            transport=transport,
        )
        self.has_key = key is not None
        self._key = key or None  # only to blank it out of what the server sends back
        self.requests = 0
        self.retries = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def __repr__(self) -> str:  # never show the header
        return f"OpenAIEngine(model={self.name!r}, base_url={self.config.base_url!r})"

    async def start(self) -> None:
        return None

    async def chat(
        self,
        messages: list[dict[str, str]],
        *,
        temperature: float = 0.7,
        top_p: float = 1.0,
        max_tokens: int = 256,
    ) -> tuple[str, FinishReason]:
        body = {
            "model": self.config.model,
            "messages": messages,
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_tokens,
        }
        c = self.config
        problem = ""
        attempts = Attempts.of(f"{self.name} at {c.base_url}", c)
        for k in attempts:
            if k > 1:
                self.retries += 1
            self.requests += 1
            try:
                r = await fetch(
                    self._client,
                    "POST",
                    "/chat/completions",
                    json=body,
                    timeout_s=attempts.timeout(),
                    max_bytes=bounded.MAX_CHAT_BYTES,
                )
            except (httpx.TransportError, httpx.TimeoutException) as e:
                problem = f"{type(e).__name__}: {server_text(str(e), 200, [self._key])}"
                if await attempts.failed(problem.rstrip(": ")):
                    continue
                break
            except AnswerTooLarge as e:
                # the same request would get the same answer: not retried; the game ends with
                # outcome error and nothing of the answer is kept
                raise EngineRequestError(
                    f"{self.name} at {c.base_url}: {e}, the most a chat answer may have; "
                    "nothing of it is kept. Lower the partner's max_tokens, or check what the "
                    "server at that URL sends"
                ) from None
            if r.status_code == 429 or r.status_code >= 500:
                problem = f"HTTP {r.status_code}: {server_text(_error_text(r), 200, [self._key])}"
                if await attempts.failed(problem, r.headers.get("retry-after")):
                    continue
                break
            if r.status_code >= 400:
                unset = "" if self.has_key else f" (${c.api_key_env} is not set)"
                message = (
                    f"{self.name} at {c.base_url} refused a request: HTTP {r.status_code}: "
                    f"{server_text(_error_text(r), 500, [self._key])}{unset}"
                )
                if r.status_code in (401, 403, 404):
                    raise EngineFailure(
                        f"{message}. Check the key in ${c.api_key_env}, the model name and the "
                        "base URL"
                    )
                raise EngineRequestError(message)
            try:
                answer = r.json()
                choice = answer["choices"][0]
                # a server that echoes the request could hand the key back as the partner's
                # words, which the records and the partner cache keep
                text = redact(choice["message"]["content"] or "", [self._key])
            except (KeyError, IndexError, TypeError, ValueError) as e:
                raise EngineFailure(
                    f"{self.name} at {c.base_url}: unexpected chat completion answer "
                    f"({type(e).__name__}): {server_text(r.text, 200, [self._key])!r}"
                ) from e
            usage = answer.get("usage") if isinstance(answer, dict) else None
            if isinstance(usage, dict):
                self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
                self.completion_tokens += int(usage.get("completion_tokens") or 0)
            finish = "length" if choice.get("finish_reason") == "length" else "stop"
            return text, finish
        raise EngineFailure(
            f"{self.name} at {c.base_url} {attempts.summary(problem)}; check that the server "
            "at that URL is up and answering"
        )

    async def aclose(self) -> None:
        await self._client.aclose()


def _error_text(r: Answer) -> str:
    """The server's error message (of the body's capped head): ``server_text`` redacts it before
    it is cut."""
    try:
        body = r.json()
    except ValueError:
        return r.text
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", ""))
    return r.text
