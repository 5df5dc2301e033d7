"""A decoding step of a Llama-family model on CPU, run without transformers' per-layer machinery.

transformers' eager forward is written for every shape: per layer it builds views, transposes
each linear layer's output back to rows, looks attention up by name and hands keyword arguments
down, and per step it builds a 4-D mask. At a decoding step's shapes (tens of rows, one token
each) that glue is a large share of the step on a CPU. ``LeanDecode`` runs the same arithmetic
with the activations kept feature-major (``[hidden, rows]``): every linear layer is one
``W @ x`` product (the engine's weight-major layout, ``hf_cpu``), q, k and v one product and
gate and up another (the fused weights); the MLP's and the attention output's products feed the
next one with no copy, and q, k and v are turned to rows once for attention and the cache. The
rotary tables are computed once a step by the model's own rotary module, and attention is called
directly: the cascade over the batch's shared prefix (``hf_cpu.cascade_decode_attention``) or,
without one, torch's flash kernel with a KV head's query group as its query length
(``hf_cpu.grouped_flash``). (On the AVX2 EPYC the whole 64-game generate stage ran 97.9 -> 86.6 s
with it, alternating in one process; docs/benchmarks.md.)

It covers the architectures whose decoder layer is exactly pre-norm RMSNorm, rotary attention
with optional q/k/v/o biases, and a gated SiLU MLP: ``LEAN_MODEL_TYPES``. The engine turns it on
only after a check that its logits equal the model's own on a small batch (``lean_decode``), so
an architecture that differs in a detail (a norm on q and k, a scaled embedding, soft-capped
logits) keeps transformers' forward.
"""

from __future__ import annotations

import logging

import torch

from selfplay.engines.hf_cpu import (
    FUSED,
    SIBLINGS,
    SharedPrefix,
    additive_mask,
    cascade_decode_attention,
    grouped_flash,
    stack_linears,
)

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


class _Layer:
    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1 = layer.input_layernorm.weight.detach()[:, None]
        self.eps1 = layer.input_layernorm.variance_epsilon
        self.norm2 = layer.post_attention_layernorm.weight.detach()[:, None]
        self.eps2 = layer.post_attention_layernorm.variance_epsilon
        self.qkv = _stacked(attn, SIBLINGS[0])
        self.sizes = [getattr(attn, n).out_features for n in SIBLINGS[0]]
        self.o = (attn.o_proj.weight.detach(), _detached(attn.o_proj.bias))
        self.gate_up = _stacked(mlp, SIBLINGS[1])
        self.inter = mlp.gate_proj.out_features
        self.down = (mlp.down_proj.weight.detach(), _detached(mlp.down_proj.bias))
        self.act = mlp.act_fn
        self.scaling = attn.scaling


def _detached(bias):
    return None if bias is None else bias.detach()


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the features of feature-major ``h`` ``[hidden, rows]``."""
    return weight * (h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[rows, heads, dim]`` (transformers' rotate-half form)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LeanDecode:
    """One decoding step of ``model`` (module docstring): ``step`` returns the next-token
    logits ``[rows, vocab]`` and appends each row's KV to ``cache`` as the model's forward
    would."""

    def __init__(self, model) -> None:
        config = model.config.get_text_config()
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.layers = [_Layer(layer) for layer in inner.layers[: config.num_hidden_layers]]
        self.final_norm = inner.norm.weight.detach()[:, None]
        self.final_eps = inner.norm.variance_epsilon
        self.lm_head = model.lm_head.weight.detach()
        self.lm_bias = _detached(model.lm_head.bias)

    def step(self, ids, positions, cache, attn, shared: int = 0) -> torch.Tensor:
        """Feed ``ids`` ``[rows]`` at ``positions`` ``[rows]`` after ``cache``, whose mask with
        the new token is ``attn`` ``[rows, width]`` (1: attend); the first ``shared`` columns
        hold the same tokens in every row (0: none)."""
        rows, heads, kv_heads, dim = ids.shape[0], self.heads, self.kv_heads, self.head_dim
        x = self.embed(ids)  # [rows, hidden]
        cos, sin = self.rotary(x, positions[:, None])  # [rows, 1, dim]
        cos, sin = cos.view(rows, 1, dim), sin.view(rows, 1, dim)
        mask = attn.bool()[:, None, None, :]
        prefix = SharedPrefix(shared) if shared else None
        # the flash kernel's additive mask, for attention without a shared prefix
        cut = None if prefix else additive_mask(mask, x.dtype)
        # [hidden, columns]: the rows, then zero columns (ignored at the end) up to MIN_COLUMNS
        # or the next multiple of COLUMN_MULTIPLE
        columns = (
            rows if rows == 1 else max(-(-rows // COLUMN_MULTIPLE) * COLUMN_MULTIPLE, MIN_COLUMNS)
        )
        h = x.new_zeros((x.shape[1], columns))
        h[:, :rows] = x.t()
        attended = x.new_zeros((heads * dim, columns))  # attention's output, feature-major
        for layer, room in zip(self.layers, cache.layers):
            n = _rms_norm(h, layer.norm1, layer.eps1)
            # back to rows once for q, k and v: attention and the cache take rows
            qkv = _product(*layer.qkv, n)[:, :rows]
            q, k, v = qkv.t().contiguous().split(layer.sizes, dim=1)
            q = _rotate(q.view(rows, heads, dim), cos, sin)
            k = _rotate(k.view(rows, kv_heads, dim), cos, sin)
            v = v.view(rows, kv_heads, dim)
            keys, values = room.update(k[:, :, None], v[:, :, None])
            q = q[:, :, None]  # [rows, heads, 1, dim]
            if prefix is not None:
                out = cascade_decode_attention(q, keys, values, mask, layer.scaling, prefix)
            else:
                out = grouped_flash(q, keys, values, cut, layer.scaling)[0]
            attended[:, :rows] = out.reshape(rows, heads * dim).t()
            h = h + _product(*layer.o, attended)
            n = _rms_norm(h, layer.norm2, layer.eps2)
            gate, up = _product(*layer.gate_up, n).split(layer.inter)
            h = h + _product(*layer.down, layer.act(gate) * up)
        return self._logits(_rms_norm(h, self.final_norm, self.final_eps))[:rows]

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
    from copies of that cache, the logits within 1e-4 of the model's (relative to their scale).
    None (the engine keeps transformers' forward) otherwise: another model type, fp32 not the
    dtype, a cache that is not plain full attention."""
    from transformers import Cache

    from selfplay.engines.hf_kv import PreallocatedLayer

    config = model.config.get_text_config()
    if (
        getattr(config, "model_type", None) not in LEAN_MODEL_TYPES
        or model.dtype != torch.float32
        or not cache_layers
        or getattr(config, "hidden_act", None) != "silu"
    ):
        return None
    try:
        lean = LeanDecode(model)
    except AttributeError as e:  # a module laid out otherwise
        log.info("lean decoding off for %s: %s", type(model).__name__, e)
        return None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (2, 6), generator=g)
    attn = torch.ones(2, 6, dtype=torch.long)
    attn[1, :2] = 0
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    caches = [Cache(layers=[PreallocatedLayer(8) for _ in range(cache_layers)]) for _ in range(2)]
    nxt = torch.randint(3, config.vocab_size, (2,), generator=g)
    wide = torch.cat([attn, attn.new_ones((2, 1))], dim=1)
    last = positions[:, -1] + 1
    with torch.inference_mode():
        for cache in caches:
            model(input_ids=ids, attention_mask=attn, position_ids=positions,
                  past_key_values=cache, use_cache=True)  # fmt: skip
        want = model(input_ids=nxt[:, None], attention_mask=wide, position_ids=last[:, None],
                     past_key_values=caches[0], use_cache=True).logits[:, -1]  # fmt: skip
        got = lean.step(nxt, last, caches[1], wide)
    error = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    if error > 1e-4:
        log.info("lean decoding off for %s: logits differ by %.2g", type(model).__name__, error)
        return None
    return lean
