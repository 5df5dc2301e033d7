"""The compiled kernels' Python faces (``lean_step.c``, built and checked by ``hf_native``):
each takes the library, checks that the tensors it is handed are ones its kernel reads (dtype,
device, layout), and calls the kernel, or returns None (or does the work in torch) where they
are not, so the caller runs torch's ops. ``hf_native`` re-exports them.
"""

from __future__ import annotations

import numpy as np
import torch

from selfplay.engines.hf_kv import PreallocatedLayer

HEAD_DIMS = (64, 128)
MAX_GROUP = 16
# the KV caches the attention reads (widened to fp32 as it reads), and its kernels' name parts
KV_DTYPES = {torch.float32: "", torch.bfloat16: "_bf16"}
# the largest head dim rotary_cache takes (its buffer of one rotated key)
MAX_ROTARY_DIM = 256
# the dtypes the element-wise kernels read and write (1: bf16)
BF16_FLAG = {torch.float32: 0, torch.bfloat16: 1}


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


def _rows(x: torch.Tensor) -> bool:
    """Whether ``x`` is rows the element-wise kernels read: fp32 or bf16, 2-D, each row's
    features contiguous, in host memory."""
    return x.dtype in BF16_FLAG and x.dim() == 2 and x.stride(1) == 1 and x.device.type == "cpu"


def add_rms_norm(lib, h, delta, weight, eps, dtype=torch.float32):
    """``h += delta`` in place (fp32 ``h``; ``delta`` fp32 or bf16, None: nothing added), then
    RMSNorm of its rows times ``weight`` (fp32), computed in fp32: the new tensor, in ``dtype``
    (fp32, or bf16 for a bf16 model's products). torch's ops where ``lib`` is None or the
    layouts differ."""
    if (
        lib is not None
        and h.dtype == torch.float32
        and dtype in BF16_FLAG
        and _rows(h)
        and (delta is None or (_rows(delta) and delta.stride(0) == h.stride(0)))
        and h.stride(0) == h.shape[1]
    ):
        out = torch.empty_like(h, dtype=dtype)
        lib.add_rms_norm(
            h.data_ptr(), None if delta is None else delta.data_ptr(),
            0 if delta is None else BF16_FLAG[delta.dtype], weight.data_ptr(), eps, out.data_ptr(),
            BF16_FLAG[dtype], h.shape[0], h.shape[1], h.stride(0),
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
            gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter, BF16_FLAG[gate_up.dtype]
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
        or layer._keys.dtype not in BF16_FLAG
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
        x.data_ptr(), BF16_FLAG[x.dtype], q.data_ptr(), q.stride(0), cos.data_ptr(), sin.data_ptr(),
        rows, heads, kv_heads, dim, x.stride(0), keys.data_ptr(), values.data_ptr(),
        BF16_FLAG[keys.dtype], keys.stride(0), keys.stride(1), column,
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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[rows, heads, dim]`` at ``cos`` and ``sin`` ``[rows, 1, dim]``
    (transformers' rotate-half form): what ``rotary_cache``'s kernel computes, in torch."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
