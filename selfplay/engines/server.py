"""What the server engines (SGLang, vLLM) share: launch or attach, health, retries, shutdown.

A ``ServerEngine`` either launches ``command()`` as a subprocess (its own process group, its output
in a log file) or attaches to ``config.url``. ``start`` waits for ``/health`` (failing at once when
a launched server exits, or when nothing listens at an attached URL), reads what the server says
about the model, and sends one 1-token probe so that a server that rejects our parameters fails
the run once instead of failing every game. ``generate`` posts ``payload(request)`` to
``GENERATE_PATH`` and reads the answer with ``parse``, which a subclass writes for its wire format.

Every request goes through ``bounded.fetch``: its answer must be whole within a deadline (a server
that drips bytes times out) and within a size cap (a generation over ``MAX_GENERATION_BYTES``, an
error body cut at ``MAX_ERROR_BYTES``), so no answer is read, logged or stored whole past it.

Failures: connection errors, timeouts, 5xx answers and aborted requests are retried with
exponential backoff, one warning per failed attempt, all within ``deadline_s``; when the retries or
the deadline are spent, or a launched server has exited, ``EngineFailure`` says so (with the tail
of the server log). A 4xx answer is the request's own fault, and so is a generation over its cap
(``EngineRequestError``: that game ends with outcome ``error``). A launched server is always shut
down by ``aclose`` (SIGTERM to its group, then SIGKILL), and at interpreter exit as a last resort.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import logging
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from selfplay.engines import (
    EngineFailure,
    EngineRequestError,
    Generation,
    GenerationRequest,
    ServerEngineConfig,
    bounded,
)
from selfplay.engines.answers import check_answer, vocab_size
from selfplay.engines.bounded import Answer, AnswerTooLarge, Attempts, fetch
from selfplay.engines.servertext import server_text

log = logging.getLogger(__name__)

RETRYABLE = (httpx.TransportError, httpx.TimeoutException)


class ServerEngine:
    """A client of one inference server (launched here or already running)."""

    LABEL = "server"  # for messages: "SGLang", "vLLM"
    GENERATE_PATH = "/generate"
    PACKAGE = "the server package"  # what the launching Python must have (launch errors)
    PYTHON_FLAG = "--engine-python"  # the option that names that Python

    def __init__(self, config: ServerEngineConfig) -> None:
        self.config = config
        self.name = config.model
        self.max_context: int | None = None
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self._log_file = None
        if config.url:
            self.url = config.url.rstrip("/")
        else:
            self.url = f"http://{config.host}:{config.port}"
            self._launch()
        self._client: httpx.AsyncClient | None = None
        self.vocab = vocab_size(config.model)  # None: a hub id only the server resolves
        self._closed = False
        self.generated_tokens = 0

    # -- what a server kind defines --------------------------------------------------------

    def command(self) -> list[str]:
        """The launch command (``config.python -m ...``)."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """Variables added to the launched server's environment."""
        return {}

    def payload(self, request: GenerationRequest) -> dict:
        """The JSON body of one generation request."""
        raise NotImplementedError

    @staticmethod
    def parse(data: dict | list, prompt_tokens: int = 0) -> Generation:
        """One answer -> Generation (ids and behaviour log-probs); ``EngineFailure`` when the
        answer is not in the format we read."""
        raise NotImplementedError

    async def read_model_info(self) -> None:
        """Set ``max_context`` (and whatever else the server says about its model); by default
        from ``/v1/models``, which SGLang and vLLM both serve."""
        model = await self.served_model()
        length = model.get("max_model_len") if model else None
        if isinstance(length, int):
            self.max_context = length

    async def served_model(self) -> dict | None:
        """The first entry of ``/v1/models`` (None when the server gives none)."""
        try:
            r = await fetch(self.client(), "GET", "/v1/models", timeout_s=10.0)
            models = r.json().get("data") if r.status_code == 200 else None
        except (*RETRYABLE, AnswerTooLarge, ValueError, AttributeError):
            return None
        return models[0] if models and isinstance(models[0], dict) else None

    def probe_hint(self, answer: str) -> str:
        """A hint appended to a refused probe's message (e.g. the version a field needs)."""
        return ""

    async def load_weights(self, model_path: str) -> None:
        """Load new weights (same architecture) from a checkpoint folder into the server."""
        raise NotImplementedError

    # -- server process ----------------------------------------------------------------------

    def _launch(self) -> None:
        if self.config.log_path:
            self.log_path = Path(self.config.log_path)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        else:
            fd, name = tempfile.mkstemp(prefix=f"{self.LABEL.lower()}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        try:  # never through a link planted at the log's path (O_NOFOLLOW)
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
            self._log_file = os.fdopen(os.open(self.log_path, flags, 0o644), "ab")
        except OSError as e:
            raise EngineFailure(
                f"cannot write the {self.LABEL} server's log {self.log_path} ({e.strerror}; a "
                "symbolic link there is refused): remove it, or choose another log path"
            ) from None
        cmd = self.command()
        log.info("launching %s: %s (log: %s)", self.LABEL, " ".join(cmd), self.log_path)
        try:
            self.process = subprocess.Popen(
                cmd,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.environment()},
                start_new_session=True,  # its own process group: we can stop all its workers
            )
        except OSError as e:
            raise EngineFailure(
                f"cannot start the {self.LABEL} server with {cmd[0]!r}: {e}. Set the Python that "
                f"has {self.PACKAGE} installed ({self.PYTHON_FLAG}) or attach to a running server "
                "(--engine-url)"
            ) from e
        self._atexit = functools.partial(_kill_group, self.process)
        atexit.register(self._atexit)

    def _server_exit(self) -> str | None:
        """Why the launched server is gone (None while it runs or when we only attached)."""
        if self.process is None or self.process.poll() is None:
            return None
        return (
            f"the {self.LABEL} server process exited with code {self.process.returncode}; "
            f"last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as f:
            f.seek(max(0, self.log_path.stat().st_size - 16384))
            text = f.read().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    # -- lifecycle ---------------------------------------------------------------------------

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise EngineFailure(f"{type(self).__name__}.start() was not awaited")
        return self._client

    async def start(self) -> None:
        """Wait until /health answers 200 (or the launched server dies, or the timeout passes)."""
        c = self.config
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(c.request_timeout_s, connect=10.0),
            limits=httpx.Limits(
                max_connections=c.max_connections, max_keepalive_connections=c.max_connections
            ),
        )
        deadline = time.monotonic() + c.startup_timeout_s
        last = "no answer yet"
        log.info(
            "waiting for the %s server at %s to answer /health (up to %.0f s)%s",
            self.LABEL,
            self.url,
            c.startup_timeout_s,
            f"; its log: {self.log_path}" if self.log_path else "",
        )
        while True:
            reason = self._server_exit()
            if reason:
                raise EngineFailure(f"{self.LABEL} server did not come up: {reason}")
            try:
                r = await fetch(self._client, "GET", "/health", timeout_s=5.0)
                if r.status_code == 200:
                    break
                last = f"HTTP {r.status_code}"
            except httpx.ConnectError as e:
                if self.process is None:  # attached: nothing is starting up there, say so now
                    raise EngineFailure(
                        f"nothing answers at {self.url} ({e}); start the {self.LABEL} server "
                        "there, fix --engine-url, or leave it out to launch one"
                    ) from e
                last = f"{type(e).__name__}: {e}"
            except (*RETRYABLE, AnswerTooLarge) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise EngineFailure(
                    f"{self.LABEL} server at {self.url} not healthy after "
                    f"{c.startup_timeout_s:.0f} s ({last})"
                    + (f"; log: {self.log_path}" if self.log_path else "")
                )
            await asyncio.sleep(0.5)
        await self.read_model_info()
        await self._probe()
        log.info("%s server at %s is healthy", self.LABEL, self.url)

    async def _probe(self) -> None:
        body = self.payload(GenerationRequest([0], max_new_tokens=1, temperature=1.0, seed=0))
        try:
            r = await self.post(body, timeout_s=min(120.0, self.config.deadline_s))
        except (*RETRYABLE, AnswerTooLarge) as e:
            raise EngineFailure(
                f"{self.LABEL} server at {self.url}: probe request failed: {e}"
            ) from e
        if r.status_code != 200:
            raise EngineFailure(
                f"{self.LABEL} server at {self.url} refused a probe request: HTTP "
                f"{r.status_code}: {server_text(r.text, 500)}{self.probe_hint(r.text)}"
            )
        self.parse(self.answer_json(r), 1)  # raises when the answer is not in the format we read

    async def post(self, body: dict | None, *, timeout_s: float, path: str | None = None) -> Answer:
        """POST ``body`` (JSON; None: no body) to ``path`` (``GENERATE_PATH``): the whole answer
        within ``timeout_s`` and ``MAX_GENERATION_BYTES`` (see ``bounded.fetch``)."""
        return await fetch(
            self.client(),
            "POST",
            path or self.GENERATE_PATH,
            timeout_s=timeout_s,
            max_bytes=bounded.MAX_GENERATION_BYTES,
            **({"json": body} if body is not None else {}),
        )

    def answer_json(self, r: Answer):
        """A 200 answer's JSON; one that is not JSON (a proxy's page, another server at the URL)
        fails saying what the server sent, instead of a bare JSONDecodeError."""
        try:
            return r.json()
        except ValueError:
            raise EngineFailure(
                f"{self.LABEL} server at {self.url} answered {r.path} with something "
                f"that is not JSON: {server_text(r.text, 200)!r}; check that --engine-url is a "
                f"{self.LABEL} server"
            ) from None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._client is not None:
            await self._client.aclose()
        if self.process is not None:
            await asyncio.to_thread(_stop_group, self.process, self.LABEL)
            atexit.unregister(self._atexit)
            log.info("%s server stopped (exit code %s)", self.LABEL, self.process.returncode)
        if self._log_file is not None:
            self._log_file.close()

    # -- requests ----------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> Generation:
        body = self.payload(request)
        c = self.config
        problem = ""
        attempts = Attempts.of(f"{self.LABEL} request", c)
        for _ in attempts:
            reason = self._server_exit()
            if reason:
                raise EngineFailure(f"{self.LABEL} server at {self.url} died: {reason}")
            try:
                r = await self.post(body, timeout_s=attempts.timeout())
            except RETRYABLE as e:
                problem = f"{type(e).__name__}: {e}".rstrip(": ")
                if await attempts.failed(problem):
                    continue
                break
            except AnswerTooLarge as e:
                # the same request would get the same answer: only this game fails
                raise EngineRequestError(
                    f"{self.LABEL} at {self.url}: {e}, the most a generation may have; lower "
                    "max_new_tokens, or check what the server at that URL sends"
                ) from None
            if r.status_code >= 500:
                problem = f"HTTP {r.status_code}: {server_text(r.text, 300)}"
                if await attempts.failed(problem):
                    continue
                break
            if r.status_code >= 400:
                raise EngineRequestError(
                    f"{self.LABEL} refused a request: HTTP {r.status_code}: "
                    f"{server_text(r.text, 500)}"
                )
            gen = self.parse(self.answer_json(r), len(request.prompt_ids))
            check_answer(gen, request, self.vocab, f"the {self.LABEL} server at {self.url}")
            if gen.finish_reason == "abort":
                problem = f"request aborted by the server ({gen.meta.get('finish_reason')})"
                if await attempts.failed(problem):
                    continue
                break
            self.generated_tokens += len(gen.token_ids)
            return gen
        reason = self._server_exit()
        raise EngineFailure(
            f"{self.LABEL} server at {self.url} {attempts.summary(problem)}"
            + (f"; {reason}" if reason else "")
        )


def _stop_group(process: subprocess.Popen, label: str, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group, wait, then SIGKILL whatever is left."""
    if process.poll() is not None:
        _kill_group(process)  # workers of a dead leader may still hold the GPU
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        log.warning("%s server ignored SIGTERM for %.0f s; killing it", label, grace_s)
    _kill_group(process)
    process.wait()


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
