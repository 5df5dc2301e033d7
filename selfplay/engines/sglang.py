"""SGLang server engine: launch ``python -m sglang.launch_server`` or attach to a URL; talk HTTP.

Nothing here imports sglang: the server may live in another Python environment (``python``).
Each request is one POST /generate with ``input_ids`` and ``return_logprob``; the server batches
concurrent requests itself (continuous batching), so every game's request goes out at once.
Token ids and log-probs come from ``meta_info.output_token_logprobs`` ([logprob, id, text] per
generated token, EOS included), checked against ``completion_tokens``. Launching, health, retries,
shutdown and the context length (``/v1/models``: SGLang's ``/model_info`` has none, checked
against the 0.5.23 release in tests/test_sglang_release.py) are ``ServerEngine``'s.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from selfplay.engines import EngineFailure, Generation, GenerationRequest, SGLangEngineConfig
from selfplay.engines.bounded import AnswerTooLarge, fetch
from selfplay.engines.server import RETRYABLE, ServerEngine
from selfplay.engines.servertext import server_text

log = logging.getLogger(__name__)


class SGLangEngine(ServerEngine):
    """A client of one SGLang server (launched here or already running)."""

    LABEL = "SGLang"
    GENERATE_PATH = "/generate"
    PACKAGE = "sglang"
    PYTHON_FLAG = "--sglang-python"
    config: SGLangEngineConfig

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
        if c.deterministic:  # batch-invariant kernels: a request's tokens never depend on others
            cmd.append("--enable-deterministic-inference")
        return cmd + list(c.extra_args)

    def probe_hint(self, answer: str) -> str:
        return " (sampling_seed needs SGLang >= 0.5.6)" if "sampling_seed" in answer else ""

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
        ids = [p[1] for p in pairs]  # as sent: engines.answers.check_answer checks them
        logprobs = [p[0] if p[0] is not None else 0.0 for p in pairs]
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
        for path in ("/list_workers", "/workers"):
            try:
                r = await fetch(self.client(), "GET", path, timeout_s=10.0)
            except (*RETRYABLE, AnswerTooLarge):
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

    async def load_weights(self, model_path: str) -> None:
        """Load new weights (same architecture) into the running server, or into every worker
        when the URL is a router in front of several servers (each is told directly): POST
        /update_weights_from_disk."""
        self.client()
        urls = await self.worker_urls()
        body = {"model_path": model_path, "flush_cache": True}
        timeout_s = min(self.config.request_timeout_s, self.config.deadline_s)
        async with httpx.AsyncClient() as client:
            answers = await asyncio.gather(
                *(
                    fetch(
                        client,
                        "POST",
                        f"{u}/update_weights_from_disk",
                        json=body,
                        timeout_s=timeout_s,
                    )
                    for u in urls
                ),
                return_exceptions=True,
            )
        for url, r in zip(urls, answers):
            if isinstance(r, BaseException):
                raise EngineFailure(f"SGLang worker {url} could not be reached for the reload: {r}")
            ok = r.headers.get("content-type", "").startswith("application/json")
            if r.status_code != 200 or not (ok and r.json().get("success", False)):
                raise EngineFailure(
                    f"SGLang worker {url} could not load weights from {model_path}: "
                    f"{server_text(r.text, 500)}"
                )
        log.info("reloaded %s into %d SGLang server(s): %s", model_path, len(urls), ", ".join(urls))
        self.name = model_path
