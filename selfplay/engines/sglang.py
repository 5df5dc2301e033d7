"""SGLang server engine: launch ``python -m sglang.launch_server`` or attach to a URL; talk HTTP.

Nothing here imports sglang: the server may live in another Python environment (``python``).
Each request is one POST /generate with ``input_ids`` and ``return_logprob``; the server batches
concurrent requests itself (continuous batching), so every game's request goes out at once.
Token ids and log-probs come from ``meta_info.output_token_logprobs`` ([logprob, id, text] per
generated token, EOS included), checked against ``completion_tokens``.

Failures: connection errors, timeouts, 5xx answers and aborted requests are retried with
exponential backoff; when the retries are spent, or a launched server has exited, ``EngineFailure``
says so (with the tail of the server log). A 4xx answer is the request's own fault
(``EngineRequestError``: that game ends with outcome ``error``). A launched server runs in its own
process group and is always shut down by ``aclose`` (SIGTERM, then SIGKILL), and at interpreter
exit as a last resort.
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
    SGLangEngineConfig,
)

log = logging.getLogger(__name__)

_RETRYABLE = (httpx.TransportError, httpx.TimeoutException)


class SGLangEngine:
    """A client of one SGLang server (launched here or already running)."""

    def __init__(self, config: SGLangEngineConfig) -> None:
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
        self._closed = False
        self.generated_tokens = 0

    # -- server process ----------------------------------------------------------------------

    def command(self) -> list[str]:
        c = self.config
        cmd = [
            c.python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            c.model,
            "--host",
            c.host,
            "--port",
            str(c.port),
            "--tp-size",
            str(c.tp_size),
        ]
        if c.mem_fraction is not None:
            cmd += ["--mem-fraction-static", str(c.mem_fraction)]
        return cmd + list(c.extra_args)

    def _launch(self) -> None:
        if self.config.log_path:
            self.log_path = Path(self.config.log_path)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        else:
            fd, name = tempfile.mkstemp(prefix="sglang-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log_file = self.log_path.open("ab")
        cmd = self.command()
        log.info("launching SGLang: %s (log: %s)", " ".join(cmd), self.log_path)
        try:
            self.process = subprocess.Popen(
                cmd,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: we can stop all its workers
            )
        except OSError as e:
            raise EngineFailure(
                f"cannot start the SGLang server with {cmd[0]!r}: {e}. Set the Python that has "
                "sglang installed (--sglang-python) or attach to a running server (--engine-url)"
            ) from e
        self._atexit = functools.partial(_kill_group, self.process)
        atexit.register(self._atexit)

    def _server_exit(self) -> str | None:
        """Why the launched server is gone (None while it runs or when we only attached)."""
        if self.process is None or self.process.poll() is None:
            return None
        return (
            f"the SGLang server process exited with code {self.process.returncode}; "
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
            "waiting for the SGLang server at %s to answer /health (up to %.0f s)%s",
            self.url,
            c.startup_timeout_s,
            f"; its log: {self.log_path}" if self.log_path else "",
        )
        while True:
            reason = self._server_exit()
            if reason:
                raise EngineFailure(f"SGLang server did not come up: {reason}")
            try:
                r = await self._client.get("/health", timeout=5.0)
                if r.status_code == 200:
                    break
                last = f"HTTP {r.status_code}"
            except httpx.ConnectError as e:
                if self.process is None:  # attached: nothing is starting up there, say so now
                    raise EngineFailure(
                        f"nothing answers at {self.url} ({e}); start the SGLang server there, "
                        "fix --engine-url, or leave it out to launch one"
                    ) from e
                last = f"{type(e).__name__}: {e}"
            except _RETRYABLE as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise EngineFailure(
                    f"SGLang server at {self.url} not healthy after {c.startup_timeout_s:.0f} s "
                    f"({last})" + (f"; log: {self.log_path}" if self.log_path else "")
                )
            await asyncio.sleep(0.5)
        await self._read_model_info()
        await self._probe()
        log.info("SGLang server at %s is healthy", self.url)

    async def _probe(self) -> None:
        """One 1-token request: a server that rejects our parameters fails the run here, once,
        instead of failing every game."""
        assert self._client is not None
        body = self.payload(GenerationRequest([0], max_new_tokens=1, temperature=1.0, seed=0))
        try:
            r = await self._client.post("/generate", json=body, timeout=120.0)
        except _RETRYABLE as e:
            raise EngineFailure(f"SGLang server at {self.url}: probe request failed: {e}") from e
        if r.status_code != 200:
            hint = " (sampling_seed needs SGLang >= 0.5.6)" if "sampling_seed" in r.text else ""
            raise EngineFailure(
                f"SGLang server at {self.url} refused a probe request: HTTP {r.status_code}: "
                f"{r.text[:500]}{hint}"
            )
        self.parse(r.json(), 1)  # raises when the logprob format is not the one we read

    async def _read_model_info(self) -> None:
        assert self._client is not None
        for path in ("/model_info", "/get_model_info"):
            try:
                r = await self._client.get(path, timeout=10.0)
            except _RETRYABLE:
                return
            if r.status_code == 200:
                info = r.json()
                length = info.get("max_context_length") or info.get("context_length")
                if isinstance(length, int):
                    self.max_context = length
                return

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._client is not None:
            await self._client.aclose()
        if self.process is not None:
            await asyncio.to_thread(_stop_group, self.process)
            atexit.unregister(self._atexit)
            log.info("SGLang server stopped (exit code %s)", self.process.returncode)
        if self._log_file is not None:
            self._log_file.close()

    # -- requests ----------------------------------------------------------------------------

    def payload(self, request: GenerationRequest) -> dict:
        params: dict = {
            "max_new_tokens": request.max_new_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
        }
        if request.stop_token_ids:
            params["stop_token_ids"] = list(request.stop_token_ids)
        if request.seed is not None:
            params["sampling_seed"] = request.seed  # SGLang >= 0.5.6
        return {
            "input_ids": list(request.prompt_ids),
            "sampling_params": params,
            "return_logprob": True,
        }

    async def generate(self, request: GenerationRequest) -> Generation:
        if self._client is None:
            raise EngineFailure("SGLangEngine.start() was not awaited before generate()")
        body = self.payload(request)
        c = self.config
        problem = ""
        for attempt in range(c.retries + 1):
            if attempt:
                await asyncio.sleep(c.backoff_s * 2 ** (attempt - 1))
            reason = self._server_exit()
            if reason:
                raise EngineFailure(f"SGLang server at {self.url} died: {reason}")
            try:
                r = await self._client.post("/generate", json=body)
            except _RETRYABLE as e:
                problem = f"{type(e).__name__}: {e}".rstrip(": ")
                log.warning("SGLang request failed (attempt %d): %s", attempt + 1, problem)
                continue
            if r.status_code >= 500:
                problem = f"HTTP {r.status_code}: {r.text[:300]}"
                log.warning("SGLang request failed (attempt %d): %s", attempt + 1, problem)
                continue
            if r.status_code >= 400:
                raise EngineRequestError(
                    f"SGLang refused a request: HTTP {r.status_code}: {r.text}"
                )
            gen = self.parse(r.json(), len(request.prompt_ids))
            if gen.finish_reason == "abort":
                problem = f"request aborted by the server ({gen.meta.get('finish_reason')})"
                log.warning("SGLang request aborted (attempt %d)", attempt + 1)
                continue
            self.generated_tokens += len(gen.token_ids)
            return gen
        reason = self._server_exit()
        raise EngineFailure(
            f"SGLang server at {self.url} failed {c.retries + 1} times: {problem}"
            + (f"; {reason}" if reason else "")
        )

    @staticmethod
    def parse(data: dict | list, prompt_tokens: int = 0) -> Generation:
        """One /generate answer -> Generation; ids and log-probs from output_token_logprobs."""
        if isinstance(data, list):
            if len(data) != 1:
                raise EngineFailure(f"expected one /generate answer, got {len(data)}")
            data = data[0]
        try:
            meta = data["meta_info"]
            pairs = meta["output_token_logprobs"]
            finish = meta.get("finish_reason") or {}
        except (KeyError, TypeError) as e:
            raise EngineFailure(
                f"unexpected /generate answer (missing {e}); is return_logprob supported?"
            ) from e
        ids = [int(p[1]) for p in pairs]
        logprobs = [float(p[0]) if p[0] is not None else 0.0 for p in pairs]
        expected = meta.get("completion_tokens")
        if expected is not None and expected != len(ids):
            raise EngineFailure(
                f"/generate returned {len(ids)} output_token_logprobs for {expected} completion "
                "tokens; this SGLang version's logprob format is not supported"
            )
        kind = finish.get("type") if isinstance(finish, dict) else finish
        reason = {"stop": "stop", "length": "length", "abort": "abort"}.get(kind or "", "stop")
        return Generation(
            token_ids=ids,
            logprobs=logprobs,
            finish_reason=reason,  # type: ignore[arg-type]
            text=data.get("text", ""),
            prompt_tokens=meta.get("prompt_tokens", prompt_tokens),
            meta={"finish_reason": finish, "cached_tokens": meta.get("cached_tokens")},
        )

    async def worker_urls(self) -> list[str]:
        """The servers behind this URL: a router's workers (sglang-router's ``/list_workers``
        or the gateway's ``/workers``), else just this server."""
        assert self._client is not None
        for path in ("/list_workers", "/workers"):
            try:
                r = await self._client.get(path, timeout=10.0)
            except _RETRYABLE:
                continue
            if r.status_code != 200:
                continue
            try:
                data = r.json()
            except ValueError:
                continue
            found = data.get("urls") if isinstance(data, dict) else None
            if found is None and isinstance(data, dict):
                found = [w.get("url") for w in data.get("workers", []) if isinstance(w, dict)]
            urls = [u.rstrip("/") for u in found or [] if isinstance(u, str) and u]
            if urls:
                return urls
        return [self.url]

    async def update_weights_from_disk(self, model_path: str) -> None:
        """Load new weights (same architecture) into the running server, or into every worker
        when the URL is a router in front of several servers (each is told directly)."""
        if self._client is None:
            raise EngineFailure("SGLangEngine.start() was not awaited")
        urls = await self.worker_urls()
        body = {"model_path": model_path, "flush_cache": True}
        async with httpx.AsyncClient(timeout=self.config.request_timeout_s) as client:
            answers = await asyncio.gather(
                *(client.post(f"{u}/update_weights_from_disk", json=body) for u in urls),
                return_exceptions=True,
            )
        for url, r in zip(urls, answers):
            if isinstance(r, BaseException):
                raise EngineFailure(f"SGLang worker {url} could not be reached for the reload: {r}")
            ok = r.headers.get("content-type", "").startswith("application/json")
            if r.status_code != 200 or not (ok and r.json().get("success", False)):
                raise EngineFailure(
                    f"SGLang worker {url} could not load weights from {model_path}: {r.text[:500]}"
                )
        log.info("reloaded %s into %d SGLang server(s): %s", model_path, len(urls), ", ".join(urls))
        self.name = model_path


def _stop_group(process: subprocess.Popen, grace_s: float = 30.0) -> None:
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
        log.warning("SGLang server ignored SIGTERM for %.0f s; killing it", grace_s)
    _kill_group(process)
    process.wait()


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
