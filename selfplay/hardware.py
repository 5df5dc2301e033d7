"""The compute dtype a machine runs fastest: bf16 where it is native, fp32 otherwise.

The rule for the trainer (``--dtype auto``) and the hf engine (``dtype="auto"``):
- a CUDA device: bf16 when the GPU supports it (every GPU since Ampere), else fp32;
- a CPU: bf16 only when the processor has native bf16 instructions (``avx512_bf16`` or
  ``amx_bf16`` among its flags, as on Intel Sapphire Rapids and AMD Zen 4 or newer), fp32
  otherwise. Measured on 2 cores: with AMX, SmolLM2-135M generates 2.1x faster in bf16 than
  fp32 and trains 1.5x faster; on an AVX2-only CPU, bf16 matmul emulated in software runs at
  1-18 GFLOP/s against 100-130 in fp32, and one SFT step took over 300 s against 20 s.

On a CPU with native bf16 the hf engine does not take the flags' word for it: its fast decoding
path is fp32, and generation there ran 1.2-1.65x faster in fp32 on one AVX-512 BF16 CPU, so it
measures both dtypes once per CPU and model shape and keeps the faster
(``selfplay.engines.hf_dtype``).

The probe also reads oneDNN's instruction-set cap (``ONEDNN_MAX_CPU_ISA``, the library torch
computes bf16 matmuls with on CPU): a cap below AVX512_CORE_BF16 leaves bf16 emulated, so the
rule picks fp32. With ``ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
ATEN_CPU_CAPABILITY=avx2`` a native-bf16 machine computes as an AVX2-only one does
(README, "The two commands": `make demo` timed that way).

``SELFPLAY_NATIVE_BF16=1`` or ``=0`` overrides the CPU probe (tests pin fp32 with it so that
every machine computes the same numbers); an explicit dtype always wins over the rule.
This module imports nothing of the package and no torch at import time (the CLI starts
torch-free).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

Dtype = Literal["fp32", "bf16"]
# torch's names and None (what older runs stored for the rule) read as the short names
_ALIASES = {None: "auto", "float32": "fp32", "bfloat16": "bf16"}
ComputeDtype = Annotated[
    Literal["auto", "fp32", "bf16"],
    BeforeValidator(lambda v: _ALIASES.get(v, v)),
    Field(
        description="Compute dtype: auto (bf16 where the device computes it natively: a GPU, "
        "or a CPU with AVX-512 BF16 or AMX; fp32 otherwise), fp32 or bf16."
    ),
]
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"
# oneDNN's ISA names (its docs, "CPU ISA hints") whose cap leaves native bf16 matmul in place
ONEDNN_BF16_ISAS = frozenset(
    {"ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16"}
)
OVERRIDE_ENV = "SELFPLAY_NATIVE_BF16"
CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo(keys: tuple[str, ...]) -> str | None:
    """The value of the first ``/proc/cpuinfo`` line whose key is one of ``keys`` (None: no
    such line, or no such file)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value.strip()
    return None


def cpu_flags() -> frozenset[str]:
    """The processor's feature flags (Linux ``/proc/cpuinfo``; empty where there is none)."""
    return frozenset((_cpuinfo(("flags", "Features")) or "").split())


def cpu_name() -> str:
    """The processor's model name, as ``lscpu`` shows it ("unknown" where it is not said)."""
    return _cpuinfo(("model name",)) or "unknown"


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 in hardware (see the module docstring); the environment
    variable SELFPLAY_NATIVE_BF16 (1 or 0), when set, answers instead of the probe."""
    forced = os.environ.get(OVERRIDE_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    cap = (os.environ.get(ONEDNN_ISA_ENV) or "ALL").strip().upper()
    return bool(cpu_flags() & NATIVE_BF16_FLAGS) and cap in ONEDNN_BF16_ISAS


def native_bf16(device: str) -> bool:
    """Whether ``device`` (cpu, cuda, cuda:1, ...) computes bf16 natively."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return cpu_has_native_bf16()


def resolve_dtype(requested: str | None, device: str) -> Dtype:
    """The dtype to compute in: ``requested`` when it names one (fp32, bf16), else (auto)
    the machine's rule."""
    requested = _ALIASES.get(requested, requested)
    if requested == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    if requested not in ("fp32", "bf16"):
        raise ValueError(f"unknown dtype {requested!r}: auto, fp32 or bf16")
    return requested  # type: ignore[return-value]


def cache_root() -> Path:
    """Where this machine keeps what selfplay prepares once (the embedded model converted to
    safetensors, the engine's measured dtype): $SELFPLAY_CACHE, else ~/.cache/selfplay."""
    return Path(os.environ.get("SELFPLAY_CACHE", Path.home() / ".cache" / "selfplay"))


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def available_memory(device: str) -> int | None:
    """Bytes free for new tensors on ``device`` (a GPU's free memory; on CPU the kernel's
    MemAvailable), None when this machine does not say."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
