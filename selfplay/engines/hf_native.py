"""Small C kernels of the lean decoding step (``lean_step.c``), compiled at run time: its
attention, and its element-wise work.

At a decoding step's shapes (one query token a row, a few hundred KV positions) torch's CPU flash
kernel reads the KV cache at about 8 GB/s on the AVX2 EPYC, against 18-23 GB/s for a plain sum:
a task per (row, KV head) runs two tiny GEMMs of three query rows each. The kernel here streams
each row's keys and values once, a cache line ahead, scores the KV head's query group against
four keys at a time while they are in registers, and reads only the positions the row attends to
(runs of the mask, so padding and holes are skipped). The batch's shared prefix (the cascade's:
the same tokens in every row's first columns) it reads from row 0 for every row, so after the
first row it comes from the core's cache; that ran 1.02-1.06x faster in the stage's steps than
torch's flash kernel over the prefix once for all rows joined with the kernel's own part by
their log-sum-exps. It runs its (row, KV head) tasks on the OpenMP runtime torch has already
loaded, so its threads are torch's own.

The element-wise kernels do in one call what the step ran as several torch ops, each a pass over
memory and a dispatch: the residual add and RMSNorm (``add_rms_norm``), the MLP's SiLU of its
gate times its up projection (``silu_mul``), and the rotary embedding of q and k in place in the
fused q/k/v product (``rotary``).

It is built once a process with the machine's C compiler (``$CC``, else ``cc``) for the machine
it runs on (``-march=native``), in a temporary directory removed once loaded: nothing is written
anywhere else. It is used only where all of these hold, and torch's ops run otherwise:

- Linux, a compiler that builds it, and torch's OpenMP runtime is GNU's (the kernel's OpenMP
  calls must resolve to the copy torch loaded: a second runtime would bring a second pool of
  threads to the same cores), checked after loading;
- it agrees with torch on random inputs (1e-5): the flash kernel on a batch with padding and
  holes, the model's own norm, activation and rotary arithmetic;
- for the attention: fp32 queries over a fp32 or bf16 cache (a bf16 model's: each key and value
  widened to fp32 as it is read, every sum in fp32), head dim 64 or 128, at most 16 query heads
  a KV head, keys and values laid out with each position's head dims contiguous (the engine's
  cache).

On a CPU with AVX-512 BF16 the kernel reads a bf16 cache as it is, by pair products (VDPBF16PS:
32 bf16 products summed into fp32 an instruction, against 8 for a widened key's FMA): each
query split into two bf16 parts (about 2^-16 of it, against fp32's 2^-24) and the probabilities
rounded to bf16 for the values (as the output is, for the next product). Its check allows those
roundings and no more (``attention_slack``). On the AVX-512 BF16 EPYC a layer's attention at
57 rows over 284 shared and 160 own positions took 0.705 -> 0.408 ms cache-hot and 0.97 ->
0.76 ms with every layer's KV from memory; in the 64-game stage's steps, alternating with the
widening kernel, the attention 1.22x and the steps 1.08x.

On the AVX2 EPYC (2 threads, SmolLM2-135M, 470 KV positions, 240 of them a shared prefix read by
the cascade, whole decoding steps alternating in one process): a step's own-KV attention took
76.5 -> 35.1 ms at 64 rows and 35.0 -> 17.0 ms at 32 (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from selfplay.engines.hf_kernels import (
    BF16_FLAG,
    HEAD_DIMS,
    KV_DTYPES,
    MAX_GROUP,
    MAX_ROTARY_DIM,
    PrefillAttention,
    add_rms_norm,
    attention,
    copy_spans,
    decode_attention,
    mask_runs,
    rotary_cache,
    rotate,
    sample_rows,
    silu_mul,
)
from selfplay.engines.hf_kv import PreallocatedLayer

# what callers reach here: the kernels' Python faces (hf_kernels) and this module's own
__all__ = [
    "BF16_FLAG",
    "HEAD_DIMS",
    "KV_DTYPES",
    "MAX_GROUP",
    "MAX_ROTARY_DIM",
    "PrefillAttention",
    "add_rms_norm",
    "agrees",
    "attention",
    "attention_slack",
    "build",
    "copy_spans",
    "decode_attention",
    "kernel",
    "mask_runs",
    "prefill_attention",
    "rotary_cache",
    "rotate",
    "sample_rows",
    "sampling_reference",
    "silu_mul",
    "span_copy",
]

log = logging.getLogger(__name__)

# True: the lean decoding step's attention over each row's own KV runs the kernel where it was
# built and passed its check; read at call time, so a benchmark can alternate
NATIVE_ATTENTION = True
# True: a bf16 model's prefill passes attend by the kernel where it reads the cache by pair
# products (``prefill_attention``); read at call time
NATIVE_PREFILL = True
# True: a decoding step without top-p samples its rows by the kernel (``sample_rows``) where
# built; read at call time
NATIVE_SAMPLE = True
# True: the lean step's element-wise work runs the kernels where built; read at call time
NATIVE_ELEMENTWISE = True
# True: the KV cache's copies (a finished row's out, kept rows' into a batch) run the kernel's
# span copy where built (``span_copy``); read at call time
NATIVE_COPY = True
SOURCE = Path(__file__).with_name("lean_step.c")
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
        lib = Path(tmp) / "lean_step.so"
        try:
            done = subprocess.run(
                [cc, *FLAGS, str(SOURCE), "-o", str(lib), "-lm"],
                capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            return _off(f"{cc} failed: {e}")
        if done.returncode != 0:
            return _off(f"{cc} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        try:
            loaded = ctypes.CDLL(str(lib))  # mapped: the file can go
        except OSError as e:  # e.g. a temporary folder mounted noexec
            return _off(f"the built library does not load: {e}")
    if _loaded_openmp() != before:
        return _off("it brought a second OpenMP runtime (torch's is another)")
    p, i, f, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    for dim in HEAD_DIMS:
        for kv in KV_DTYPES.values():
            fn = getattr(loaded, f"attend{kv}_d{dim}")
            fn.argtypes = [p, n, p, p, p, i, p, p, i, i, i, n, n, f, p, n, i, p, p, i, i]
            fn.restype = ctypes.c_int
    loaded.add_rms_norm.argtypes = [p, p, i, p, f, p, i, i, i, n]
    loaded.silu_mul.argtypes = [p, p, i, i, i]
    loaded.rotary_cache.argtypes = [p, i, p, n, p, p, i, i, i, i, n, p, p, i, n, n, n]
    loaded.copy_spans.argtypes = [p, p, p, n, i]
    loaded.sample_rows.argtypes = [p, n, i, i, p, p, p, p, p, i]
    loaded.pair_products.argtypes = []
    loaded.pair_products.restype = ctypes.c_int
    for fn in (
        loaded.add_rms_norm,
        loaded.silu_mul,
        loaded.rotary_cache,
        loaded.copy_spans,
        loaded.sample_rows,
    ):
        fn.restype = None
    return loaded


def _off(reason: str) -> None:
    log.info("native lean-step kernels off: %s", reason)
    return None


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The kernel of this process, built once, where it builds and agrees with torch's flash
    kernel (``agrees``); None otherwise."""
    lib = build()
    if lib is None or not agrees(lib):
        return None
    return lib


def prefill_attention(dtype: torch.dtype) -> PrefillAttention | None:
    """A prefill pass's attention for a model of ``dtype`` where the kernel is faster than
    torch's flash kernel: a bf16 cache read by pair products (widening it, or a fp32 cache, the
    kernel takes about what the flash kernel does); None: SDPA."""
    lib = kernel() if NATIVE_PREFILL and dtype == torch.bfloat16 else None
    return PrefillAttention(lib) if lib is not None and lib.pair_products() else None


def span_copy() -> Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None:
    """The KV cache's span copy (``copy_spans`` on this process's kernels) for ``hf_kv``'s
    ``row_kv`` and ``padded_layers``, or None (they run torch's slice copies) where the kernels
    are off."""
    lib = kernel() if NATIVE_COPY else None
    return None if lib is None else functools.partial(copy_spans, lib)


def agrees(lib) -> bool:
    """Whether the kernels agree with torch on random inputs: the attention's output and
    log-sum-exp of torch's flash kernel on a batch (rows left-padded, one with a hole, in a
    cache with room past its positions, every head dim, a group of 1 and of 3, a fp32 and a bf16
    cache: the flash kernel reads the bf16 one widened to fp32), and over a shared prefix read
    from row 0 the cascade's (``hf_cpu.cascade_decode_attention``); the element-wise kernels of
    torch's ops (the fallbacks here, and the rotary embedding in transformers' rotate-half form,
    k and v written into the cache's next column), in fp32 and with bf16 inputs and outputs.
    Within 1e-5, a bf16 result within its rounding (one unit in its last place), and the pair
    products' attention within ``attention_slack``; the sampler's draws those of the inverse CDF
    of torch's softmax (``sampling_reference``)."""
    g = torch.Generator().manual_seed(0)
    if not (
        _attention_agrees(lib, g)
        and all(_elementwise_agrees(lib, g, dtype) for dtype in BF16_FLAG)
        and _sampling_agrees(lib, g)
    ):
        return False
    x = torch.randn(3, 40, generator=g)
    got = torch.full_like(x, 7.0)
    at = [t.data_ptr() + 4 * np.array([0, 50, 95]) for t in (x, got)]
    copy_spans(lib, at[0] * [1, 0, 1], at[1], 4 * np.array([30, 10, 25]))
    want = torch.full_like(x, 7.0).view(-1)
    want[:30], want[50:60], want[95:120] = x.view(-1)[:30], 0, x.view(-1)[95:120]
    if _off_by(got.view(-1), want):
        return _differs("copy_spans copies otherwise")
    return True


def _attention_agrees(lib, g: torch.Generator) -> bool:
    from selfplay.engines.hf_cpu import (
        SharedPrefix,
        additive_mask,
        cascade_decode_attention,
        grouped_flash,
    )

    for dim, cache, (heads, kv_heads) in itertools.product(HEAD_DIMS, KV_DTYPES, ((6, 2), (2, 2))):
        rows, length, prefix = 3, 37, 10
        q = torch.randn(rows, heads, 1, dim, generator=g)
        room = torch.randn(2, rows, kv_heads, length + 5, dim, generator=g).to(cache)
        room[:, :, :, :prefix] = room[:, :1, :, :prefix]  # every row's copy of the prefix
        keys, values = room[0, :, :, :length], room[1, :, :, :length]
        wide_keys, wide_values = keys.float(), values.float()  # what the kernel reads
        mask = torch.ones(rows, length, dtype=torch.bool)
        mask[1, :9] = False
        mask[2, 14:20] = False
        cut = additive_mask(mask[:, None, None], q.dtype)
        want = grouped_flash(q, wide_keys, wide_values, cut, 0.3)
        got = decode_attention(lib, q, keys, values, mask_runs(mask), 0.3)
        slack = attention_slack(lib, q, keys, values, mask, 0.3)
        if got is None or any(_off_by(a, b, s) for a, b, s in zip(got, want, slack)):
            return _differs(f"the attention ({cache} cache) differs from torch's flash kernel")
        wide = mask[:, None, None]
        shared = SharedPrefix(prefix)
        want = cascade_decode_attention(q, wide_keys, wide_values, wide, 0.3, shared)
        got = attention(lib, q, keys, values, mask_runs(mask[:, prefix:]), 0.3, prefix)
        mask[:, :prefix] = True  # every row attends to the prefix
        slack = attention_slack(lib, q, keys, values, mask, 0.3)[0]
        if got is None or _off_by(got, want[:, :, 0], slack):
            return _differs(f"the attention ({cache} cache) over a shared prefix differs")
    return True


def sampling_reference(logits, temps, u) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``sample_rows`` draws, in torch: the inverse CDF of softmax(logits / T) in
    vocabulary order at the draws ``u`` (greedy where T is 0: the first largest logit), and the
    log-softmax of the token drawn."""
    greedy = temps <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    cdf = torch.softmax(scaled, dim=-1).cumsum(-1)
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    tok = torch.where(greedy, logits.argmax(-1), tok.clamp(max=logits.shape[1] - 1))
    return tok, torch.log_softmax(scaled, dim=-1).gather(1, tok[:, None])[:, 0]


def _sampling_agrees(lib, g: torch.Generator) -> bool:
    logits = 4 * torch.randn(5, 1003, generator=g)  # 1003: past the last whole block of 8
    logits[1, ::3] = float("-inf")  # tokens ruled out
    temps, u = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0]), torch.rand(5, generator=g)
    got, want = sample_rows(lib, logits, temps, u), sampling_reference(logits, temps, u)
    if got is None or not torch.equal(got[0], want[0]) or _off_by(got[1], want[1]):
        return _differs("sample_rows draws otherwise than torch's inverse CDF")
    return True


def attention_slack(lib, query, key, value, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """How far ``decode_attention``'s output ``[B, H, D]`` and log-sum-exp ``[B, H]`` may be
    off the exact result (fp32 over the widened cache) for queries ``[B, H, 1, D]`` over keys
    and values ``[B, Hkv, L, D]`` at ``mask`` ``[B, L]`` (1: attend): 1e-5 for fp32 sums; where
    the kernel reads a bf16 cache by pair products (``lean_step.c``'s ``attend_task_dp``), also
    each score off by up to 2^-15 of its products' magnitudes (the query split into two bf16
    parts: 2^-16 of it, and the sums' order), so the log-sum-exp by up to the largest of those,
    and each probability rounded to bf16 (half a unit: 2^-9 of it), so the output by up to
    2^-8 of the probabilities times the values' magnitudes."""
    exact = torch.full((), 1e-5)
    if not (key.dtype == torch.bfloat16 and lib.pair_products()):
        return exact, exact
    group = query.shape[1] // key.shape[1]
    k, v = (x.float().repeat_interleave(group, dim=1) for x in (key, value))
    attend = mask[:, None, None, :]
    products = (scale * query.abs() @ k.abs().transpose(-1, -2)).masked_fill(~attend, 0)
    scores = (scale * query @ k.transpose(-1, -2)).masked_fill(~attend, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row attending to nothing: all 0
    out = exact + 2**-8 * (p @ v.abs())[:, :, 0]
    return out, exact + 2**-15 * products.amax(dim=-1)[:, :, 0]


def _elementwise_agrees(lib, g: torch.Generator, dtype: torch.dtype) -> bool:
    """The element-wise kernels against torch, their products' side in ``dtype``."""
    rows, hidden, inter, heads, kv_heads, dim = 5, 96, 52, 4, 2, 16  # 52: past the 8 lanes
    h, delta = torch.randn(2, rows, hidden, generator=g)
    delta = delta.to(dtype)
    weight = torch.randn(hidden, generator=g)
    want = add_rms_norm(None, h.clone(), delta, weight, 1e-6, dtype)
    if _off_by(add_rms_norm(lib, h.clone(), delta, weight, 1e-6, dtype), want):
        return _differs(f"add_rms_norm ({dtype}) differs from torch's")
    gate_up = (6 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)
    want = silu_mul(None, gate_up, inter)
    if _off_by(silu_mul(lib, gate_up, inter), want):
        return _differs(f"silu_mul ({dtype}) differs from torch's")
    x = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    angle = torch.rand(rows, dim // 2, generator=g) * 100
    cos, sin = (f(torch.cat([angle, angle], dim=1)) for f in (torch.cos, torch.sin))
    q, k, v = x.float().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    turned = [rotate(t.reshape(rows, -1, dim), cos[:, None], sin[:, None]) for t in (q, k)]
    layer = PreallocatedLayer(9)
    layer.update(*torch.randn(2, rows, kv_heads, 7, dim, generator=g).to(dtype))
    before = layer.keys.clone()
    got = rotary_cache(lib, x, cos, sin, heads, kv_heads, layer)
    if got is None or _off_by(got.reshape(rows, heads, dim), turned[0]):
        return _differs(f"the rotary embedding of q ({dtype}) differs from torch's")
    if (
        _off_by(layer.keys[:, :, :7], before)
        or _off_by(layer.keys[:, :, 7], turned[1].to(dtype))
        or _off_by(layer.values[:, :, 7], v.reshape(rows, kv_heads, dim).to(dtype))
    ):
        return _differs(f"k and v in the ({dtype}) cache differ from torch's")
    return True


def _off_by(got: torch.Tensor, want: torch.Tensor, slack: torch.Tensor | float = 1e-5) -> bool:
    """Whether ``got`` is off ``want`` by more than ``slack`` (1e-5: fp32), or by more than one
    unit in the last place besides (bf16: two results a hair apart in fp32 can round to
    neighbouring bf16 values)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return True
    if want.dtype == torch.bfloat16:
        slack = slack + want.float().abs() * 2**-7
    return bool(((got.float() - want.float()).abs() > slack).any())


def _differs(what: str) -> bool:
    log.info("native lean-step kernels off: %s", what)
    return False
