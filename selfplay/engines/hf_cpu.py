"""CPU layouts for the HF engine: attention that never copies KV heads (a decoding step's
attention as one product per KV head over its group of query heads), a decoding step's attention
over the batch's shared prefix read once for all rows (cascade), linear layers computed
weight-major for a decoding step's few rows, and sibling projections (q, k, v; gate, up) as one
product each.

They change how a product is laid out, not what it is: results agree with transformers' own
layers to float rounding. The engine installs them on CPU only.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

# True: a decoding step's attention (one query token a row) runs as ``grouped_decode_attention``;
# False: torch's SDPA for every pass. Read at call time, so a benchmark can alternate the two
# (benchmarks/bench_decode_attention.py, bench_roofline.py --decode-attention). Off: on the
# 2-core AVX2 EPYC, quiet, it was no faster than SDPA (attention alone 124 vs 119 ms, whole
# decoding steps 307 vs 308 ms at 48 rows x 470 KV positions); turn it on where an A/B finds it
# faster.
GROUPED_DECODE = False


def grouped_decode_attention(query, key, value, mask=None, scale=None):
    """Attention of one new token a row over its KV cache, every KV head read once for the query
    heads that share it: ``[B, H, 1, D]`` queries over ``[B, Hkv, L, D]`` keys and values.

    Query head ``h`` uses KV head ``h // (H / Hkv)`` (transformers' ``repeat_kv`` order), so the
    queries reshape to ``[B, Hkv, G, D]`` without a copy and the scores are one product per
    (row, KV head), ``[G, D] @ [D, L]``, the probabilities another over the values: the KV cache
    streams through once per step, never expanded to ``H`` heads. ``mask`` is SDPA's: None,
    boolean (True: attend) or additive, shaped ``[B, 1 or H, 1, L]``. The softmax is in fp32.
    Every row must see at least one position (a decoding row sees its own token).
    """
    b, h, _, d = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = h // kv_heads
    scale = d**-0.5 if scale is None else scale
    q = (query * scale).view(b, kv_heads, group, d)
    scores = torch.matmul(q, key.transpose(-1, -2)).float()  # [B, Hkv, G, L]
    if mask is not None:
        mask = mask.reshape(b, kv_heads, group, length) if mask.shape[1] > 1 else mask
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores += mask
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(probs, value).view(b, h, 1, d)


# True: a decoding step whose batch shares a prefix (``SharedPrefix``) attends to it as
# ``cascade_decode_attention``; read at call time, so a benchmark can alternate.
CASCADE = True
# Shorter shared prefixes are attended to with the rest: a second attention call per layer costs
# about what reading this many more positions a row does.
MIN_CASCADE_PREFIX = 64

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class SharedPrefix:
    """What a decoding step's model call passes its attention (the keyword argument
    ``SHARED_PREFIX``): the batch's first ``length`` KV columns hold the same tokens in every row
    (the engine lays its batches out so), so attention reads them once, from row 0. ``seen``
    counts the layers whose attention got it, so the engine can tell a model that does not hand
    its keyword arguments down to attention (``passes_shared_prefix``)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.seen = 0
        self._mask: tuple = (None, None)  # (the step's boolean mask, its additive cut): one a step


SHARED_PREFIX = "selfplay_shared_prefix"
# the keyword argument of a prefill pass's model call that carries its attention kernel
# (``hf_native.PrefillAttention``: called as ``(query, key, value, mask, scale)``, it returns the
# output ``[B, n, H, D]`` or None, and then SDPA runs)
PREFILL_KERNEL = "selfplay_prefill_kernel"


def passes_shared_prefix(model) -> bool:
    """Whether every attention layer of ``model`` gets a ``SharedPrefix`` passed to the model
    call (its attention must be ``grouped_sdpa``'s): a one-token forward pass counts them. A
    model that does not would attend to every row's own copy of the prefix: the same result, no
    saving, so the engine keeps its usual layout for it."""
    probe = SharedPrefix(0)
    try:
        with torch.inference_mode():
            model(input_ids=torch.zeros((1, 1), dtype=torch.long), **{SHARED_PREFIX: probe})
    except TypeError:  # a model whose forward takes no such keyword
        return False
    layers = model.config.get_text_config().num_hidden_layers
    return probe.seen == layers


def cascade_decode_attention(query, key, value, mask, scale, shared: SharedPrefix):
    """Attention of one new token a row over its KV cache when the first ``shared.length``
    columns of every row hold the same tokens: those are attended to once for all rows (every
    row's query heads as one sequence of queries over row 0's prefix: a product rather than one
    per row), the rest per row, and the two merged by their log-sum-exps. ``[B, H, 1, D]``
    queries over ``[B, Hkv, L, D]`` keys and values (GQA read per KV head by torch's CPU flash
    kernel); ``mask`` is SDPA's boolean mask ``[B, 1, 1, L]`` (True: attend) or None. Exact up to
    float rounding: the softmax over the two parts is split and rejoined, not changed."""
    b, h, _, d = query.shape
    p = shared.length
    if query.stride(-1) != 1:  # torch's CPU flash kernel reads a head's dims as contiguous
        query = query.contiguous()
    shared_q = query.transpose(0, 2)  # [1, H, B, D]: every row's query over the one prefix
    o_shared, lse_shared = _flash(shared_q, key[:1, :, :p], value[:1, :, :p], scale=scale)
    cut = None
    if mask is not None:
        if shared._mask[0] is not mask:  # every layer of a step gets the same mask tensor
            shared._mask = (mask, additive_mask(mask[..., p:], query.dtype))
        cut = shared._mask[1]
    o_own, lse_own = grouped_flash(query, key[:, :, p:], value[:, :, p:], cut, scale)
    o_shared = o_shared[0].transpose(0, 1)  # [B, H, D]
    weight = torch.sigmoid(lse_shared[0].transpose(0, 1) - lse_own)[..., None]
    out = o_own + weight * (o_shared - o_own)
    return out.to(query.dtype).view(b, h, 1, d)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's mask as the flash kernel takes it: boolean (True: attend) -> 0 / -inf in
    ``dtype``; an additive mask is only cast."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


def grouped_flash(query, key, value, mask, scale):
    """Attention of one new token a row over its own KV by torch's CPU flash kernel, a KV head's
    group of query heads passed as that head's query length: ``[B, H, 1, D]`` queries over
    ``[B, Hkv, L, D]`` keys and values; ``mask`` additive ``[B, 1, 1, L]`` or None. Returns the
    output ``[B, H, D]`` and its log-sum-exp ``[B, H]``.

    The kernel runs a task per (row, head, query block), and at one query a task its per-task
    cost outweighs reading the KV: with the group as the query length it runs a task per (row,
    KV head). Query head ``h`` uses KV head ``h // (H / Hkv)`` (transformers' order), so the
    grouping is a view. On the AVX2 EPYC (2 threads, SmolLM2-135M's shapes, 56 rows over 230
    own positions after a 240-column shared prefix) a step's cascade attention over 30 layers
    took 108 -> 89 ms with it (benchmarks/bench_decode_attention.py)."""
    b, h, _, d = query.shape
    kv_heads = key.shape[1]
    if query.stride(-1) != 1:  # the kernel reads a head's dims as contiguous
        query = query.contiguous()
    grouped = query.view(b, kv_heads, h // kv_heads, d)
    out, lse = _flash(grouped, key, value, attn_mask=mask, scale=scale)
    return out.reshape(b, h, d), lse.reshape(b, h)


# the attention implementation's name that grouped_sdpa registers
GROUPED_SDPA = "selfplay_grouped_sdpa"


def grouped_sdpa() -> str:
    """Register and name SDPA attention that never copies KV heads for query groups.

    transformers' SDPA repeats each KV head for its query group whenever there is a padding
    mask (torch's CUDA kernels cannot combine GQA with a mask), which on CPU copies the whole KV
    cache at every decoding step of a padded batch. torch's CPU kernels take ``enable_gqa`` with a
    mask: a decoding step of 32 rows over 500 tokens took 2.0 ms instead of 5-6 ms on the tiny
    test model and 262 ms instead of 460 ms with SmolLM2-135M's shapes (one thread). A decoding
    step (one query a row, no dropout) goes to ``grouped_decode_attention`` where
    ``GROUPED_DECODE`` says so.
    """

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        shared = kw.get(SHARED_PREFIX)
        if shared is not None:
            shared.seen += 1
        if (
            CASCADE
            and shared is not None
            and shared.length >= MIN_CASCADE_PREFIX
            and query.shape[2] == 1
            and not dropout
        ):
            out = cascade_decode_attention(query, key, value, attention_mask, scaling, shared)
            return out.transpose(1, 2).contiguous(), None
        if GROUPED_DECODE and query.shape[2] == 1 and not dropout:
            out = grouped_decode_attention(query, key, value, attention_mask, scaling)
            return out.transpose(1, 2).contiguous(), None
        kernel = kw.get(PREFILL_KERNEL)
        if kernel is not None and query.shape[2] > 1 and not dropout:
            out = kernel(query, key, value, attention_mask, scaling)
            if out is not None:
                return out, None
        causal = kw.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            is_causal=query.shape[2] > 1 and attention_mask is None and causal,
            enable_gqa=True,
        )
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(GROUPED_SDPA, attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    return GROUPED_SDPA


# Up to this many rows a CPU linear layer runs as weight @ input^T (see weight_major_linears).
WEIGHT_MAJOR_MAX_ROWS = 512


def weight_major_rows(x: torch.Tensor) -> int:
    """The rows of ``x`` when a linear layer over it runs weight-major (fp32, 1 to
    ``WEIGHT_MAJOR_MAX_ROWS`` rows, the bound read at call time); 0: ``F.linear``."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return rows if x.dtype == torch.float32 and 0 < rows <= WEIGHT_MAJOR_MAX_ROWS else 0


# True: a prefill's linear layers compute its real tokens alone (``real_tokens``); read at call
# time, so a benchmark can alternate.
PACKED_PREFILL = True
# the flat indices of the real tokens of the padded batch a prefill's pass is feeding, and that
# batch's positions (rows x width), for the thread running it (``real_tokens``)
_REAL: contextvars.ContextVar[tuple[torch.Tensor, int] | None] = contextvars.ContextVar(
    "selfplay_real_tokens", default=None
)


@contextlib.contextmanager
def real_tokens(attn_new: torch.Tensor):
    """For the span of one padded prefill pass, whose new tokens' mask is ``attn_new`` ``[rows,
    width]`` (0: padding): the model's linear layers compute the real tokens alone, and a padded
    position's output is zeros. A padded position is masked out of every real token's attention,
    so nothing it holds reaches one; its zeros stay finite through the norms. Without padding,
    with ``PACKED_PREFILL`` off, or off the CPU (only the CPU's linear layers read it, and a GPU
    would wait on the mask), nothing changes."""
    flat = attn_new.reshape(-1).bool()
    real = None
    if PACKED_PREFILL and flat.device.type == "cpu" and not bool(flat.all()):
        real = (flat.nonzero()[:, 0], flat.numel())
    token = _REAL.set(real)
    try:
        yield
    finally:
        _REAL.reset(token)


def _real_index(x: torch.Tensor) -> torch.Tensor | None:
    """The real tokens' flat indices where ``x`` is the padded batch of the pass ``real_tokens``
    set (its positions match); None otherwise (a decoding step, the head's last positions)."""
    real = _REAL.get()
    if real is None or not x.dim() or x.numel() // x.shape[-1] != real[1]:
        return None
    return real[0]


def _scattered(y: torch.Tensor, index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The real tokens' outputs ``y`` ``[real, features]`` at their places in ``x``'s padded
    batch, zeros elsewhere: ``[*x.shape[:-1], features]``."""
    out = y.new_zeros((x.numel() // x.shape[-1], y.shape[-1]))
    out[index] = y
    return out.view(*x.shape[:-1], y.shape[-1])


def _as_linear(product: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``W @ x^T`` (outputs x rows) laid out as ``F.linear(x, W, bias)`` returns it."""
    y = product.t().contiguous()
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], y.shape[-1])


def weight_major_linears(model) -> None:
    """Make the model's fp32 linear layers compute ``(W @ x^T)^T`` for up to
    ``WEIGHT_MAJOR_MAX_ROWS`` rows (a decoding step's rows, a prefill's last tokens).

    ``F.linear`` asks MKL for ``x @ W^T``; the product laid out as ``W @ x^T`` made a whole
    decoding step faster on the AVX2 EPYC (SmolLM2-135M, 64 rows over ~470 KV positions, 2
    threads, the layouts alternating step by step: 518 -> 459 ms, benchmarks/bench_generate.py
    part g; the 64 games of `bench_roofline.py --stages`' generate: 145 and 159 s -> 138 and 138
    s). Isolated at one shape with its weights out of cache, neither layout was clearly faster.
    Same product, other summation order: results agree to float rounding. Other dtypes, and
    more rows (a long prefill, where both layouts ran alike), keep ``F.linear``.
    """

    def forward(self, x):
        index = _real_index(x)
        if index is not None:  # a padded prefill: its real tokens alone
            return _scattered(forward(self, x.reshape(-1, x.shape[-1])[index]), index, x)
        rows = weight_major_rows(x)
        if not rows:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return _as_linear(torch.mm(self.weight, x.reshape(rows, -1).t()), self.bias, x)

    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32:
            module.forward = forward.__get__(module)


# True: sibling projections (see fuse_projections) run as one product; read at call time, so a
# benchmark can alternate (benchmarks/bench_decode_attention.py).
FUSED_PROJECTIONS = True

# Linear layers of one module that take the same input: one product computes them all.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# the module attribute that keeps each fused group's stacked (weight, bias), by SIBLINGS entry
FUSED = "_selfplay_fused"


def fuse_projections(model) -> None:
    """Compute each layer's q, k and v projections as one product, and its gate and up
    projections as another, for up to ``WEIGHT_MAJOR_MAX_ROWS`` fp32 rows.

    The siblings take the same input one after the other, so one product over their stacked
    weights (``W @ x^T``, as ``weight_major_linears``) replaces three or two small ones: the
    input is read once and the machine runs one larger GEMM. The first sibling's call computes
    every part and keeps the others for the siblings' calls on the same input tensor (``is``);
    a call on any other input computes its own product. The layers' weights become views of the
    stacked one, so the model takes no more memory. Same products, so results agree to float
    rounding. Call after ``weight_major_linears`` (its forward is the fallback).
    """
    for module in model.modules():
        for names in SIBLINGS:
            linears = [getattr(module, name, None) for name in names]
            if (
                all(
                    type(lin) is torch.nn.Linear and lin.weight.dtype == torch.float32
                    for lin in linears
                )
                and len({lin.bias is None for lin in linears}) == 1
            ):
                # the stacked weight and bias, for a decoding step that runs the product itself
                module.__dict__.setdefault(FUSED, {})[names] = _fuse(linears)


def stack_linears(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights (and biases, where they have them) of linear layers that take the same input,
    stacked: one product's weight and bias."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = (
        torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
    )
    return weight, bias


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight, bias = stack_linears(linears)
    start = 0
    for lin in linears:
        end = start + lin.out_features
        lin.weight = torch.nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    sizes = [lin.out_features for lin in linears]
    kept: dict = {}  # the input the parts were computed for, and the parts not yet handed out
    fallbacks = [lin.forward for lin in linears]

    def first(x):
        index = _real_index(x)  # a padded prefill: its real tokens alone
        inner = x if index is None else x.reshape(-1, x.shape[-1])[index]
        rows = weight_major_rows(inner)
        kept.clear()
        if not (FUSED_PROJECTIONS and rows):
            return fallbacks[0](x)
        y = torch.mm(weight, inner.reshape(rows, -1).t())
        biases = bias.split(sizes) if bias is not None else [None] * len(sizes)
        parts = [_as_linear(part, b, inner) for part, b in zip(y.split(sizes), biases)]
        if index is not None:
            parts = [_scattered(part, index, x) for part in parts]
        kept.update(x=x, parts=dict(enumerate(parts[1:], 1)))
        return parts[0]

    def sibling(i):
        def forward(x):
            if kept.get("x") is x and i in kept["parts"]:
                part = kept["parts"].pop(i)
                if not kept["parts"]:
                    kept.clear()
                return part
            return fallbacks[i](x)

        return forward

    linears[0].forward = first
    for i, lin in enumerate(linears[1:], 1):
        lin.forward = sibling(i)
    return weight, bias
