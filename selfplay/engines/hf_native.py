"""A decoding step's attention as a small C kernel (``decode_attention.c``), compiled at run time.

At a decoding step's shapes (one query token a row, a few hundred KV positions) torch's CPU flash
kernel reads the KV cache at about 8 GB/s on the AVX2 EPYC, against 18-23 GB/s for a plain sum:
a task per (row, KV head) runs two tiny GEMMs of three query rows each. The kernel here streams
each row's keys and values once, a cache line ahead, scores the KV head's query group against
each key while it is in registers, and reads only the positions the row attends to (runs of the
mask, so padding and holes are skipped). It runs its (row, KV head) tasks on the OpenMP runtime
torch has already loaded, so its threads are torch's own.

It is built once a process with the machine's C compiler (``$CC``, else ``cc``) for the machine
it runs on (``-march=native``), in a temporary directory removed once loaded: nothing is written
anywhere else. It is used only where all of these hold, and torch's flash kernel runs otherwise:

- Linux, a compiler that builds it, and torch's OpenMP runtime is GNU's (the kernel's OpenMP
  calls must resolve to the copy torch loaded: a second runtime would bring a second pool of
  threads to the same cores), checked after loading;
- it agrees with torch's flash kernel on a random batch with padding and holes (1e-5);
- fp32, head dim 64 or 128, at most 16 query heads a KV head, keys and values laid out with
  each position's head dims contiguous (the engine's cache).

On the AVX2 EPYC (2 threads, SmolLM2-135M, 470 KV positions, 240 of them a shared prefix read by
the cascade, whole decoding steps alternating in one process): a step's own-KV attention took
76.5 -> 35.1 ms at 64 rows and 35.0 -> 17.0 ms at 32 (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# True: the lean decoding step's attention over each row's own KV runs the kernel where it was
# built and passed its check; read at call time, so a benchmark can alternate
NATIVE_ATTENTION = True
SOURCE = Path(__file__).with_name("decode_attention.c")
HEAD_DIMS = (64, 128)
MAX_GROUP = 16
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120


def _loaded_openmp() -> set[str]:
    """Paths of the OpenMP runtimes (GNU's ``libgomp``) mapped into this process."""
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if "libgomp" in line}


def build(compiler: str | None = None) -> ctypes.CDLL | None:
    """Compile and load the kernel (None where it cannot be used here: the reason is logged).
    ``compiler``: the C compiler (default ``$CC``, else ``cc``)."""
    if not sys.platform.startswith("linux"):
        return _off(f"not Linux ({sys.platform})")
    before = _loaded_openmp()
    if not before:
        return _off("torch has not loaded GNU's OpenMP runtime")
    cc = compiler or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return _off(f"no C compiler ({cc!r} not found)")
    with tempfile.TemporaryDirectory(prefix="selfplay-native-") as tmp:
        lib = Path(tmp) / "decode_attention.so"
        try:
            done = subprocess.run(
                [cc, *FLAGS, str(SOURCE), "-o", str(lib), "-lm"],
                capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            return _off(f"{cc} failed: {e}")
        if done.returncode != 0:
            return _off(f"{cc} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        loaded = ctypes.CDLL(str(lib))  # mapped: the file can go
    if _loaded_openmp() != before:
        return _off("it brought a second OpenMP runtime (torch's is another)")
    args = [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3
    args += [ctypes.c_long] * 2 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    for dim in HEAD_DIMS:
        fn = getattr(loaded, f"attend_d{dim}")
        fn.argtypes, fn.restype = args, ctypes.c_int
    return loaded


def _off(reason: str) -> None:
    log.info("native decode attention off: %s", reason)
    return None


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The kernel of this process, built once, where it builds and agrees with torch's flash
    kernel (``agrees``); None otherwise."""
    lib = build()
    if lib is None or not agrees(lib):
        return None
    return lib


def mask_runs(mask: torch.Tensor) -> torch.Tensor:
    """The ``[start, end)`` runs of each row's 1s in ``mask`` ``[B, L]`` (1/True: attend), as
    int32 ``[B, R, 2]``, R the most runs of a row (a row's unused runs are empty)."""
    b = mask.shape[0]
    on = mask.to(torch.int8)
    edge = on.new_zeros((b, 1))
    steps = torch.diff(on, prepend=edge, append=edge)
    rows, starts = (steps == 1).nonzero(as_tuple=True)
    ends = (steps == -1).nonzero(as_tuple=True)[1]  # row-major, as the starts: they pair up
    counts = torch.bincount(rows, minlength=b)
    runs = torch.zeros((b, max(1, int(counts.max()) if b else 1), 2), dtype=torch.int32)
    slot = torch.arange(len(rows)) - (counts.cumsum(0) - counts).repeat_interleave(counts)
    runs[rows, slot, 0] = starts.to(torch.int32)
    runs[rows, slot, 1] = ends.to(torch.int32)
    return runs


def decode_attention(lib, query, key, value, runs, scale):
    """Attention of one new token a row (``[B, H, 1, D]`` queries) over its own keys and values
    ``[B, Hkv, L, D]`` at the positions ``runs`` (``mask_runs``) names, scores scaled by
    ``scale`` (None: ``D ** -0.5``): the output ``[B, H, D]`` and its log-sum-exp ``[B, H]`` (as
    ``hf_cpu.grouped_flash`` returns them), or None where the kernel does not cover these tensors
    (the caller runs the flash kernel)."""
    b, h, _, d = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = h // kv_heads
    if not (
        d in HEAD_DIMS
        and group <= MAX_GROUP
        and query.dtype == key.dtype == value.dtype == torch.float32
        and key.stride() == value.stride()
        and key.stride(-1) == 1
        and key.stride(-2) == d
        and runs.shape[0] == b
    ):
        return None
    scale = d**-0.5 if scale is None else scale
    query = query.contiguous()
    out = query.new_empty((b, kv_heads, group, d))
    lse = query.new_empty((b, kv_heads, group))
    threads = torch.get_num_threads()
    scratch = query.new_empty((threads, group * (length + 8)))
    status = getattr(lib, f"attend_d{d}")(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), runs.data_ptr(), runs.shape[1],
        out.data_ptr(), lse.data_ptr(), b, kv_heads, group, key.stride(0), key.stride(1),
        scale, scratch.data_ptr(), scratch.stride(0), threads,
    )  # fmt: skip
    if status != 0:
        return None
    return out.view(b, h, d), lse.view(b, h)


def agrees(lib) -> bool:
    """Whether the kernel's output and log-sum-exp are within 1e-5 of torch's flash kernel on a
    random batch: rows left-padded, one with a hole, in a cache with room past its positions,
    every head dim and a group of 1 and of 3."""
    from selfplay.engines.hf_cpu import additive_mask, grouped_flash

    g = torch.Generator().manual_seed(0)
    for dim in HEAD_DIMS:
        for heads, kv_heads in ((6, 2), (2, 2)):
            rows, length = 3, 37
            q = torch.randn(rows, heads, 1, dim, generator=g)
            room = torch.randn(2, rows, kv_heads, length + 5, dim, generator=g)
            keys, values = room[0, :, :, :length], room[1, :, :, :length]
            mask = torch.ones(rows, length, dtype=torch.bool)
            mask[1, :9] = False
            mask[2, 4:20] = False
            want = grouped_flash(q, keys, values, additive_mask(mask[:, None, None], q.dtype), 0.3)
            got = decode_attention(lib, q, keys, values, mask_runs(mask), 0.3)
            if got is None or any((a - b).abs().max() > 1e-5 for a, b in zip(got, want)):
                log.info("native decode attention off: it differs from torch's flash kernel")
                return False
    return True
