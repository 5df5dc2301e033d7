"""A decoding step of a Llama-family model on CPU, run without transformers' per-layer machinery.

transformers' eager forward is written for every shape: per layer it builds views, transposes
each linear layer's output back to rows, looks attention up by name and hands keyword arguments
down, and per step it builds a 4-D mask. At a decoding step's shapes (tens of rows, one token
each) that glue is a large share of the step on a CPU. ``LeanDecode`` runs the same arithmetic
with the activations kept feature-major (``[hidden, rows]``): every linear layer is one
``W @ x`` product (the engine's weight-major layout, ``hf_cpu``), q, k and v one product and
gate and up another (the fused weights); the MLP's and the attention output's products feed the
next one with no copy, and q, k and v are turned to rows once for attention and the cache. Where
torch has oneDNN and memory holds a second copy of the weights, the step keeps its activations in
rows instead and runs every product through oneDNN on weights packed once, at start-up
(``x @ W^T``, ``PACKED_DECODE``): MKL repacks a weight at every call, which a product over tens
of columns does not repay. The rotary tables are computed once a step by the model's own rotary
module, and attention is called directly: the cascade over the batch's shared prefix
(``hf_cpu.cascade_decode_attention``) or, without one, torch's flash kernel with a KV head's
query group as its query length
(``hf_cpu.grouped_flash``). (On the AVX2 EPYC the whole 64-game generate stage ran 97.9 -> 86.6 s
with it, alternating in one process; docs/benchmarks.md.)

Where this machine builds them (``hf_native``: a C compiler, torch's OpenMP runtime GNU's, a check
against torch at start-up), the step's attention over each row's own columns and its
element-wise work (the residual add with the norm after it, SiLU(gate) x up, the rotary
embedding with k and v written into the cache) run small compiled kernels instead of torch's
ops: the 64-game stage's decoding steps 81.7 -> 60.3 s, alternating step by step.

It covers the architectures whose decoder layer is exactly pre-norm RMSNorm, rotary attention
with optional q/k/v/o biases, and a gated SiLU MLP: ``LEAN_MODEL_TYPES``. The engine turns it on
only after a check that its logits equal the model's own on a small batch (``lean_decode``), so
an architecture that differs in a detail (a norm on q and k, a scaled embedding, soft-capped
logits) keeps transformers' forward.

A bf16 model's step (the engine's ``dtype`` bf16, or ``auto`` where the measured choice,
``hf_dtype``, finds bf16 faster) runs its products in bf16 on weights packed for oneDNN (a CPU
with AVX-512 BF16 multiplies them at 2-3x its fp32 rate) and everything between them in fp32:
the residual stream, the norms, the rotary embedding and attention (over the bf16 KV cache,
widened as it is read). The logits are the LM head's bf16 product, widened to fp32 for the
sampler, as rounded as the model's own bf16 forward's. So it is closer to the exact result than
that forward, which rounds every step between the products to bf16 too; its start-up check
allows bf16's rounding (``TOLERANCE``). On
the AVX-512 BF16 EPYC (2 cores) the 64-game stage in bf16 ran 59.9 -> 34.5-39.0 s with it.
"""

from __future__ import annotations

import logging

import torch

from selfplay.engines import hf_native
from selfplay.engines.hf_cpu import (
    FUSED,
    SIBLINGS,
    SharedPrefix,
    additive_mask,
    cascade_decode_attention,
    grouped_flash,
    stack_linears,
)
from selfplay.hardware import available_memory

log = logging.getLogger(__name__)

# model types whose decoder layer LeanDecode computes (the check at start-up still decides)
LEAN_MODEL_TYPES = ("llama", "qwen2", "mistral")
# A step of 2 to this many rows computes its products over this many columns (zeros past its
# rows): MKL multiplied the model's weights by 2-13 columns in 89-113 ms a step's worth, by 16
# in 49 ms, by one column (its matrix-vector path) in 36 ms (SmolLM2-135M's shapes, fp32, 2
# threads, the AVX2 EPYC). A warm-started 64-game round, half its steps under 16 rows: the
# lean steps took 90.5 -> 75.4 s, the same games.
MIN_COLUMNS = 16
# and past that, a multiple of this many: MKL ran W @ x at 42 columns at 67-84 GFLOP/s against
# 83-105 at 48 (the same shapes and CPU), and a whole lean step at 19, 42, 53, 57 and 61 rows
# ran 1.09-1.18x faster padded so (1.0x at multiples of 8; 16 and 32 did no better).
COLUMN_MULTIPLE = 8
# vocabulary rows of the LM head a product at a time (LeanDecode._logits)
LM_HEAD_SLICE = 4096
# True: where the weights were packed (``lean_decode``), a step keeps its activations in rows and
# runs its products through oneDNN on them (``x @ W^T``); False: the feature-major step above,
# MKL's ``W @ x``, which repacks each weight at every call. Whole steps of SmolLM2-135M (fp32, 2
# threads, the AVX2 EPYC, 400 KV positions, the two alternating step by step; docs/benchmarks.md)
# ran 1.2-1.8x faster packed at 1-8 rows, 1.06-1.25x at 12-40 and 1.0-1.1x at 44-128. Read at
# call time, so a benchmark can alternate.
PACKED_DECODE = True
# the rows oneDNN packs the weights for (its reorder's batch size; 8 and 64 ran alike)
PACK_ROWS = 40
# how far (of the logits' scale) a lean step may be from the model's own forward at start-up:
# fp32 computes the same sums in another order; bf16's own forward rounds every norm, the residual
# stream and attention to bf16 (8 bits), where the lean step keeps them fp32. SmolLM2-135M's
# check read 0.014 in bf16, and 0.41 for a step without its rotary embedding
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.05}
# True: the engine's decoding steps run LeanDecode where it passed its check; read at call time,
# so a benchmark can alternate
LEAN_DECODE = True


def _stacked(module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused (weight, bias) of ``module``'s sibling linear layers (``hf_cpu``), stacked here
    where the engine did not fuse them."""
    fused = module.__dict__.get(FUSED, {}).get(names)
    if fused is not None:
        return fused
    return stack_linears([getattr(module, n) for n in names])


def _product(weight, bias, x):
    """``weight @ x`` (+ bias per output feature): a linear layer on feature-major ``x``."""
    if bias is None:
        return torch.mm(weight, x)
    return torch.addmm(bias[:, None], weight, x)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in oneDNN's blocked layout (a copy: the model keeps its own)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)


def _packed_product(packed, bias, x):
    """``x @ W^T`` (+ bias) with ``W`` packed by ``_pack``: a linear layer on rows ``x``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class _Layer:
    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        # the norms compute in fp32 (a bf16 model's too: its residual stream stays fp32 here)
        self.norm1 = layer.input_layernorm.weight.detach().float()
        self.eps1 = layer.input_layernorm.variance_epsilon
        self.norm2 = layer.post_attention_layernorm.weight.detach().float()
        self.eps2 = layer.post_attention_layernorm.variance_epsilon
        self.qkv = _stacked(attn, SIBLINGS[0])
        self.sizes = [getattr(attn, n).out_features for n in SIBLINGS[0]]
        self.o = (attn.o_proj.weight.detach(), _detached(attn.o_proj.bias))
        self.gate_up = _stacked(mlp, SIBLINGS[1])
        self.inter = mlp.gate_proj.out_features
        self.down = (mlp.down_proj.weight.detach(), _detached(mlp.down_proj.bias))
        self.act = mlp.act_fn
        self.scaling = attn.scaling
        self.packed: tuple[torch.Tensor, ...] | None = None  # qkv, o, gate_up, down (pack())

    def pack(self) -> None:
        self.packed = tuple(_pack(w) for w, _ in (self.qkv, self.o, self.gate_up, self.down))


def _detached(bias):
    return None if bias is None else bias.detach()


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the features of feature-major ``h`` ``[hidden, rows]`` (in rows:
    ``hf_native.add_rms_norm``)."""
    return weight[:, None] * (h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + eps))


class LeanDecode:
    """One decoding step of ``model`` (module docstring): ``step`` returns the next-token
    logits ``[rows, vocab]`` and appends each row's KV to ``cache`` as the model's forward
    would. ``pack()`` adds the packed weights of the rows' step."""

    def __init__(self, model) -> None:
        config = model.config.get_text_config()
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.layers = [_Layer(layer) for layer in inner.layers[: config.num_hidden_layers]]
        self.final_norm = inner.norm.weight.detach().float()
        self.final_eps = inner.norm.variance_epsilon
        # the products' dtype: the weights' (fp32, or bf16 where the step keeps everything
        # between the products in fp32: the residual stream, norms, rotary embedding, attention)
        self.dtype = model.dtype
        self.lm_head = model.lm_head.weight.detach()
        self.lm_bias = _detached(model.lm_head.bias)
        self.packed_head: torch.Tensor | None = None
        # the compiled kernels (hf_native.kernel()) where lean_decode found them, and whether
        # their attention covers this model's heads
        self.native = None
        group = self.heads // self.kv_heads
        self.native_attends = self.head_dim in hf_native.HEAD_DIMS and group <= hf_native.MAX_GROUP

    @property
    def packed(self) -> bool:
        return self.packed_head is not None

    def pack(self) -> None:
        """Pack every product's weight for the rows' step (a copy of the model's linear weights
        and head)."""
        for layer in self.layers:
            layer.pack()
        self.packed_head = _pack(self.lm_head)

    def unpack(self) -> None:
        for layer in self.layers:
            layer.packed = None
        self.packed_head = None

    def step(self, ids, positions, cache, attn, shared: int = 0) -> torch.Tensor:
        """Feed ``ids`` ``[rows]`` at ``positions`` ``[rows]`` after ``cache``, whose mask with
        the new token is ``attn`` ``[rows, width]`` (1: attend); the first ``shared`` columns
        hold the same tokens in every row (0: none)."""
        rows = ids.shape[0]
        x = self.embed(ids).float()  # [rows, hidden]: the residual stream, fp32
        cos, sin = self.rotary(x, positions[:, None])  # [rows, 1, dim]
        mask = attn.bool()[:, None, None, :]
        prefix = SharedPrefix(shared) if shared else None
        # the native kernel's runs of each row's own columns (after the shared prefix), or the
        # flash kernel's additive mask for attention without a shared prefix
        runs = cut = None
        if self.native is not None and self.native_attends and hf_native.NATIVE_ATTENTION:
            runs = hf_native.mask_runs(attn[:, shared:].bool())
        elif not prefix:
            cut = additive_mask(mask, x.dtype)
        context = (cos.view(rows, 1, -1), sin.view(rows, 1, -1), mask, prefix, cut, runs)
        if self.packed and (PACKED_DECODE or self.dtype != torch.float32):
            return self._rows_step(x, cache, context)
        return self._columns_step(x, cache, context)

    def _attend(self, layer, room, qkv, context, lib=None) -> torch.Tensor:
        """Attention of rows ``qkv`` ``[rows, q | k | v features]`` (a view will do): the rotary
        embedding and the cache's update (by ``lib``'s kernel where given: q rotated in place in
        ``qkv``, k and v written into the cache), attention over the cache (the compiled kernel
        where the step has its runs, else torch's flash kernel): ``[rows, heads x dim]``."""
        cos, sin, mask, prefix, cut, runs = context
        rows, dim = qkv.shape[0], self.head_dim
        q, k, v = qkv.split(layer.sizes, dim=1)
        two = cos.view(rows, dim), sin.view(rows, dim)
        turned = hf_native.rotary_cache(lib, qkv, *two, self.heads, self.kv_heads, room)
        if turned is not None:
            q, keys, values = turned.view(rows, self.heads, dim), room.keys, room.values
        else:  # in fp32, k and v stored in the cache's dtype (the model's)
            rotate = hf_native.rotate
            q = rotate(q.float().view(rows, self.heads, dim), cos, sin)
            k = rotate(k.float().view(rows, self.kv_heads, dim), cos, sin).to(self.dtype)
            v = v.view(rows, self.kv_heads, dim)
            keys, values = room.update(k[:, :, None], v[:, :, None])
        q = q[:, :, None]  # [rows, heads, 1, dim], fp32
        out = None
        if runs is not None:
            shared = prefix.length if prefix is not None else 0
            out = hf_native.attention(self.native, q, keys, values, runs, layer.scaling, shared)
        if out is None:  # torch's kernels, in the cache's dtype
            q = q.to(keys.dtype)
        if out is None and prefix is not None:
            out = cascade_decode_attention(q, keys, values, mask, layer.scaling, prefix)
        elif out is None:
            cut = additive_mask(mask, q.dtype) if cut is None else cut
            out = grouped_flash(q, keys, values, cut, layer.scaling)[0]
        return out.reshape(rows, self.heads * dim).to(self.dtype)

    def _columns_step(self, x, cache, context) -> torch.Tensor:
        """The step feature-major, every product MKL's ``W @ x``."""
        rows = x.shape[0]
        # [hidden, columns]: the rows, then zero columns (ignored at the end) up to MIN_COLUMNS
        # or the next multiple of COLUMN_MULTIPLE
        columns = (
            rows if rows == 1 else max(-(-rows // COLUMN_MULTIPLE) * COLUMN_MULTIPLE, MIN_COLUMNS)
        )
        h = x.new_zeros((x.shape[1], columns))
        h[:, :rows] = x.t()
        attended = x.new_zeros((self.heads * self.head_dim, columns))  # attention's output
        for layer, room in zip(self.layers, cache.layers):
            n = _rms_norm(h, layer.norm1, layer.eps1)
            # back to rows once for q, k and v: attention and the cache take rows
            qkv = _product(*layer.qkv, n)[:, :rows].t().contiguous()
            attended[:, :rows] = self._attend(layer, room, qkv, context).t()
            h = h + _product(*layer.o, attended)
            n = _rms_norm(h, layer.norm2, layer.eps2)
            gate, up = _product(*layer.gate_up, n).split(layer.inter)
            h = h + _product(*layer.down, layer.act(gate) * up)
        return self._logits(_rms_norm(h, self.final_norm, self.final_eps))[:rows]

    def _rows_step(self, x, cache, context) -> torch.Tensor:
        """The step in rows, every product on the packed weights (``pack``); the residual stream
        ``h`` (the embedding's own output) is added to in place, each add with the norm after
        it, and the element-wise work runs the compiled kernels where the engine has them
        (``hf_native``)."""
        lib = self.native if hf_native.NATIVE_ELEMENTWISE else None
        h, delta, dtype = x, None, self.dtype
        for layer, room in zip(self.layers, cache.layers):
            qkv_w, o_w, gate_up_w, down_w = layer.packed
            n = hf_native.add_rms_norm(lib, h, delta, layer.norm1, layer.eps1, dtype)
            qkv = _packed_product(qkv_w, layer.qkv[1], n)
            attended = self._attend(layer, room, qkv, context, lib)
            o = _packed_product(o_w, layer.o[1], attended)
            n = hf_native.add_rms_norm(lib, h, o, layer.norm2, layer.eps2, dtype)
            gate_up = _packed_product(gate_up_w, layer.gate_up[1], n)
            act = hf_native.silu_mul(lib, gate_up, layer.inter)  # lean_decode: SiLU models only
            delta = _packed_product(down_w, layer.down[1], act)
        n = hf_native.add_rms_norm(lib, h, delta, self.final_norm, self.final_eps, dtype)
        return _packed_product(self.packed_head, self.lm_bias, n).float()

    def _logits(self, n: torch.Tensor) -> torch.Tensor:
        """The LM head over feature-major ``n``: ``[rows, vocab]`` logits, computed weight-major
        a slice of the vocabulary at a time, each slice's product turned to rows while it is in
        cache (on the AVX2 EPYC, 48 rows: 24 ms against 33-38 ms for the product laid out as
        rows, and 34 ms for the whole product turned at once)."""
        rows, vocab = n.shape[1], self.lm_head.shape[0]
        logits = n.new_empty((rows, vocab))
        part = n.new_empty((LM_HEAD_SLICE, rows))
        for start in range(0, vocab, LM_HEAD_SLICE):
            weight = self.lm_head[start : start + LM_HEAD_SLICE]
            out = part[: weight.shape[0]]
            torch.mm(weight, n, out=out)
            logits[:, start : start + weight.shape[0]] = out.t()
        return logits if self.lm_bias is None else logits + self.lm_bias


def lean_decode(model, cache_layers: int) -> LeanDecode | None:
    """A ``LeanDecode`` of ``model`` where its architecture is one it covers and a check agrees:
    two rows (one left-padded) prefilled through the model, then one decoding step both ways
    from copies of that cache, the logits close to the model's (``_differs``). None (the engine
    keeps transformers' forward) otherwise: another model type, a dtype other than fp32 and
    bf16, a cache that is not plain full attention. The step gets packed weights where this
    torch has oneDNN, memory holds a copy of the weights and the same check agrees; a bf16
    model's step runs on packed weights only (its products are oneDNN's bf16 kernels), so
    without them it keeps transformers' forward."""
    from transformers import Cache

    from selfplay.engines.hf_kv import PreallocatedLayer

    config = model.config.get_text_config()
    if (
        getattr(config, "model_type", None) not in LEAN_MODEL_TYPES
        or model.dtype not in (torch.float32, torch.bfloat16)
        or not cache_layers
        or getattr(config, "hidden_act", None) != "silu"
    ):
        return None
    try:
        lean = LeanDecode(model)
    except AttributeError as e:  # a module laid out otherwise
        log.info("lean decoding off for %s: %s", type(model).__name__, e)
        return None
    lean.native = hf_native.kernel()  # the checks below run it
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (2, 6), generator=g)
    attn = torch.ones(2, 6, dtype=torch.long)
    attn[1, :2] = 0
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    caches = [Cache(layers=[PreallocatedLayer(8) for _ in range(cache_layers)]) for _ in range(3)]
    nxt = torch.randint(3, config.vocab_size, (2,), generator=g)
    wide = torch.cat([attn, attn.new_ones((2, 1))], dim=1)
    last = positions[:, -1] + 1
    full = model.dtype == torch.float32  # the feature-major step: fp32 only
    with torch.inference_mode():
        for cache in caches:
            model(input_ids=ids, attention_mask=attn, position_ids=positions,
                  past_key_values=cache, use_cache=True)  # fmt: skip
        want = model(input_ids=nxt[:, None], attention_mask=wide, position_ids=last[:, None],
                     past_key_values=caches[0], use_cache=True).logits[:, -1]  # fmt: skip
        if full:
            got = lean.step(nxt, last, caches[1], wide)  # not packed yet: the feature-major step
            if _differs(got, want, model, "lean decoding off"):
                return None
        if room_to_pack(model):
            try:
                lean.pack()
                got = lean.step(nxt, last, caches[2], wide)  # the packed step
            except RuntimeError as e:  # a torch without oneDNN's linear
                log.info("packed decoding steps off: %s", e)
                lean.unpack()
            else:
                if _differs(got, want, model, "packed decoding steps off"):
                    lean.unpack()
    if not full and not lean.packed:
        log.info("lean decoding off for %s in %s: no packed weights", type(model).__name__,
                 model.dtype)  # fmt: skip
        return None
    return lean


def room_to_pack(model) -> bool:
    """Whether this torch has oneDNN and the free memory holds twice the model's weights (the
    packed copy, with room to spare)."""
    free = available_memory("cpu")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return torch.backends.mkldnn.is_available() and free is not None and free > 2 * size


def _differs(got: torch.Tensor, want: torch.Tensor, model, what: str) -> bool:
    """Whether a lean step's logits are off the model's by more than ``TOLERANCE`` of their
    scale in the model's dtype (logged as ``what``)."""
    error = (got.float() - want.float()).abs().max().item() / max(1.0, want.abs().max().item())
    tolerance = TOLERANCE[model.dtype]
    if error > tolerance:
        log.info("%s for %s: logits differ by %.2g", what, type(model).__name__, error)
    return error > tolerance
