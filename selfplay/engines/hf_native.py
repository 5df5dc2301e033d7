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

from selfplay.engines.hf_kv import PreallocatedLayer

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
HEAD_DIMS = (64, 128)
MAX_GROUP = 16
# the KV caches the attention reads (widened to fp32 as it reads), and its kernels' name parts
KV_DTYPES = {torch.float32: "", torch.bfloat16: "_bf16"}
# the largest head dim rotary_cache takes (its buffer of one rotated key)
MAX_ROTARY_DIM = 256
# the dtypes the element-wise kernels read and write (1: bf16)
_BF16 = {torch.float32: 0, torch.bfloat16: 1}
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


def decode_attention(lib, query, key, value, runs, scale, prefix: int = 0, per: int = 1):
    """Attention of one new token a row (``[B, H, 1, D]`` queries; rows may be strided, each row's
    heads contiguous: a view into the fused q/k/v product will do; fp32) over its keys and values
    ``[B, Hkv, L, D]`` (fp32, or bf16 read widened to fp32): the first ``prefix`` columns (the
    same tokens in every row: read from row 0) and the own columns after them at the positions
    ``runs`` (``mask_runs`` of the columns after the prefix) names, scores scaled by ``scale``
    (None: ``D ** -0.5``). The output ``[B, H, D]`` and its log-sum-exp ``[B, H]`` (as
    ``hf_cpu.grouped_flash`` returns them), or None where the kernel does not cover these
    tensors (the caller runs torch's kernels). ``per``: query rows a row of the cache (B = the
    cache's rows x per; ``PrefillAttention``'s)."""
    b, h, _, d = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = h // kv_heads
    if not (
        d in HEAD_DIMS
        and group <= MAX_GROUP
        and query.device.type == key.device.type == value.device.type == "cpu"
        and query.dtype == torch.float32
        and key.dtype == value.dtype in KV_DTYPES
        and query.stride(-1) == 1
        and query.stride(1) == d
        and key.stride() == value.stride()
        and key.stride(-1) == 1
        and key.stride(-2) == d
        and runs.shape[0] == b == key.shape[0] * per
        and 0 <= prefix <= length
    ):
        return None
    scale = d**-0.5 if scale is None else scale
    out = query.new_empty((b, kv_heads, group, d))
    lse = query.new_empty((b, kv_heads, group))
    threads = torch.get_num_threads()
    # each thread's: its scores, and (a bf16 cache's pair products) its probabilities in bf16 and
    # its positions' offsets (lean_step.c's attend_task_dp)
    scratch = query.new_empty((threads, (2 * group + 2) * (length + 8) + 256))
    own_k, own_v = key[:, :, prefix:], value[:, :, prefix:]
    status = getattr(lib, f"attend{KV_DTYPES[key.dtype]}_d{d}")(
        query.data_ptr(), query.stride(0), own_k.data_ptr(), own_v.data_ptr(), runs.data_ptr(),
        runs.shape[1], out.data_ptr(), lse.data_ptr(), b, kv_heads, group, key.stride(0),
        key.stride(1), scale, scratch.data_ptr(), scratch.stride(0), threads, key.data_ptr(),
        value.data_ptr(), prefix, per,
    )  # fmt: skip
    if status != 0:
        return None
    return out.view(b, h, d), lse.view(b, h)


def attention(lib, query, key, value, runs, scale, prefix: int = 0) -> torch.Tensor | None:
    """A lean decoding step's attention ``[B, H, D]`` by the kernel (``decode_attention``), or
    None where it does not cover these tensors."""
    got = decode_attention(lib, query, key, value, runs, scale, prefix)
    return None if got is None else got[0]


class PrefillAttention:
    """A prefill pass's attention by the kernel, each new token a query row of its own (its runs
    its row of the causal mask), the tokens of a row reading its keys and values in turn while
    they are in the core's cache: ``[B, H, n, D]`` queries over ``[B, Hkv, L, D]`` keys and
    values at SDPA's boolean mask ``[B, 1, n, L]`` (True: attend), out ``[B, n, H, D]`` in the
    queries' dtype, or None where the kernel does not cover these tensors (the caller runs SDPA).
    A padding token (its mask row empty) gets zeros. One object a pass: its layers share the
    mask, whose runs are found once.

    Used for a bf16 cache where the kernel reads it by pair products (``prefill_attention``):
    there a 64-row pass of 38 new tokens over 527 columns (the 64-game stage's) took 33 ms a
    layer by torch's flash kernel in bf16 (about 90 GFLOP/s)."""

    def __init__(self, lib) -> None:
        self.lib = lib
        self._runs: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def __call__(self, query, key, value, mask, scale) -> torch.Tensor | None:
        b, h, n, d = query.shape
        if mask is None or mask.dtype != torch.bool or mask.shape != (b, 1, n, key.shape[2]):
            return None
        if self._runs[0] is not mask:  # every layer of the pass gets the same mask tensor
            self._runs = (mask, mask_runs(mask.reshape(b * n, -1)))
        rows = query.transpose(1, 2).float().contiguous()  # [B, n, H, D]: a row a token
        got = decode_attention(
            self.lib, rows.view(b * n, h, 1, d), key, value, self._runs[1], scale, per=n
        )
        return None if got is None else got[0].view(b, n, h, d).to(query.dtype)


def prefill_attention(dtype: torch.dtype) -> PrefillAttention | None:
    """A prefill pass's attention for a model of ``dtype`` where the kernel is faster than
    torch's flash kernel: a bf16 cache read by pair products (widening it, or a fp32 cache, the
    kernel takes about what the flash kernel does); None: SDPA."""
    lib = kernel() if NATIVE_PREFILL and dtype == torch.bfloat16 else None
    return PrefillAttention(lib) if lib is not None and lib.pair_products() else None


def _rows(x: torch.Tensor) -> bool:
    """Whether ``x`` is rows the element-wise kernels read: fp32 or bf16, 2-D, each row's
    features contiguous, in host memory."""
    return x.dtype in _BF16 and x.dim() == 2 and x.stride(1) == 1 and x.device.type == "cpu"


def add_rms_norm(lib, h, delta, weight, eps, dtype=torch.float32):
    """``h += delta`` in place (fp32 ``h``; ``delta`` fp32 or bf16, None: nothing added), then
    RMSNorm of its rows times ``weight`` (fp32), computed in fp32: the new tensor, in ``dtype``
    (fp32, or bf16 for a bf16 model's products). torch's ops where ``lib`` is None or the
    layouts differ."""
    if (
        lib is not None
        and h.dtype == torch.float32
        and dtype in _BF16
        and _rows(h)
        and (delta is None or (_rows(delta) and delta.stride(0) == h.stride(0)))
        and h.stride(0) == h.shape[1]
    ):
        out = torch.empty_like(h, dtype=dtype)
        lib.add_rms_norm(
            h.data_ptr(), None if delta is None else delta.data_ptr(),
            0 if delta is None else _BF16[delta.dtype], weight.data_ptr(), eps, out.data_ptr(),
            _BF16[dtype], h.shape[0], h.shape[1], h.stride(0),
        )  # fmt: skip
        return out
    if delta is not None:
        h += delta
    return (weight * (h * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + eps))).to(dtype)


def silu_mul(lib, gate_up, inter):
    """``silu(gate) * up`` of each row ``[gate | up]`` of ``gate_up`` (``inter`` features each;
    fp32 or bf16, computed in fp32, returned in its dtype): the kernel where ``lib`` is there,
    else torch's ops."""
    if lib is not None and _rows(gate_up) and gate_up.is_contiguous():
        out = gate_up.new_empty((gate_up.shape[0], inter))
        lib.silu_mul(
            gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter, _BF16[gate_up.dtype]
        )
        return out
    gate, up = gate_up.float().split(inter, dim=1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def rotary_cache(lib, x, cos, sin, heads, kv_heads, layer) -> torch.Tensor | None:
    """The rotary embedding (rotate-half form, at ``cos`` and ``sin`` ``[rows, dim]``, fp32) of
    each row of the fused q/k/v product ``x`` (fp32 or bf16): k rotated into the cache
    ``layer``'s next column (a ``PreallocatedLayer`` of fp32 or bf16, grown by one) and v copied
    there; the rotated q ``[rows, heads x dim]`` returned in fp32 (a view of ``x``, rotated in
    place, where ``x`` is fp32). None (nothing done: the caller rotates and updates the cache)
    where ``lib`` is None or the layouts differ."""
    if (
        lib is None
        or not isinstance(layer, PreallocatedLayer)
        or layer._keys is None
        or not (_rows(x) and cos.is_contiguous() and sin.is_contiguous())
        or cos.dtype != torch.float32
        or not (layer._keys.is_contiguous() and layer._values.is_contiguous())
        or layer._keys.dtype not in _BF16
        or layer._keys.shape[0] != x.shape[0]
        or layer._keys.shape[-1] > MAX_ROTARY_DIM
    ):
        return None
    keys, values, column = layer.grow(1)
    rows, dim = x.shape[0], keys.shape[-1]
    q = x[:, : heads * dim]
    if x.dtype != torch.float32:
        q = torch.empty((rows, heads * dim), dtype=torch.float32)
    lib.rotary_cache(
        x.data_ptr(), _BF16[x.dtype], q.data_ptr(), q.stride(0), cos.data_ptr(), sin.data_ptr(),
        rows, heads, kv_heads, dim, x.stride(0), keys.data_ptr(), values.data_ptr(),
        _BF16[keys.dtype], keys.stride(0), keys.stride(1), column,
    )  # fmt: skip
    return q


def copy_spans(lib, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
    """Copy ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` (zero them where ``src[i]``
    is 0), every span at once on torch's threads."""
    src, dst, nbytes = (np.ascontiguousarray(x, dtype=np.int64) for x in (src, dst, nbytes))
    lib.copy_spans(
        src.ctypes.data, dst.ctypes.data, nbytes.ctypes.data, len(src), torch.get_num_threads()
    )


def sample_rows(lib, logits, temps, u) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decoding step's draws in one pass a row where torch's sampler makes several over the
    ``[rows, vocab]`` fp32 logits (``hf_decode._sample`` without top-p: the same inverse CDF
    in vocabulary order, temperature ``temps`` (0: greedy), uniform draws ``u``): the tokens and
    their log-softmax at the temperature, or None where the kernel does not cover these tensors
    (the caller runs torch's)."""
    rows, vocab = logits.shape
    if not (
        logits.dtype == temps.dtype == u.dtype == torch.float32
        and logits.device.type == temps.device.type == u.device.type == "cpu"
        and logits.stride(-1) == 1
        and temps.is_contiguous()
        and u.is_contiguous()
        and temps.shape == u.shape == (rows,)
        and 0 < vocab < 2**31
    ):
        return None
    tok = torch.empty(rows, dtype=torch.long)
    lp = torch.empty(rows)
    threads = torch.get_num_threads()
    weights = torch.empty(threads, vocab + 8)  # each thread's row of weights
    lib.sample_rows(
        logits.data_ptr(), logits.stride(0), rows, vocab, temps.data_ptr(), u.data_ptr(),
        tok.data_ptr(), lp.data_ptr(), weights.data_ptr(), threads,
    )  # fmt: skip
    return tok, lp


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
        and all(_elementwise_agrees(lib, g, dtype) for dtype in _BF16)
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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[rows, heads, dim]`` at ``cos`` and ``sin`` ``[rows, 1, dim]``
    (transformers' rotate-half form): what ``rotary_cache``'s kernel computes, in torch."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


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
