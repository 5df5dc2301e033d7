"""Inference engines: token-id prompts and sampling parameters in; ids, log-probs, text out.

Engines are transport only and know nothing about games. Three kinds:

- ``hf``: transformers in-process (CPU or GPU); concurrent requests go into padded batches.
- ``sglang``: an SGLang server (launched as a subprocess or attached by URL), ``/generate`` with
  ``input_ids``; the client imports nothing from sglang.
- ``openai``: any OpenAI-compatible chat endpoint (messages in, text out) for fixed API partners;
  it speaks ``ChatEngine``, not ``Engine``.

``ENGINE_CONFIGS`` lists the token engines' configs (each names its engine class, imported only
when ``open_engine(config)`` opens it). A dead or unreachable
engine raises ``EngineFailure`` (fatal for a run); a request the engine rejects raises
``EngineRequestError`` (the game ends with outcome ``error``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal, Protocol, Union
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from selfplay.errors import EngineFailure
from selfplay.hardware import ComputeDtype

# Set (to 1) in a process that runs one stage after another with the same weights (iterate's stage
# child): the hf engine then keeps the last model it loaded for the next engine of those weights.
KEEP_MODEL_ENV = "SELFPLAY_KEEP_MODEL"

FinishReason = Literal["stop", "length", "abort"]

__all__ = [
    "ENGINE_CONFIGS",
    "ENGINE_KINDS",
    "ChatEngine",
    "Engine",
    "EngineConfig",
    "EngineFailure",
    "EngineRequestError",
    "FinishReason",
    "Generation",
    "GenerationRequest",
    "HFEngineConfig",
    "LentEngine",
    "SGLangEngineConfig",
    "ServerEngineConfig",
    "VLLMEngineConfig",
    "engine_config_class",
    "open_engine",
]


class EngineRequestError(RuntimeError):
    """The engine refused one request (too long, bad parameters): only that game fails."""


@dataclass(frozen=True)
class GenerationRequest:
    """One completion of a token-id prompt; ``seed`` makes the sample reproducible."""

    prompt_ids: Sequence[int]
    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Generation:
    """The sampled ids (a stop token included when one ended it) and their behaviour log-probs.

    Log-probs are log-softmax(logits / temperature) before top-p renormalisation (as SGLang).
    ``text`` is the engine's decoding, for display only; players decode ids themselves.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str = ""
    prompt_tokens: int = 0
    meta: dict = field(default_factory=dict)


class Engine(Protocol):
    """A token-in/token-out engine. ``generate`` may be called concurrently from many games."""

    name: str  # the model, as it goes into the records
    max_context: int | None  # prompt + completion limit in tokens, when known

    async def start(self) -> None:
        """Get ready to serve (wait for a server's health). Called once before ``generate``."""
        ...

    async def generate(self, request: GenerationRequest) -> Generation: ...

    async def aclose(self) -> None:
        """Release the engine (stop batching, shut a launched server down). Idempotent."""
        ...


class LentEngine:
    """An engine its owner started and will close, lent to a caller that would otherwise open and
    close its own (iterate's held-out evaluation playing beside generate on one engine, so that
    their requests share batches): ``start`` and ``aclose`` do nothing, the rest is the owner's."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def start(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> Generation:
        return await self._engine.generate(request)

    async def aclose(self) -> None:
        return None


class ChatEngine(Protocol):
    """A chat engine for API partners: messages in, one assistant text out."""

    name: str

    async def chat(
        self, messages: list[dict[str, str]], *, temperature: float, top_p: float, max_tokens: int
    ) -> tuple[str, FinishReason]: ...

    async def aclose(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Engine configs: each engine sees only its own.


class HFEngineConfig(BaseModel):
    """transformers in-process: batched decoding with a prefix KV cache (CPU or one GPU)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    engine: ClassVar[str] = "selfplay.engines.hf:HFEngine"  # imported when opened (torch)

    kind: Literal["hf"] = "hf"
    model: str
    device: str | None = Field(None, description="cpu, cuda, cuda:1 (default: cuda if any).")
    dtype: ComputeDtype = "auto"  # the weights' dtype too; float32/bfloat16 read as fp32/bf16
    max_batch_size: int = Field(64, ge=1, description="requests decoded together at most.")
    # torch CPU threads (process-wide). None: every core this process may run on. The games'
    # event loop is light beside decoding (under 2% of a run's CPU time, profiled): on 2 cores,
    # 2 threads generated 64 games 1.4-1.8x faster than 1 (benchmarks/bench_generate.py part e).
    cpu_threads: int | None = Field(None, ge=1)
    # Prefix KV cache budget in tokens (0: off). A finished row's KV is kept so that the next turn
    # of its conversation prefills only the new tokens; the least recently kept go first. A token
    # costs 2 x layers x kv heads x head dim x dtype bytes: 23 KB for SmolLM2-135M in bfloat16,
    # 57 KB for Qwen2.5-7B. None: a quarter of the memory free when the engine starts (a budget
    # below the live conversations' tokens evicts what the next turns need: 128 games in flight
    # took 89 s with 65,536 tokens and 78 s with 262,144).
    prefix_cache_tokens: int | None = Field(
        None,
        ge=0,
        description="tokens of finished turns kept as KV cache, so a seat's next turn prefills "
        "only its new tokens (0: off; default: a quarter of the free memory).",
    )
    # Batched rows are not batch-invariant: which requests share a step changes the padded
    # shapes, and with them the float sums of a row's logits (about 1e-6), which can flip a
    # sampled token; which requests share a step depends on timing. Decoding every request
    # alone, its whole conversation prefilled each turn, makes a game's tokens a function of its
    # seed and model only, at any concurrency.
    deterministic: bool = Field(
        False,
        description="reproducible games at any --concurrency: each request decoded alone, no "
        "prefix cache (max batch 1, prefix cache 0); slower. A launched sglang or vllm server "
        "gets its batch-invariant mode (GPU).",
    )

    @model_validator(mode="before")
    @classmethod
    def _deterministic(cls, data):
        if isinstance(data, dict) and data.get("deterministic"):
            return {**data, "max_batch_size": 1, "prefix_cache_tokens": 0}
        return data


class ServerEngineConfig(BaseModel):
    """What every server engine shares: launched here (``python -m ...`` in its own process group,
    its log in ``log_path``) or attached by URL; health, timeouts, retries."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    url: str | None = Field(None, description="attach to a running server (or router) at this URL.")
    python: str = Field("python", description="the Python that has the server (another venv).")
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=1, le=65535, description="port of the launched server.")
    tp_size: int = Field(1, ge=1, description="tensor-parallel size of the launched server.")
    extra_args: tuple[str, ...] = Field((), description="extra server flag, repeatable.")
    log_path: str | None = None  # server stdout/stderr; None: a temporary file
    startup_timeout_s: float = Field(
        900.0,
        gt=0,
        description="seconds to wait for the server's /health (a launched server loads the "
        "model first; an attached URL that refuses connections fails at once).",
    )
    request_timeout_s: float = Field(600.0, gt=0)  # one attempt, sent and read whole
    # one generation: every attempt and wait together (a server that drips its answer a byte at a
    # time, or keeps failing, fails the run within it)
    deadline_s: float = Field(
        1800.0,
        gt=0,
        description="seconds one generation may take at most, every retry and wait included.",
    )
    retries: int = Field(4, ge=0)
    backoff_s: float = Field(1.0, ge=0)
    max_connections: int = Field(1024, ge=1)
    # the server's own batch-invariant mode (SGLang --enable-deterministic-inference, vLLM
    # VLLM_BATCH_INVARIANT=1; GPU only, by their docs): set from hf's --deterministic
    deterministic: bool = False

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        """Only http(s)://HOST[:PORT] speaks to a server: anything else fails here, at once,
        instead of being retried until the health timeout."""
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s)://HOST:PORT address of a server")
        try:
            parts.port  # noqa: B018  (a port that is not a number raises here)
        except ValueError as e:
            raise ValueError(f"{url!r}: {e}") from None
        return url


class SGLangEngineConfig(ServerEngineConfig):
    """An SGLang server launched here, or attached by URL (a router in front of many)."""

    engine: ClassVar[str] = "selfplay.engines.sglang:SGLangEngine"

    kind: Literal["sglang"] = "sglang"
    python: str = Field(
        "python", description="the Python that has sglang (it may be another venv)."
    )
    mem_fraction: float | None = Field(
        None, gt=0.0, le=1.0, description="the launched server's --mem-fraction-static."
    )
    extra_args: tuple[str, ...] = Field(
        (), description="extra server flag, repeatable (--sglang-arg=--random-seed=1)."
    )


class VLLMEngineConfig(ServerEngineConfig):
    """A vLLM server (``python -m vllm.entrypoints.openai.api_server``) launched here, or attached
    by URL; /v1/completions with prompt token ids. vLLM pins a newer transformers than selfplay,
    so it usually lives in its own venv: ``scripts/setup_vllm.sh`` builds one (``.venv-vllm``)."""

    engine: ClassVar[str] = "selfplay.engines.vllm:VLLMEngine"

    kind: Literal["vllm"] = "vllm"
    python: str = Field(
        "python",
        description="the Python that has vllm (scripts/setup_vllm.sh prints one: .venv-vllm).",
    )
    port: int = Field(8000, ge=1, le=65535, description="port of the launched server.")
    dtype: ComputeDtype = "auto"  # the launched server's --dtype
    max_model_len: int | None = Field(
        4096, ge=16, description="the launched server's --max-model-len (None: the model's)."
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="the launched server's --gpu-memory-utilization."
    )
    cpu_kv_cache_gb: float = Field(
        2.0, gt=0, description="CPU only: KV cache of the launched server (VLLM_CPU_KVCACHE_SPACE)."
    )
    # torch threads of a launched CPU server; None: all cores but one (the games' event loop).
    cpu_threads: int | None = Field(None, ge=1)
    extra_args: tuple[str, ...] = Field(
        (), description="extra server flag, repeatable (--vllm-arg=--enforce-eager)."
    )


# The engines there are. Adding one: a module with its Engine class (built from its config), its
# config class above (a ``kind`` literal and the ``engine`` path), and its entry here. Configs
# validate by ``kind`` wherever a config holds an engine; ``--engine`` takes every kind.
ENGINE_CONFIGS: tuple[type[BaseModel], ...] = (HFEngineConfig, SGLangEngineConfig, VLLMEngineConfig)
ENGINE_KINDS: tuple[str, ...] = tuple(c.model_fields["kind"].default for c in ENGINE_CONFIGS)
EngineConfig = Annotated[Union[ENGINE_CONFIGS], Field(discriminator="kind")]  # noqa: UP007


def engine_config_class(kind: str) -> type[BaseModel]:
    """The config class of engine ``kind``; ``ValueError`` naming the kinds there are."""
    for config in ENGINE_CONFIGS:
        if config.model_fields["kind"].default == kind:
            return config
    raise ValueError(f"unknown engine {kind!r}; engines: {', '.join(ENGINE_KINDS)}")


def open_engine(config: BaseModel) -> Engine:
    """Build the engine a config names (an SGLang server is launched here, awaited in ``start``).

    The caller owns the engine and must ``await engine.aclose()`` (also on Ctrl-C).
    """
    if type(config) not in ENGINE_CONFIGS:
        raise ValueError(f"unknown engine config {type(config).__name__}")
    module, name = type(config).engine.split(":")
    return getattr(importlib.import_module(module), name)(config)
