"""A local stand-in for an OpenAI-compatible chat endpoint, for the API partner tests.

``ChatStandIn`` serves ``POST /v1/chat/completions`` (FastAPI under uvicorn, in a thread) on
127.0.0.1 at a free port. Each answer comes from ``reply(body) -> str`` (default: accept a pending
proposal, otherwise a short shy message), with a ``usage`` block. It records every request it
receives (headers and JSON body) and can answer with an error status (429 by default) a given
number of times first. Use it as a context manager; ``url`` is the base URL to give the client.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from selfplay.game.matching.turns import PROPOSAL_CHOICES


def shy_reply(body: dict) -> str:
    """Accept a pending proposal; otherwise a vague shy message (a function of the request)."""
    last = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
    if PROPOSAL_CHOICES in last:
        return "[accept]"
    return "[message] Hard to say. Ask me about one reviewer and one paper."


class ChatStandIn:
    def __init__(self, reply: Callable[[dict], str] = shy_reply) -> None:
        self.reply = reply
        self.requests: list[dict] = []  # {"headers": {...}, "body": {...}, "status": int}
        # (status, message, Retry-After) still to answer
        self._fail: list[tuple[int, str | None, str]] = []
        self._lock = threading.Lock()
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self._complete)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        )
        self._thread: threading.Thread | None = None

    def fail_next(
        self,
        times: int,
        status: int = 429,
        message: str | None = None,
        retry_after: str = "0",
    ) -> None:
        """Answer the next ``times`` requests with ``status`` (and ``Retry-After`` for 429), the
        error saying ``message`` (default: ``stand-in says STATUS``)."""
        with self._lock:
            self._fail.extend([(status, message, retry_after)] * times)

    @property
    def answered(self) -> list[dict]:
        """The requests answered with 200."""
        return [r for r in self.requests if r["status"] == 200]

    async def _complete(self, request: Request) -> JSONResponse:
        body = await request.json()
        with self._lock:
            status, message, retry_after = self._fail.pop(0) if self._fail else (200, None, "0")
            self.requests.append({"headers": dict(request.headers), "body": body, "status": status})
        if status != 200:
            headers = {"retry-after": retry_after} if status == 429 else {}
            return JSONResponse(
                {"error": {"message": message or f"stand-in says {status}"}},
                status,
                headers=headers,
            )
        text = self.reply(body)
        prompt_tokens = sum(len(m["content"].split()) for m in body["messages"])
        return JSONResponse(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": len(text.split()),
                    "total_tokens": prompt_tokens + len(text.split()),
                },
            }
        )

    def __enter__(self) -> ChatStandIn:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.time() + 20
        while not self._server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError("the chat stand-in did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._sock.close()
