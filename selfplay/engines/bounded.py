"""Bounded HTTP for the engines and the API partner: every request has a deadline, every body a cap.

httpx's timeouts are per network operation: its read timeout starts again at each byte, so a
server that sends one byte every few seconds never times out, and ``response.text`` holds a body
of any size in memory. ``fetch`` sends one request and reads its body as a stream inside one
deadline (``asyncio.timeout`` around the send and the whole read), and stops reading at a size
cap: an error answer (status 400 or more) keeps its first ``MAX_ERROR_BYTES`` (only a head of it is
ever shown), any other answer past its cap raises ``AnswerTooLarge`` before anything parses,
logs or stores it.

``Attempts`` is one call's retry loop: at most ``retries + 1`` attempts, all within ``deadline_s``
of the first; each attempt gets what is left of it (at most ``request_timeout_s``). A failed
attempt logs one warning saying what failed, attempt k of n and the wait before the next (the
backoff, or the server's Retry-After capped at ``MAX_RETRY_AFTER_S``, the cap said). A wait that
would end past the deadline is not waited: the call fails at once, saying so.

The caps are here, in one place; tests lower them with monkeypatch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

MAX_CHAT_BYTES = 1 << 20  # a chat completion (the API partner's answer, before JSON parsing)
# a generation answer: ids and log-probs of up to tens of thousands of tokens (SGLang sends about
# 30 bytes a token), so a long completion fits with room to spare
MAX_GENERATION_BYTES = 16 << 20
MAX_INFO_BYTES = 1 << 20  # /health, /v1/models, a router's worker list, a reload's answer
MAX_ERROR_BYTES = 256 << 10  # an error answer's body: only its head is ever shown
MAX_RETRY_AFTER_S = 60.0  # a server's Retry-After is waited at most this long


class AnswerTooLarge(Exception):
    """An answer went on past its size cap; what was read is dropped."""

    def __init__(self, path: str, limit: int) -> None:
        super().__init__(f"the answer to {path} is over {size(limit)} (reading stopped there)")
        self.path = path
        self.limit = limit


def size(n: int) -> str:
    """``1 MiB``, ``256 KiB``, ``300 bytes``."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


@dataclass(frozen=True)
class Answer:
    """A whole answer, read within its deadline and cap. ``cut``: an error body longer than
    ``MAX_ERROR_BYTES``, of which ``content`` is the head."""

    status_code: int
    headers: httpx.Headers
    content: bytes
    path: str
    cut: bool = False

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace") + ("..." if self.cut else "")

    def json(self):
        """The body as JSON (``ValueError`` when it is not)."""
        return json.loads(self.content)


async def fetch(
    client: httpx.AsyncClient,
    method: str,
    path: str,
    *,
    timeout_s: float,
    max_bytes: int = MAX_INFO_BYTES,
    **kwargs,
) -> Answer:
    """One request, its whole answer within ``timeout_s`` (send and read together) and at most
    ``max_bytes`` (``MAX_ERROR_BYTES`` of an error answer, the rest cut off).

    Raises ``httpx.ReadTimeout`` when the deadline passes (an ``httpx.TimeoutException``, as
    callers retry), ``AnswerTooLarge`` when an answer below 400 goes past ``max_bytes``, and
    httpx's own transport errors.
    """
    # httpx's own per-operation timeouts still apply; none may outlast the whole
    kwargs.setdefault("timeout", httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)))
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream(method, path, **kwargs) as r:
                error = r.status_code >= 400
                limit = MAX_ERROR_BYTES if error else max_bytes
                declared = r.headers.get("content-length", "")
                if not error and declared.isdigit() and int(declared) > limit:
                    raise AnswerTooLarge(path, limit)  # said before a byte of it is read
                chunks: list[bytes] = []
                read = 0
                cut = False
                async for chunk in r.aiter_bytes():
                    chunks.append(chunk)
                    read += len(chunk)
                    if read > limit:
                        if not error:
                            raise AnswerTooLarge(path, limit)
                        cut = True
                        break  # leaving the block closes the connection: the rest is never read
                content = b"".join(chunks)[:limit]
                return Answer(r.status_code, r.headers, content, path, cut)
    except TimeoutError:
        seconds = f"{timeout_s:.2f}".rstrip("0").rstrip(".")
        raise httpx.ReadTimeout(f"no whole answer within {seconds} s") from None


def retry_wait(backoff_s: float, retry_after: str | None) -> tuple[float, str]:
    """The wait before a retry: the backoff, or the server's Retry-After when longer, capped at
    ``MAX_RETRY_AFTER_S``; and a note for the warning when the server asked for more."""
    wait = backoff_s
    if retry_after:
        try:
            asked = float(retry_after)  # an HTTP date is not read: the backoff stands
        except ValueError:
            return wait, ""
        if not math.isnan(asked) and asked > wait:
            if asked > MAX_RETRY_AFTER_S:
                return MAX_RETRY_AFTER_S, (
                    f" (the server's Retry-After of {retry_after.strip()} s, capped at "
                    f"{MAX_RETRY_AFTER_S:g} s)"
                )
            return asked, " (the server's Retry-After)"
    return wait, ""


class Attempts:
    """The attempts of one call (see the module): iterate it; call ``failed`` after each failed
    attempt, which warns, waits, and says whether to go on; ``summary`` says how it ended."""

    def __init__(
        self,
        what: str,
        *,
        retries: int,
        backoff_s: float,
        request_timeout_s: float,
        deadline_s: float,
    ) -> None:
        self.what = what  # "SGLang request", "gpt-4.1 at https://...": the warning's subject
        self.total = retries + 1
        self.backoff_s = backoff_s
        self.request_timeout_s = request_timeout_s
        self.deadline_s = deadline_s
        self.start = time.monotonic()
        self.k = 0  # attempts begun
        self.expired = False  # stopped by the deadline, not by the number of attempts

    @classmethod
    def of(cls, what: str, config) -> Attempts:
        """The attempts an engine config allows (its retries, backoff_s, request_timeout_s and
        deadline_s)."""
        return cls(
            what,
            retries=config.retries,
            backoff_s=config.backoff_s,
            request_timeout_s=config.request_timeout_s,
            deadline_s=config.deadline_s,
        )

    def __iter__(self):
        while self.k < self.total and not self.expired:
            self.k += 1
            yield self.k

    def left(self) -> float:
        return self.start + self.deadline_s - time.monotonic()

    def timeout(self) -> float:
        """This attempt's deadline: ``request_timeout_s``, or what is left of the call's."""
        return max(0.001, min(self.request_timeout_s, self.left()))

    async def failed(self, problem: str, retry_after: str | None = None) -> bool:
        """Warn about attempt k's failure and wait before the next; False: no attempt is left
        (the count is spent, or the wait would end past the deadline)."""
        head = f"{self.what} failed: {problem} (attempt {self.k} of {self.total})"
        if self.k >= self.total:
            log.warning("%s; no retries left", head)
            return False
        wait, note = retry_wait(self.backoff_s * 2 ** (self.k - 1), retry_after)
        if wait >= self.left():
            self.expired = True
            log.warning(
                "%s; a retry in %.1f s%s would start past the call's %g s deadline: giving up",
                head,
                wait,
                note,
                self.deadline_s,
            )
            return False
        log.warning("%s; retrying in %.1f s%s", head, wait, note)
        if wait > 0:
            await asyncio.sleep(wait)
        return True

    def summary(self, problem: str) -> str:
        """``failed N times in S s (last: ...)``, naming the deadline when it ended the call."""
        spent = time.monotonic() - self.start
        times = "once" if self.k == 1 else f"{self.k} times"
        if self.expired or self.left() <= 0:
            return (
                f"failed {times} in {spent:.1f} s, within the call's deadline of "
                f"{self.deadline_s:g} s (last: {problem})"
            )
        return f"failed {times} in {spent:.1f} s (last: {problem})"
