"""The hf engine's dtype on a CPU with native bf16: chosen by measurement, not by the flags alone.

``selfplay.hardware`` picks bf16 wherever the processor computes it natively, and that holds for
training and for a GPU. For generation on a CPU it does not always: which dtype generates faster
depends on the CPU's bf16 products against its fp32 ones and on the engine's paths in each. On
an AVX-512 BF16 CPU 16 games generated 1.2-1.65x faster in fp32 than in bf16 while the lean
decoding step (``hf_step.LeanDecode``) was fp32 only (issue 50); with it in bf16 too, this
module's timed batch there took fp32 4.44 s and bf16 2.44 s; with AMX, bf16 generated 2.1x
faster. So where the engine's dtype is ``auto``, the device a CPU and the CPU native in bf16,
the engine times a short batch of its own work (prefill and decoding steps of the same model) in
each dtype, in turn, and runs in the faster; fp32 unless bf16 is faster by ``MARGIN``. The
verdict is kept in ``$SELFPLAY_CACHE/engine-dtype.json`` under the CPU, its thread count,
torch's version, the engine's paths and the model's shapes, so a machine measures once per model
shape.

Elsewhere (an explicit dtype, a GPU, a CPU without native bf16) the rule of
``selfplay.hardware.resolve_dtype`` stands, and nothing is measured.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from selfplay.fileio import atomic_write
from selfplay.hardware import (
    ONEDNN_ISA_ENV,
    available_memory,
    cache_root,
    cpu_flags,
    cpu_has_native_bf16,
    cpu_name,
    resolve_dtype,
)

log = logging.getLogger(__name__)

CHOICES_FILE = "engine-dtype.json"
# environment variables that cap the instruction sets torch's CPU libraries use (a verdict
# measured under one cap does not hold under another: AMX or not changes the winner)
ISA_CAPS = (ONEDNN_ISA_ENV, "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")
# bf16 must be this much faster (time ratio) to be chosen: fp32 computes exactly what training
# scores, so a tie goes to it
MARGIN = 0.95
# the measured batch: rows, prompt tokens a row, tokens decoded a row; timed rounds per dtype.
# A round's decoding steps are a third or more of its time, as in a game's turns (whose prompts
# are mostly kept KV): on the AVX2 EPYC (2 cores) a fp32 round of SmolLM2-135M took 6.6 s.
ROWS, PROMPT, DECODE, ROUNDS = 16, 128, 24, 2
# the engine's paths in each dtype, counted: a verdict measured before they changed is measured
# again (2: the lean decoding step covers bf16 models; 3: a bf16 cache read by pair products on
# a CPU with AVX-512 BF16, in decoding and prefill, and the compiled sampler)
ENGINE_PATHS = 3
# the shape fields of a model's config that its speed depends on
SHAPE_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
)  # fmt: skip


def engine_dtype(
    requested: str | None, device: str, model_dir: str | Path, threads: int, build: Callable
) -> str:
    """The dtype the hf engine computes in: ``requested`` where it names one, the measured
    faster of fp32 and bf16 on a CPU with native bf16 (module docstring), else the machine rule.
    ``build(dtype)`` makes an hf engine of the model in that dtype (for the measurement)."""
    if requested not in (None, "auto") or device != "cpu" or not cpu_has_native_bf16():
        return resolve_dtype(requested, device)
    config = Path(model_dir) / "config.json"
    if not config.is_file() or not room_to_measure(Path(model_dir)):
        # a hub id (its shapes are not known before the load), or no memory for two more
        # copies of the model: the rule
        return resolve_dtype(requested, device)
    try:
        shapes = json.loads(config.read_text())
    except (OSError, ValueError):  # the load names what is wrong with the model
        return resolve_dtype(requested, device)
    key = choice_key(shapes, threads)
    path = choices_path()
    choices = read_choices(path)
    kept = choices.get(key)
    if isinstance(kept, dict) and kept.get("dtype") in ("fp32", "bf16"):
        return kept["dtype"]
    log.info("engine dtype auto: timing fp32 and bf16 once for this CPU and model shape")
    try:
        seconds = measure(build)
    except Exception as e:  # the measurement is a speed-up: if it cannot run, the rule decides
        rule = resolve_dtype(requested, device)
        log.warning("engine dtype auto: measuring failed (%s); %s by the flags", e, rule)
        return rule
    dtype = "bf16" if seconds["bf16"] < MARGIN * seconds["fp32"] else "fp32"
    log.info(
        "engine dtype auto: %s (a measured batch took fp32 %.2f s, bf16 %.2f s; kept in %s)",
        dtype, seconds["fp32"], seconds["bf16"], path,
    )  # fmt: skip
    choices[key] = {"dtype": dtype, "seconds": seconds, "measured": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, orjson.dumps(choices, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    except OSError as e:  # a read-only cache or a link there: run, measure again next time
        log.warning("engine dtype auto: the verdict is not kept (%s)", e)
    return dtype


def room_to_measure(model_dir: Path) -> bool:
    """Whether the measurement's two engines fit: the model in fp32 and in bf16 at once (3x
    its weights if they are stored in bf16) within half of the free memory."""
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    weights += sum(f.stat().st_size for f in model_dir.glob("*.bin"))
    free = available_memory("cpu")
    return free is None or 2 * 3 * weights <= free


def choices_path() -> Path:
    return cache_root() / CHOICES_FILE


def read_choices(path: Path) -> dict:
    """The kept verdicts; an unreadable file counts as none (it is measured and written again)."""
    try:
        choices = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return choices if isinstance(choices, dict) else {}


def choice_key(config: dict, threads: int) -> str:
    """What a verdict holds for: this CPU (its model name and instruction flags), its threads,
    torch's and transformers' versions, the engine's own paths (``ENGINE_PATHS``), the
    instruction-set caps in the environment, and the model's shapes (not its weights: speed does
    not depend on them)."""
    import torch
    import transformers

    text = config.get("text_config") or config
    shapes = {f: text.get(f) for f in SHAPE_FIELDS}
    parts = [cpu_name(), " ".join(sorted(cpu_flags())), str(threads)]
    # what else changes which kernels run: the libraries, and the instruction-set caps
    parts += [torch.__version__, transformers.__version__, f"engine paths {ENGINE_PATHS}"]
    parts += [os.environ.get(name, "") for name in ISA_CAPS]
    parts.append(orjson.dumps(shapes, option=orjson.OPT_SORT_KEYS).decode())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def measure(build: Callable) -> dict[str, float]:
    """Seconds of the least of ``ROUNDS`` timed runs of one batch (``ROWS`` prompts of ``PROMPT``
    tokens prefilled, then ``DECODE`` tokens decoded greedily) through an hf engine of the model
    in each dtype (``build(dtype)``), the dtypes in turn after a warm-up of each."""
    engines: dict = {}
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    try:
        engines.update((d, build(d)) for d in times)
        for round_ in range(ROUNDS + 1):
            for dtype, engine in engines.items():
                start = time.perf_counter()
                _batch(engine)
                if round_:  # the first round warms up
                    times[dtype].append(time.perf_counter() - start)
    finally:  # the engines hold themselves in cycles: free both models before the real load
        engine = None
        engines.clear()
        gc.collect()
    return {d: min(t) for d, t in times.items()}


def _batch(engine) -> None:
    """One batch through the engine's own prefill and decoding loop (no stop token: every row
    decodes ``DECODE`` tokens)."""
    import torch

    from selfplay.engines import GenerationRequest

    vocab = engine.model.config.get_text_config().vocab_size
    prompt = min(PROMPT, (engine.max_context or PROMPT + DECODE) - DECODE)
    g = torch.Generator().manual_seed(0)
    requests = [
        GenerationRequest(
            prompt_ids=torch.randint(3, vocab, (prompt,), generator=g).tolist(),
            max_new_tokens=DECODE,
            temperature=0.0,
            seed=0,
        )
        for _ in range(ROWS)
    ]
    got: list = []
    engine._run_batch(requests, [got.append] * len(requests))
    failed = [r for r in got if isinstance(r, BaseException)]
    if failed or len(got) != ROWS:
        raise RuntimeError(f"the dtype measurement's batch failed: {failed[:1] or got[:1]}")
