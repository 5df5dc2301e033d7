"""transformers in-process engine (CPU or GPU): the ``HFEngine`` face and its model loading.

The engine is built of parts, a module each: the decoding loop (``hf_decode``: padded batches
that requests join while they run), the prefill (``hf_prefill``: a prompt fed after the KV kept
for its start), the KV cache (``hf_kv``: the prefix cache and preallocated cache layers), the
CPU layouts (``hf_cpu``: grouped SDPA, the cascade over a batch's shared prefix, weight-major
linear layers, fused sibling projections) and the lean CPU decoding step (``hf_step``).
Their public names are importable from here too.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfplay.engines import KEEP_MODEL_ENV, Generation, GenerationRequest, HFEngineConfig
from selfplay.engines.batching import Batcher, engine_thread, on_engine_thread
from selfplay.engines.hf_cpu import (
    GROUPED_SDPA,
    WEIGHT_MAJOR_MAX_ROWS,
    fuse_projections,
    grouped_sdpa,
    passes_shared_prefix,
    weight_major_linears,
)
from selfplay.engines.hf_decode import DecodeLoop
from selfplay.engines.hf_dtype import engine_dtype
from selfplay.engines.hf_kv import (
    AUTO_PREFIX_MIN_TOKENS,
    AUTO_PREFIX_SHARE,
    PreallocatedLayer,
    PrefixCache,
    attention_shape,
    auto_prefix_budget,
    kv_bytes_per_token,
    plain_cache_layers,
)
from selfplay.engines.hf_prefill import (
    MIN_SHARED_PREFIX,
    MIN_SPARED_SLOTS,
    common_prefix,
    length_buckets,
    shared_prefix_groups,
)
from selfplay.engines.hf_step import lean_decode
from selfplay.hardware import resolve_dtype, usable_cores

__all__ = [
    "AUTO_PREFIX_MIN_TOKENS",
    "AUTO_PREFIX_SHARE",
    "MIN_SHARED_PREFIX",
    "MIN_SPARED_SLOTS",
    "WEIGHT_MAJOR_MAX_ROWS",
    "HFEngine",
    "PreallocatedLayer",
    "PrefixCache",
    "attention_shape",
    "auto_prefix_budget",
    "common_prefix",
    "grouped_sdpa",
    "kv_bytes_per_token",
    "length_buckets",
    "plain_cache_layers",
    "shared_prefix_groups",
    "weight_major_linears",
]

log = logging.getLogger(__name__)

# the last model loaded, kept where KEEP_MODEL_ENV is set (a held-out evaluation and the next
# round's generate in iterate's stage child load it once)
_kept: tuple[tuple, object, object] | None = None  # (key, model, tokenizer)


def _weights_key(path: str, dtype: torch.dtype) -> tuple:
    """What identifies a model's weights: its path, the dtype and, for a local folder, the
    files' sizes and modification times (a folder rewritten in place is loaded again); the model
    card (README.md, which a held-out evaluation annotates) does not count."""
    folder = Path(path)
    files = sorted(f for f in folder.iterdir() if f.suffix != ".md") if folder.is_dir() else []
    return path, dtype, tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)


def _load(path: str, dtype: torch.dtype, tokenizer):
    """The model (and tokenizer, unless given) at ``path`` in ``dtype``; in a stage child the
    last one loaded is kept for the next engine of the same weights."""
    global _kept
    keep = os.environ.get(KEEP_MODEL_ENV) == "1"
    key = _weights_key(path, dtype) if keep else None
    if _kept is not None and _kept[0] == key:
        log.info("reusing the model %s loaded by an earlier stage in this process", path)
        return _kept[1], tokenizer or _kept[2]
    _kept = None  # the old model goes before the new one loads
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
    except Exception as e:  # OSError, a corrupt safetensors file, a bad config.json
        raise RuntimeError(
            f"cannot load model {path!r}: {type(e).__name__}: {e}. Pass a local "
            "Hugging Face model directory or an HF model id this machine can download."
        ) from e
    if keep:
        _kept = (key, model, tokenizer)
    return model, tokenizer


class HFEngine(DecodeLoop):
    """A Hugging Face causal LM behind the ``Engine`` protocol."""

    def __init__(self, config: HFEngineConfig, *, model=None, tokenizer=None) -> None:
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        # on a CPU every torch op of the engine runs on the process's engine thread (one OpenMP
        # pool: batching.engine_thread), its loading and start-up checks too
        cpu = self.device.type == "cpu"
        self._executor = engine_thread() if cpu else None
        if cpu:
            on_engine_thread(self._setup, config, model, tokenizer)
        else:
            self._setup(config, model, tokenizer)

    def _setup(self, config: HFEngineConfig, model, tokenizer) -> None:
        self.config = config
        self.name = config.model
        if self.device.type == "cpu":
            threads = config.cpu_threads or usable_cores()
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        # auto: bf16 where the device computes it natively (selfplay.hardware); on a CPU that
        # does, the faster of fp32 and bf16 for this model, measured once (hf_dtype)
        if model is None:
            threads = torch.get_num_threads()
            measured = {"prefix_cache_tokens": 0, "cpu_threads": threads}
            self.dtype = engine_dtype(
                config.dtype, self.device.type, config.model, threads,
                lambda d: HFEngine(config.model_copy(update={**measured, "dtype": d})),
            )  # fmt: skip
        else:
            self.dtype = resolve_dtype(config.dtype, str(self.device))
        dtype = torch.bfloat16 if self.dtype == "bf16" else torch.float32
        if model is None:
            model, tokenizer = _load(config.model, dtype, tokenizer)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(config.model)
        self.model = model.to(self.device).eval()
        if self.device.type == "cpu":
            if self.model.config._attn_implementation == "sdpa":
                self.model.set_attn_implementation(grouped_sdpa())
            weight_major_linears(self.model)
            fuse_projections(self.model)
        self.max_context: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self._pad_id = next(
            (
                i
                for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0)
                if i is not None
            ),
            0,
        )
        self._batcher = Batcher(
            self._run_batch,
            max_batch_size=config.max_batch_size,
            name=f"hf engine {self.name}",
            executor=self._executor,
        )
        self.generated_tokens = 0
        self.prefilled_tokens = 0  # prompt tokens fed through the model
        self.reused_tokens = 0  # prompt tokens taken from KV computed for another request
        self.prefill_slots = 0  # rows x padded width of every prefill pass: compute, pads included
        # decoding: steps by their rows (dead ones too; matmul speed depends on a step's rows)
        # and the KV positions they read (rows x width, a shared prefix counted once), by rows
        # too; decode_steps, decode_rows and decode_kv_slots follow from them
        self.decode_batches: Counter[int] = Counter()
        self.decode_kv_by_rows: Counter[int] = Counter()
        # steps that read the batch's shared prefix once (cascade), and its columns, by rows
        self.shared_decode_steps = 0
        self.decode_shared_by_rows: Counter[int] = Counter()
        self._cache_layers = plain_cache_layers(self.model)
        # batches laid out with their shared prefix in the first columns, which decoding attends
        # to once for all rows (hf_cpu's cascade attention; CPU only)
        self._shared_layout = (
            self.device.type == "cpu"
            and bool(self._cache_layers)
            and self.model.config._attn_implementation == GROUPED_SDPA
            and passes_shared_prefix(self.model)
        )
        # decoding steps without transformers' per-layer glue, where the model is one it covers
        self._lean = lean_decode(self.model, self._cache_layers) if self._shared_layout else None
        budget = config.prefix_cache_tokens
        if budget is None:
            budget = auto_prefix_budget(self.model, str(self.device))
        self.prefix_cache = PrefixCache(budget) if budget and self._cache_layers else None

    @property
    def decode_steps(self) -> int:
        return self.decode_batches.total()

    @property
    def decode_kv_slots(self) -> int:
        return self.decode_kv_by_rows.total()

    @property
    def decode_rows(self) -> int:
        return sum(rows * steps for rows, steps in self.decode_batches.items())

    async def start(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> Generation:
        return await self._batcher.submit(request)

    async def aclose(self) -> None:
        await self._batcher.aclose()
