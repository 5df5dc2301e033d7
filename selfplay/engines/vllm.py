"""vLLM server engine: launch ``python -m vllm.entrypoints.openai.api_server`` or attach to a URL.

Nothing here imports vllm: the server lives in its own venv (vLLM pins a newer transformers than
selfplay; ``scripts/setup_vllm.sh`` builds ``.venv-vllm``, CPU or GPU build by the machine).
Each request is one POST /v1/completions with the prompt as token ids, ``return_token_ids`` (the
exact sampled ids) and ``logprobs: 0`` (the sampled token's log-prob). The contract is the hf and
SGLang engines':

- the server stops only at the request's ``stop_token_ids`` (``ignore_eos``: the model's own EOS
  is not a stop unless the player asks for it), and the stop token is the last id;
- log-probs are log-softmax(logits / temperature): a launched server runs with
  ``--logprobs-mode processed_logprobs`` (vLLM's default reports the raw logits' log-probs, before
  temperature). With ``top_p`` < 1 vLLM's processed log-probs are after the top-p cut, where the
  hf engine's are before it; the default top_p is 1, where both are the same. An attached server
  started without that flag reports raw log-probs: ``start`` checks it with two probes and says so;
- top_k, min_p and the repetition penalty are sent as off, so a model's generation_config.json
  does not change the sampling (a launched server also gets ``--generation-config vllm``).

Weights: ``load_weights(path)`` POSTs ``/collective_rpc`` ``reload_weights`` (in place, every
worker; the server must run with ``VLLM_SERVER_DEV_MODE=1``, which a launched server gets) and then
``/reset_prefix_cache``, so no cached prefix of the old weights is reused. vLLM 0.32's in-place
reload keeps the old output head of a model that ties it to its input embedding (SmolLM2, the
small Qwen2.5 and Llama 3.2 models): such a reload is refused with what to do instead (a launched
server per round, which ``iterate`` does without ``--engine-url``). On a CPU the launched
server gets ``VLLM_CPU_KVCACHE_SPACE`` (GiB), ``--no-enable-chunked-prefill`` (vLLM 0.32's CPU
sampler crashes on a seeded request whose prefill is split) and, with ``cpu_threads``, that many
cores bound.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from selfplay.engines import (
    EngineFailure,
    Generation,
    GenerationRequest,
    VLLMEngineConfig,
)
from selfplay.engines.bounded import AnswerTooLarge
from selfplay.engines.server import RETRYABLE, ServerEngine
from selfplay.engines.servertext import server_text

log = logging.getLogger(__name__)


def _tied(model_path: str) -> bool:
    """Whether the checkpoint's config ties the output head to the input embedding. vLLM's
    layer-by-layer reload (0.32) reloads the embedding and puts the head's old tensors back
    ("ParallelLMHead: Failed to load weights" in its log): the tie is broken, and on a CPU the
    head's pre-packed GEMM weight is the old one. A path not readable here counts as untied."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class VLLMEngine(ServerEngine):
    """A client of one vLLM server (launched here or already running)."""

    LABEL = "vLLM"
    GENERATE_PATH = "/v1/completions"
    PACKAGE = "vllm"
    PYTHON_FLAG = "--vllm-python; scripts/setup_vllm.sh builds .venv-vllm"
    config: VLLMEngineConfig

    def __init__(self, config: VLLMEngineConfig) -> None:
        self.gpu = _has_gpu() if not config.url else None
        self.served = config.model  # the name requests must use; /v1/models tells an attached one
        super().__init__(config)

    def command(self) -> list[str]:
        from selfplay.hardware import resolve_dtype

        c = self.config
        dtype = resolve_dtype(c.dtype, "cuda" if self.gpu else "cpu")
        cmd = [
            c.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            c.model,
            "--host",
            c.host,
            "--port",
            str(c.port),
            "--dtype",
            {"fp32": "float32", "bf16": "bfloat16"}[dtype],
            "--tensor-parallel-size",
            str(c.tp_size),
            "--logprobs-mode",
            "processed_logprobs",
            "--generation-config",
            "vllm",
        ]
        if c.max_model_len is not None:
            cmd += ["--max-model-len", str(c.max_model_len)]
        if not self.gpu:
            # vLLM 0.32 on a CPU: a seeded request whose prefill is split into chunks kills the
            # engine ("CPU Generator does not use offset"); whole prefills never split
            cmd += ["--no-enable-chunked-prefill"]
        if c.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        return cmd + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        c = self.config
        env = {"VLLM_SERVER_DEV_MODE": "1"}  # /collective_rpc and /reset_prefix_cache
        if c.deterministic:  # batch-invariant kernels (vLLM docs: Hopper or newer GPUs)
            env["VLLM_BATCH_INVARIANT"] = "1"
        if not self.gpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(c.cpu_kv_cache_gb)))
            if c.cpu_threads is not None:
                cores = sorted(os.sched_getaffinity(0))[: c.cpu_threads]
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        return env

    async def read_model_info(self) -> None:
        """The served model's name (requests must use it) and context length, from /v1/models."""
        model = await self.served_model()
        if model is None or "id" not in model:
            raise EngineFailure(f"vLLM server at {self.url} lists no model at /v1/models")
        self.served = model["id"]
        await super().read_model_info()

    async def _probe(self) -> None:
        """Besides the generic probe: the log-probs must be after temperature. The two most
        likely next tokens are the same at temperature 1 and 0.5, and their log-probs lie twice
        as far apart at 0.5 when processed; raw ones are the same at both."""
        await super()._probe()
        c = self.config
        gaps = []
        for t in (1.0, 0.5):
            req = GenerationRequest([1, 2, 3], max_new_tokens=1, temperature=t, seed=0)
            try:
                r = await self.post(
                    self.payload(req) | {"logprobs": 2}, timeout_s=min(120.0, c.deadline_s)
                )
                top = sorted(r.json()["choices"][0]["logprobs"]["top_logprobs"][0].values())
            except (*RETRYABLE, AnswerTooLarge, KeyError, TypeError, IndexError, ValueError) as e:
                raise EngineFailure(f"vLLM server at {self.url}: no top log-probs: {e}") from e
            gaps.append(top[-1] - top[-2] if len(top) > 1 else 0.0)
        if gaps[0] > 1e-4 and abs(gaps[1] - gaps[0]) < 1e-3 * gaps[0]:
            raise EngineFailure(
                f"vLLM server at {self.url} reports log-probs before temperature (the same at "
                "temperature 1 and 0.5); start it with --logprobs-mode processed_logprobs, or let "
                "selfplay launch it (leave --engine-url out)"
            )

    def payload(self, request: GenerationRequest) -> dict:
        body: dict = {
            "model": self.served,
            "prompt": list(request.prompt_ids),
            "max_tokens": request.max_new_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "logprobs": 0,
            "return_token_ids": True,
            "ignore_eos": True,
            "stop_token_ids": list(request.stop_token_ids),
            "skip_special_tokens": False,
        }
        if request.seed is not None:
            body["seed"] = request.seed
        return body

    @staticmethod
    def parse(data: dict | list, prompt_tokens: int = 0) -> Generation:
        """One /v1/completions answer -> Generation; ids from ``token_ids``, log-probs from
        ``logprobs.token_logprobs`` (one per id, the stop token included)."""
        try:
            choice = data["choices"][0]  # type: ignore[index, call-overload]
            ids = list(choice["token_ids"])  # as sent: engines.answers.check_answer checks them
            logprobs = choice["logprobs"]["token_logprobs"]
        except (KeyError, TypeError, IndexError) as e:
            raise EngineFailure(
                f"unexpected /v1/completions answer (missing {e}); this vLLM version does not "
                "return token_ids and logprobs (vLLM >= 0.10 does)"
            ) from e
        if len(logprobs) != len(ids):
            raise EngineFailure(
                f"/v1/completions returned {len(logprobs)} log-probs for {len(ids)} token ids"
            )
        finish = choice.get("finish_reason")
        reason = {"stop": "stop", "length": "length", "abort": "abort"}.get(finish or "", "stop")
        usage = data.get("usage") or {}  # type: ignore[union-attr]
        return Generation(
            token_ids=ids,
            logprobs=[x if x is not None else 0.0 for x in logprobs],
            finish_reason=reason,  # type: ignore[arg-type]
            text=choice.get("text", ""),
            prompt_tokens=usage.get("prompt_tokens", prompt_tokens),
            meta={"finish_reason": finish, "stop_reason": choice.get("stop_reason")},
        )

    async def load_weights(self, model_path: str) -> None:
        """Reload ``model_path`` into the server in place (every worker), then drop its prefix
        cache. Refused for a model whose output head is its input embedding (see ``_tied``)."""
        if _tied(model_path):
            raise EngineFailure(
                f"{model_path} ties its output head to its input embedding "
                "(tie_word_embeddings), and vLLM's in-place reload keeps the old head for such "
                "models (measured with vLLM 0.32: log-probs of the new body with the old head). "
                "Let selfplay launch the server (leave --engine-url out): each round then starts "
                "one on its own checkpoint"
            )
        body = {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
        timeout_s = min(self.config.request_timeout_s, self.config.deadline_s)
        try:
            r = await self.post(body, timeout_s=timeout_s, path="/collective_rpc")
            if r.status_code == 200:
                r = await self.post(None, timeout_s=timeout_s, path="/reset_prefix_cache")
        except (*RETRYABLE, AnswerTooLarge) as e:
            raise EngineFailure(f"vLLM server at {self.url}: weight reload failed: {e}") from e
        if r.status_code == 404:
            raise EngineFailure(
                f"vLLM server at {self.url} has no /collective_rpc or /reset_prefix_cache: start "
                "it with VLLM_SERVER_DEV_MODE=1 to reload weights (a launched server has it)"
            )
        if r.status_code != 200:
            raise EngineFailure(
                f"vLLM server at {self.url} could not load weights from {model_path}: "
                f"HTTP {r.status_code}: {server_text(r.text, 500)}"
            )
        log.info("reloaded %s into the vLLM server at %s", model_path, self.url)
        self.name = model_path
